"""The capacity-following total: pure arithmetic, run every ``interval_s`` (5 s) by the service.

The configured ``cluster.total`` (and ``cluster.hard_cap``) are ceilings. Below them the total
follows what the workers report: their summed runtime-token capacity, times a factor that the
workers' real utilisation moves — above the high watermark (0.8) the factor tightens, below the
low watermark (0.5) it loosens. Admission estimates (max_tokens reservations, prefix caching)
then correct themselves from measurement instead of a hand-tuned constant.

When the caller also passes what the admitters have **reserved**, the factor is measured rather
than stepped: a reservation books the whole prompt twice (prefill owed + KV held) and the expected
output for the request's whole life, while a worker holds only the KV it has (and the prefill it
still owes), so ``reserved / workers_used`` runtime tokens are booked per token really held —
about 2 for prompt-heavy chat. The factor at which the workers hold the **high watermark** of
their capacity when the total is used up is ``high x reserved / workers_used``; it moves halfway
there per interval (bounded as before). A ±10 % step every 25 s needs minutes to undo a 2x
over-booking, during which requests queue at the door while the engines have room.

Why the watermark and not full: the workers' KV fills *after* the door lets a request in (its
prefill comes first), so a total aimed at full KV lets a surge through until the engines are
past full, and the excess then waits inside them, where the door's SLO rule can no longer move
it to the offline path. A fixed ceiling (4x the KV, standing in for an operator's
``cluster.total`` in the simulator) hid that by holding the door before the fact, and held it
too at 60 % KV when the prompts shared more: the booking ratio there was 6.6, the ceiling 4
(``elastic`` after a kill: 1-2.6 s at the door while the engines had room). Aimed at the
watermark, with no fixed ceiling below the factor bound, the door holds where the engines' KV
really is 80 % full: ``natsched bench scenarios --seeds 3`` (docs/scenarios.md, "The door aimed
at the high watermark"). An older measurement against the watermark (chat at 80 % of capacity:
TTFT p99 5.3 s, 2 s without admission) was made while the factor's ceiling was a fixed 2, before
it followed the measured sharing; it no longer applies.

**The factor's ceiling follows the measured prefix sharing.** "A prompt is booked at most twice"
holds only when every request's prompt is its own. A prefix shared by many requests (a tenant's
system prompt, a knowledge-base chunk, a session's history) is held ONCE in the workers' KV while
every request's reservation books it. With ``h`` the share of prompt tokens served from cache, a
request of prompt ``p`` and output ``o`` books ``2p + o`` and makes the workers hold about
``(1 − h)p + o`` (its uncached part; the cached part is already there, paid for once), so the
true booking ratio is up to ``2 / (1 − h)``: 10 at 80 % sharing. A fixed ceiling of 2 then holds
requests at the door while the engines have room (on a chat/RAG trace TTFT p99 27 s against 2 s
for the same routing without admission). So the ceiling is ``max_factor / (1 − h)``, with ``h``
the cluster's measured hit share (:class:`CacheShare`, cached / prompt tokens of completions,
decayed): no sharing gives ``max_factor`` exactly as before. ``h`` is a measurement a worker
reports, so the ceiling is bounded by ``factor_bound`` (a guard against a share near 1 from a few
lucky or forged completions, not a tuning knob), and the total never exceeds the configured
``cluster.total`` / ``cluster.hard_cap``, whatever is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping


@dataclass
class DynamicTotalSettings:
    enabled: bool = True
    interval_s: float = 5.0  # cheap arithmetic on the heartbeats already read; 25 s left requests queued
    # at the door for the first half minute of every change (a burst, a new worker)
    high: float = 0.8  # the share of the workers' KV the measured factor fills them to (above it: tighten)
    low: float = 0.5
    tighten: float = 0.9
    loosen: float = 1.1
    min_factor: float = 0.5
    max_factor: float = 2.0  # the ceiling without prefix sharing: prefill owed + KV held
    factor_bound: float = 16.0  # the hard ceiling whatever the measured share (module docstring)
    share_half_life_s: float = 30.0  # CacheShare's memory: a few intervals, so a change of traffic shows


def factor_ceiling(s: DynamicTotalSettings, cache_share: float | None) -> float:
    """``max_factor / (1 − h)``, bounded by ``factor_bound``; ``max_factor`` without a measurement."""
    if cache_share is None or not 0.0 < cache_share:
        return s.max_factor
    h = min(cache_share, 1.0)
    return s.factor_bound if h >= 1.0 else min(s.factor_bound, max(s.max_factor, s.max_factor / (1.0 - h)))


@dataclass
class CacheShare:
    """The cluster's prefix-cache hit share from completions: cached / prompt tokens, both sums
    decayed with a half-life, so it follows the traffic of the last minute or so. Pure: the caller
    passes the time. A completion's counts are clamped (cached within [0, prompt]): a worker's bad
    numbers move the share at most to 1, which the factor bound then holds."""

    half_life_s: float = 30.0
    cached: float = 0.0
    prompt: float = 0.0
    at: float | None = None

    def _decay(self, now: float) -> None:
        if self.at is not None and now > self.at and self.half_life_s > 0:
            k = math.exp2(-(now - self.at) / self.half_life_s)
            self.cached *= k
            self.prompt *= k
        if self.at is None or now > self.at:
            self.at = now

    def observe(self, prompt_tokens: int, cached_tokens: int, now: float) -> None:
        if prompt_tokens <= 0:
            return
        self._decay(now)
        self.prompt += prompt_tokens
        self.cached += min(prompt_tokens, max(0, cached_tokens))

    def share(self) -> float | None:
        """None before any completion was seen (the ceiling stays ``max_factor``)."""
        return self.cached / self.prompt if self.prompt > 0 else None


@dataclass
class DynamicTotal:
    settings: DynamicTotalSettings
    factor: float = 1.0

    def next_total(self, configured: int, hard_cap: int | None, capacity: int, workers_used: int,
                   reserved: int | None = None, cache_share: float | None = None) -> int:
        """The total to admit against now; the configured total when no worker reports capacity.
        With ``reserved`` (runtime tokens the admitters hold) the factor is measured; with
        ``cache_share`` (the measured prefix-cache hit share) its ceiling rises with the sharing
        (module docstring)."""
        ceiling = configured if hard_cap is None else min(configured, hard_cap)
        if not self.settings.enabled or capacity <= 0:
            return ceiling
        util = workers_used / capacity
        s = self.settings
        top = factor_ceiling(s, cache_share)
        if reserved is not None and reserved > 0 and workers_used > 0:
            target = s.high * reserved / workers_used  # the factor that fills them to the watermark
            self.factor = max(s.min_factor, min(top, self.factor + 0.5 * (target - self.factor)))
        elif util > s.high:
            self.factor = max(s.min_factor, self.factor * s.tighten)
        elif util < s.low:
            self.factor = min(top, self.factor * s.loosen)
        else:
            self.factor = min(top, self.factor)  # the sharing fell: the ceiling with it
        return max(0, min(ceiling, int(capacity * self.factor)))


@dataclass
class ModelLoad:
    """What one live worker's heartbeat says, for the per-model totals: the models it serves, the
    runtime tokens it can hold and those it holds now."""

    models: frozenset[str]
    capacity: int
    used: int


def _by_model(workers: Iterable[ModelLoad]) -> tuple[dict[str, int], dict[str, int]]:
    """(capacity, used) summed per model over the workers serving it (bad negatives count 0)."""
    capacity: dict[str, int] = {}
    used: dict[str, int] = {}
    for w in workers:
        for m in w.models:
            capacity[m] = capacity.get(m, 0) + max(0, w.capacity)
            used[m] = used.get(m, 0) + max(0, w.used)
    return capacity, used


@dataclass
class ModelTotals:
    """**Per-model capacity**: the same capacity-following total, once per model, over the workers
    that serve that model only.

    One total for all models lets a model whose pool is full keep taking requests as long as the
    other models' pools have room: they are booked against the cluster's KV, but only the small
    pool's workers can run them, so they queue in those engines (and preempt each other) while
    the door sees room. Each model's admitted runtime tokens are bounded here by what its own
    workers can hold × its own measured factor (:class:`DynamicTotal`: ``reserved_m / used_m``,
    the ceiling ``max_factor / (1 − h)``); the cluster total and a configured ``model.<m>`` limit
    stay caps over it (:meth:`natsched.admitter.policy.AdmitterCore.set_model_totals`).

    A worker counts for every model it serves (a fronted server's LoRA adapters share its KV), so
    models sharing workers may together book past those workers; the cluster total still holds.
    A model whose workers report no capacity (0: unknown) gets no bound of its own (None). A
    model no live worker serves is absent from the result: the core holds its requests at the
    door (bound 0) until a worker of it comes back or they time out, instead of sending them to
    a pool that has no one. Factors are kept per model across intervals, like the total's. Pure:
    the caller passes what the heartbeats and the shared usage say."""

    settings: DynamicTotalSettings
    factors: dict[str, DynamicTotal] = field(default_factory=dict)

    def next_totals(self, workers: Iterable[ModelLoad], reserved: Mapping[str, int], ceiling: int,
                    cache_share: float | None = None) -> dict[str, int | None]:
        """Per model served by a live worker: its bound in runtime tokens (None: no bound of its
        own), never above ``ceiling`` (the cluster total in force)."""
        capacity, used = _by_model(workers)
        out: dict[str, int | None] = {}
        for m, cap in capacity.items():
            if cap <= 0 or not self.settings.enabled:
                out[m] = None
                continue
            dyn = self.factors.get(m)
            if dyn is None:
                dyn = self.factors[m] = DynamicTotal(self.settings)
            dyn.settings = self.settings  # live knobs
            out[m] = dyn.next_total(ceiling, None, cap, used[m], reserved=reserved.get(m, 0), cache_share=cache_share)
        return out

    def current(self, workers: Iterable[ModelLoad], ceiling: int) -> dict[str, int | None]:
        """The bounds at the factors in force, without a step (a worker joined or left between
        intervals: the bound follows the capacity at once)."""
        capacity, _ = _by_model(workers)
        out: dict[str, int | None] = {}
        for m, cap in capacity.items():
            dyn = self.factors.get(m)
            factor = dyn.factor if dyn is not None else 1.0
            out[m] = None if cap <= 0 or not self.settings.enabled else max(0, min(ceiling, int(cap * factor)))
        return out
