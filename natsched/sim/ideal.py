"""The ideal cluster's TTFT: what no routing and no admission can beat, request by request. Pure.

Why: a TTFT p99 over the two hundred requests of an elastic phase is its second-longest TTFT. When
the longest cold prompts set it, their prefill is the p99 whatever the policy does, and two good
policies are level because both are near it. The goodput headline has its ceiling (every offered
request served in time); this is the same for the TTFT headlines: how far down any contender could go
on these arrivals, so that "level" can be told apart from "nothing left to win".

``ideal_ttfts`` gives each request of a trace the first-token time of an ideal cluster
(``ideal_cached``, the prompt tokens that cluster has cached for it):

- its longest prefix seen in *any* earlier prompt is cached (the reuse ceiling's infinite cache,
  :func:`~natsched.sim.metrics.ceiling_hit_ratio`), capped as the engine caps it so that the last
  prompt token is computed;
- the rest is prefilled alone, on an idle engine of the fastest profile serving its model, at full
  speed, with no network, routing or queue in front of it;
- chunked as the engine chunks it (``max_num_batched_tokens`` per step), each step costing what
  :meth:`~natsched.workers.simcore.SimCore.step` charges: ``max(compute, memory) + overhead``.

Every contender's TTFT of a request is at least its ideal one (the simulator charges every one of these
costs and more), so any order statistic of a contender's TTFTs over a set of requests — the p99 of a
phase — is at least the same statistic of the ideal TTFTs over that set: a floor,
as the goodput ceiling is a ceiling.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from natsched.sim.metrics import reusable_blocks
from natsched.sim.trace import TraceRequest
from natsched.workers.profiles import EngineProfile


def prefill_alone_s(profile: EngineProfile, prompt_tokens: int, cached_tokens: int) -> float:
    """Seconds from the first prefill step to the first token of one request alone on an idle engine."""
    computed, target = cached_tokens, max(1, prompt_tokens)
    chunk = profile.max_num_batched_tokens
    total = 0.0
    while computed < target:
        n = min(chunk, target - computed)
        compute = profile.prefill_seconds(n, computed)
        computed += n
        total += profile.step_seconds(compute, computed)  # the KV read: what exists after this step
    return total


def fastest_per_model(profiles: Iterable[tuple[str, EngineProfile]]) -> dict[str, EngineProfile]:
    """Per model, the profile that prefills a reference prompt soonest (of every worker that ever
    serves it, added ones included)."""
    best: dict[str, EngineProfile] = {}
    for model, p in profiles:
        cur = best.get(model)
        if cur is None or prefill_alone_s(p, 4096, 0) < prefill_alone_s(cur, 4096, 0):
            best[model] = p
    return best


def ideal_cached(requests: Iterable[TraceRequest], block_size: int) -> dict[int, int]:
    """Request index -> the prompt tokens the ideal cluster has cached for it: its longest prefix
    seen in any earlier prompt, capped as the engine caps it."""
    seen: set[int] = set()
    out: dict[int, int] = {}
    for r in sorted(requests, key=lambda r: (r.arrival, r.index)):
        out[r.index] = reusable_blocks(r, seen, block_size) * block_size
        seen.update(r.hashes)
    return out


def ideal_ttfts(requests: Iterable[TraceRequest], block_size: int,
                fastest: Mapping[str, EngineProfile], speed: float = 1.0,
                cached: Mapping[int, int] | None = None) -> dict[int, float]:
    """Request index -> its ideal TTFT (see the module docstring). ``speed``: the largest speed
    factor any worker runs at (1.0 unless a scenario speeds one up); ``cached``:
    :func:`ideal_cached` of the same requests, when the caller has it already."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed!r}")
    requests = list(requests)
    if cached is None:
        cached = ideal_cached(requests, block_size)
    default = next(iter(fastest.values()), None)
    out: dict[int, float] = {}
    for r in requests:
        profile = fastest.get(r.model or "default", default)
        if profile is None:
            raise ValueError("ideal_ttfts needs at least one worker profile")
        out[r.index] = prefill_alone_s(profile, r.input_length, cached[r.index]) / speed
    return out
