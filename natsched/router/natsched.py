"""``natsched``: the default policy — time to first token, traded against cached prefix and cache health.

For each candidate worker ``w`` (lower score wins)::

    ttft(w)  = wait(w)  prefill queued ahead on w, in seconds (natsched.router.backlog: busy-until)
             + own(w)   this request's UNCACHED prefill on w, attention included
    est(w)   = ttft(w) + decode_weight x its decode time on w (steps slowed by w's batch KV)
               (+ waiting for KV room, rare)
    score(w) = est(w)
             - locality(u) x worth(w) x prefill time of the tokens w has cached
             + churn_weight x own(w) x churn(w) / mean churn        (cache pressure)
             - stickiness  (w got this prefix within sticky_window_s)
             - warm-up     (w joined less than warmup_s ago)
             - home        (optional: w owns the prefix's route key on a bounded-load hash ring)

Every "seconds" above is the candidate's own: its learned cost model (``deps.costs.of(w)``,
:mod:`natsched.router.learned`), so a slower GPU or a larger model costs what it really costs;
``own`` includes its first-token overhead, and a prefix that continues in its *host* KV tier is
priced at the transfer time instead of a recompute (``host_tokens`` in the terms). The audit
terms name the estimate used (``cost_learned``, ``cost_samples``, ``cost_prefill_tps``, ...).

Choices, and why (numbers: `natsched bench routing` on the Mooncake synthetic trace, 8 workers,
~80 % busy, and a generated chat/document trace with another sharing structure):

- **TTFT first.** A worker prefills first-come first-served in chunks, so a request's time to first
  token is the prefill queued ahead of it plus its own uncached prefill; both are counted in
  *seconds*: tokens at a long context cost up to ~3x more (attention), and the tail of the TTFT
  distribution is made of exactly those long prompts. ``wait`` is the busy-until estimate kept
  by the registry, which attributes a heartbeat's queued tokens to our own assignments and moves
  on with the clock between heartbeats (its error on the chosen worker is about half that of
  the raw token count).
- **Decode weighs less than TTFT** (``decode_weight`` 0.3): the full time to finish (weight 1)
  sends requests away from cache holders whenever their batch is heavier — 180 output tokens at
  +10 ms a step outweigh most prefill savings — which cost hit ratio and TTFT; weight 0 ignores
  decode entirely and lets long chat sessions pile up on a few workers (load CV 0.2+). The batch
  KV is the heartbeat's used blocks plus what we assigned since.
- **Cache always counts fully** through ``own`` (physics). ``locality(u) = locality_boost x
  (1 - u)^k`` adds the *future* value of keeping a prefix where it is (the next request of that
  prefix hits there; a copy elsewhere costs a full prefill now and cache room later). It fades
  as the mean utilisation ``u`` (KV or batch slots) of the candidates nears 1, so balance
  decides at saturation (when prefill, not KV, is the bottleneck, ``u`` stays low and locality
  keeps nearly full strength until queues form; KV counts only while requests wait for room, see
  :func:`queue_pressure`). Boost 6, fading linearly (k = 1): at boost 1
  a holder was abandoned as soon as its queue exceeded twice the saving, which lost 0.5-1 point
  of hit ratio to policies that always exploit; at 8 requests waited behind long prefills and
  the TTFT tail grew. Boost 4 with k = 2 was chosen on loads that were really 67-88 % busy (the
  benchmark then calibrated on the trace's first 1,000 requests); at the whole trace's 80 and
  90 % it faded too fast and the hit ratio fell just below the best peer's (-0.08, -0.14
  points over 5 loads), where 6 and k = 1 are +0.15 above it, and the TTFT p99 stays under
  every peer's from 70 to 90 % (thinner at 70 %: 3.049 s against dynamo_kv's 3.057).
- **Cache pressure** (``churn_weight``): every uncached token becomes a new cache block that
  pushes an older one out of that worker's LRU, and an evicted prefix costs a prefill again when
  its next request comes. So an uncached token costs its prefill now *plus* an expected eviction
  cost later, larger on a worker that computed more than the others lately (it evicts sooner).
  The term is ``churn_weight x own x churn(w) / mean churn`` — recent uncached tokens routed to
  ``w``, decayed over ``churn_window_s`` (about a worker's cache horizon at moderate load), over
  the candidates' mean: at balance it counts ``own`` once more, on a worker churning twice the
  mean twice more. It keeps every cache's horizon alike: on the synthetic trace it raised the hit
  ratio by ~1.5 points and cut the load CV from ~0.16 to ~0.02; a variant centred on the mean
  (no extra cost at balance) gave 0.2-1 point less hit ratio and a worse p99 at two of three
  loads near 80 % busy.
- **A cached prefix is worth waiting for only up to what it saves**: the future value above is
  scaled by :func:`worth_waiting` = ``max(0, 1 - wait / saved)``, so a holder queued longer than
  its prefix saves gets none of it. Why: ``u`` misses prefill-bound clusters (vLLM counts queued
  chunked prefills as running), where a holder was chosen with a 3.8 s queue for a 0.9 s saving
  (``elastic`` on 12 workers). Three draws per load: elastic worst-phase p99 2.37 -> 1.93 s,
  elastic-12 2.82 -> 1.95 s, chat-rag p99 2.07 -> 1.81 s. It costs hit ratio where queues are
  short and frequent (the Mooncake trace: 34.4 -> 33.6 %, behind the best peer's 34.0 %); the
  gentler forms that kept it gave the tail back (docs/scenarios.md).
- Minimum gain: a match under ``min_gain`` (30 %) of the prompt is ignored — it saves too little
  to justify pulling the request away from a less loaded worker, and it is mostly noise.
- Replica cap: when ``replica_cap`` workers already hold a useful match, new copies are not made
  (the others are not candidates) — unless every holder is past ``replica_raise_util``, or queued
  longer than the prefix saves it: then the prefix's load exceeds what its replicas serve and
  one more replica is allowed.
- Stickiness: the worker that most recently got the matched prefix wins ties by a hysteresis of
  ``max(stickiness_s, stickiness x est)``, for ``sticky_window_s`` — a prefix does not bounce
  between replicas on small load wiggles.
- Warm-up: a new (or re-registered) worker has a cold cache and would lose every cache-weighted
  comparison; it is treated as if ``warmup_boost`` of the prompt were cached, decaying linearly
  to nothing over ``warmup_s`` — *instead of* what it really holds of the prompt, not on top of it:
  a joiner that already holds the prefix is no longer cold for it. Like a real prefix, its future
  value is scaled by :func:`worth_waiting` of the joiner's queue.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from natsched.wire.schema import WorkerId
from natsched.wire.ids import BlockHash
from natsched.router.deps import PolicyDeps, cached_tokens
from natsched.router.errors import ConfigError
from natsched.router.hashring import HashRing
from natsched.router.policy import RouteDecision, RouteRequest, WorkerView


@dataclass
class NatschedParams:
    locality_boost: float = 6.0  # extra weight of cached tokens at an idle cluster
    locality_exponent: float = 1.0  # k in (1 - u)^k
    min_gain: float = 0.3  # matches below this share of the prompt are ignored
    sticky_window_s: float = 30.0  # how long a prefix stays with the worker that last got it
    stickiness: float = 0.05  # hysteresis as a share of the sticky worker's estimate
    stickiness_s: float = 0.01  # ... and at least this many seconds
    replica_cap: int = 3  # workers that may hold one hot prefix ...
    replica_raise_util: float = 0.85  # ... unless all of them are busier than this
    warmup_s: float = 60.0  # how long a newly joined worker gets a boost
    warmup_boost: float = 0.5  # as if this share of the prompt were cached on it, at join time
    decode_weight: float = 0.3  # weight of the decode time against the time to first token
    churn_weight: float = 1.0  # cache-pressure penalty, x own prefill x relative recent churn
    churn_window_s: float = 60.0  # decay time of the recent-churn counters
    consistent_hash: bool = False  # cold prefixes get a "home" on a bounded-load hash ring
    home_bonus: float = 0.2  # share of the home worker's estimate taken off its score
    ring_vnodes: int = 160
    ring_load_factor: float = 1.25  # bounded load: at most this x the mean in-flight count
    sticky_max_entries: int = 100_000

    def __post_init__(self) -> None:
        if not 10.0 <= self.sticky_window_s <= 60.0:
            raise ConfigError("natsched: sticky_window_s must be within 10..60 s")
        if not 0.0 <= self.min_gain <= 1.0 or self.replica_cap < 1 or self.warmup_s < 0:
            raise ConfigError("natsched: min_gain in [0, 1], replica_cap >= 1, warmup_s >= 0")
        if self.ring_load_factor < 1.0:
            raise ConfigError("natsched: ring_load_factor must be >= 1")
        if self.decode_weight < 0 or self.churn_weight < 0 or self.churn_window_s <= 0:
            raise ConfigError("natsched: decode_weight, churn_weight >= 0 and churn_window_s > 0")


def queue_pressure(cost, w: WorkerView) -> float:
    """How close ``w`` is to making new work wait, in [0, 1]: its batch slots in use, and its KV in
    use only while requests wait for room. Full KV alone is no pressure: on a small GPU a handful
    of running sequences fill it at any load (an L4 holds four 8k-token chats), and fading locality
    on it threw cache hits away at moderate load (chat-rag on 8 L4s: hit ratio 71 % against a
    cache-aware peer's 83 %, TTFT p99 2x theirs)."""
    slots = w.inflight / cost.max_running
    kv = w.load_tokens / cost.capacity_tokens(w) if w.waiting > 0 else 0.0
    u = kv if kv > slots else slots
    return 1.0 if u > 1.0 else u


def worth_waiting(wait: float, saved: float) -> float:
    """The share of a cached prefix's future value left on a holder queued ``wait`` seconds, when
    the prefix saves ``saved`` seconds of prefill there: ``1 - wait / saved``, never below 0.

    Why: the locality boost pays for keeping a prefix where it is, because its next requests hit
    there. That is worth something only while a request gains by going there: a holder queued
    longer than the prefix saves serves its next requests later than a cold worker would, so the
    copy it holds is worth nothing to them. :func:`queue_pressure` does not see this on a
    prefill-bound cluster (vLLM counts queued chunked prefills as running, not waiting): in
    ``elastic`` on 12 workers a holder was chosen with a 3.8 s queue for a prefix that saved 0.9 s,
    over a cold worker queued 1.3 s. Linear, so a queue difference between two holders still
    counts ``1 + locality`` times instead of flipping at a step (a step form was worse on every
    scenario measured)."""
    if saved <= 0.0:
        return 0.0
    w = 1.0 - wait / saved
    return w if w > 0.0 else 0.0


class Churn:
    """Per-worker count of uncached tokens routed to it, decaying exponentially over ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._v: dict[WorkerId, tuple[float, float]] = {}  # worker -> (value, at)

    def at(self, w: WorkerId, now: float) -> float:
        v = self._v.get(w)
        if v is None:
            return 0.0
        dt = now - v[1]
        return v[0] * math.exp(-dt / self.window_s) if dt > 0 else v[0]

    def add(self, w: WorkerId, tokens: float, now: float) -> None:
        self._v[w] = (self.at(w, now) + tokens, now)


class NatschedPolicy:
    """The default cache- and load-aware policy; see the module docstring for the score."""

    name = "natsched"
    Params = NatschedParams
    cache_belief = "index"  # expected_cached_tokens is the shared index's match

    def __init__(self, deps: PolicyDeps | None = None, params: NatschedParams | None = None) -> None:
        self.deps = deps or PolicyDeps()
        self.p = params or NatschedParams()
        self._sticky: OrderedDict[BlockHash, tuple[WorkerId, float]] = OrderedDict()
        self._ring = HashRing(self.p.ring_vnodes)
        self.churn = Churn(self.p.churn_window_s)

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        d, p = self.deps, self.p
        prompt = req.prompt_tokens
        raw = d.index.match(req.hashes, now, [w.id for w in workers])
        useful = self._useful(raw, prompt)
        pool, capped = self._apply_replica_cap(workers, useful, now)
        depth = max(raw.values()) if raw else 0
        sticky = self._sticky_worker(req.hashes, depth, now) if useful else None
        home = self._home(req, workers) if p.consistent_hash and not useful else None
        terms: dict[str, dict[str, float]] = {}
        host = self._host_hits(req, pool, raw) if d.index.has_host else {}
        scores = self._score(req, pool, workers, useful, sticky, home, now, terms, host)
        best = min(pool, key=lambda w: (scores[w.id], w.inflight, w.id))
        self._remember(req.hashes, depth, best.id, now)
        expected = cached_tokens(raw.get(best.id, 0), d.block_tokens, prompt) + host.get(best.id, 0)
        self.churn.add(best.id, prompt - expected, now)
        reason = "sticky" if best.id == sticky else "cache" if best.id in useful else "home" if best.id == home else "load"
        if capped:
            reason += "+capped"
        return RouteDecision(best.id, self.name, scores, expected, reason, terms)

    def _host_hits(self, req: RouteRequest, pool: Sequence[WorkerView], raw: dict[WorkerId, int]) -> dict[WorkerId, int]:
        """Prompt tokens each worker's host tier holds right after its GPU match."""
        bt, prompt, index = self.deps.block_tokens, req.prompt_tokens, self.deps.index
        out = {}
        for w in pool:
            start = raw.get(w.id, 0)
            more = index.match_host(req.hashes, w.id, start)
            if more:
                out[w.id] = cached_tokens(start + more, bt, prompt) - cached_tokens(start, bt, prompt)
        return out

    def _useful(self, raw: dict[WorkerId, int], prompt: int) -> dict[WorkerId, int]:
        """Cached tokens per worker, keeping only matches worth at least ``min_gain`` of the prompt."""
        bt = self.deps.block_tokens
        floor = self.p.min_gain * prompt
        out = {}
        for w, n in raw.items():
            t = cached_tokens(n, bt, prompt)
            if t > 0 and t >= floor:
                out[w] = t
        return out

    def _apply_replica_cap(self, workers: Sequence[WorkerView], useful: dict[WorkerId, int], now: float):
        """Only holders stay candidates once ``replica_cap`` hold it, unless all of them are busy —
        past ``replica_raise_util``, or each queued longer than the prefix saves it
        (:func:`worth_waiting`): then the prefix's load exceeds what its replicas serve."""
        if len(useful) < self.p.replica_cap:
            return workers, False
        holders = [w for w in workers if w.id in useful]
        util = self.deps.cost.utilisation
        if all(util(w) >= self.p.replica_raise_util for w in holders):
            return workers, False  # the prefix needs more replicas than it has
        if all(self._worth(w, useful[w.id], now) <= 0.0 for w in holders):
            return workers, False  # every replica is queued past what it saves
        return holders, True

    def _worth(self, w: WorkerView, cached: int, now: float) -> float:
        wc = self.deps.costs.of(w.id)
        return worth_waiting(wc.wait_s(w, now), wc.prefill_ctx_s(cached))

    def _score(self, req, pool, workers, useful, sticky, home, now, terms=None, host=None) -> dict[str, float]:
        """Lower is better: estimated seconds to first token, minus the bonuses below.

        ``terms`` (when given) receives each candidate's parts for the audit trail."""
        p, cost, costs = self.p, self.deps.cost, self.deps.costs
        prompt, out = req.prompt_tokens, req.expected_output
        need = prompt + out
        u = sum(queue_pressure(cost, w) for w in workers) / len(workers)
        locality = p.locality_boost * (1.0 - u) ** p.locality_exponent
        churn = {w.id: self.churn.at(w.id, now) for w in workers} if p.churn_weight else {}
        mean_churn = (sum(churn.values()) / len(churn) if churn else 0.0) or 1.0
        eldest = max(now - w.joined_at for w in workers)  # how long the pool has been warming up
        scores: dict[str, float] = {}
        for w in pool:
            wc = costs.of(w.id)  # this worker's own (learned) seconds
            c = useful.get(w.id, 0)
            ht = host.get(w.id, 0) if host else 0  # host tier: loaded at its bandwidth, not recomputed
            compute = wc.prefill_ctx_s(prompt - c - ht, c + ht)
            own = wc.ttft_overhead_s + compute + (wc.host_load_s(ht) if ht else 0.0)
            wait = wc.wait_s(w, now)
            decode = p.decode_weight * wc.decode_s(w, out, need)
            est = wait + own + decode
            if w.capacity_tokens <= 0 or w.load_tokens + need > w.capacity_tokens:  # rare: maybe no KV room
                est += wc.kv_wait_s(w, need)
            saved = wc.prefill_ctx_s(c)
            cache = locality * worth_waiting(wait, saved) * saved
            pressure = p.churn_weight * compute * churn[w.id] / mean_churn if churn else 0.0
            sticky_bonus = max(p.stickiness_s, p.stickiness * est) if w.id == sticky else 0.0
            warm = self._warmup(wc, prompt, now - w.joined_at, eldest, locality, c, wait)
            home_bonus = p.home_bonus * est if w.id == home else 0.0
            s = est - cache + pressure - sticky_bonus - warm - home_bonus
            scores[w.id] = s
            if terms is not None:
                terms[w.id] = {"wait_s": wait, "prefill_s": own, "decode_s": decode, "cached_tokens": c,
                               "cache_bonus": cache, "pressure": pressure, "sticky": sticky_bonus, "warmup": warm,
                               "home": home_bonus, "score": s, "host_tokens": ht, **costs.describe(w.id)}
        return scores

    def _warmup(self, wc, prompt: int, age: float, eldest: float, locality: float, cached: int,
                wait: float) -> float:
        """The warm-up bonus: a worker ``age`` seconds old is scored as if ``warmup_boost`` of the
        prompt were cached on it (decaying to nothing over ``warmup_s``) — *as* cached tokens count:
        their prefill saved (physics) plus ``locality`` x it (their future value). Counting only
        the first part made the boost worth a sixth of a real match at low load: two cold L4s
        joining six warm ones got no request for 40-60 s (elastic), while the warm ones queued.

        The virtual prefix stands in for a real one, so only what it adds beyond the ``cached``
        tokens the worker really holds counts. Added on top, a joiner that had warmed up on a
        tenant's prefix was paid for it twice (its cache bonus and the boost, ~3 s of score on an
        L4 for a 7k-token prompt 20 s after it joined), took that tenant's every request until its
        KV was full and queued the next ones 3-7 s (elastic, three draws: worst-phase p99 3.9 s).

        New is relative: a worker is cold only beside workers that have had longer to warm up, so
        the boost runs over ``min(eldest, warmup_s) - age`` (``eldest``: the age of the pool's oldest
        worker). Workers that started together are equally cold and get none: a boost to each of
        them cost the holders of a prefix their lead over the others, and more replicas of every
        prefix filled a small pool's KV (hetero's two L4s of its second model: p99 3.53 -> 3.89 s).

        Its future value (the ``locality`` part) is worth waiting for as a real prefix's is
        (:func:`worth_waiting` of the joiner's queue against the virtual prefill): at full strength
        a joiner took every cold prompt until its queue reached ``1 + locality`` times that
        prefill (elastic, load 1.1: a 9k-token prompt queued 2.3 s on an L4 six seconds old)."""
        p = self.p
        young = min(eldest, p.warmup_s) - age
        if young <= 0.0:
            return 0.0
        tokens = p.warmup_boost * (young / p.warmup_s) * prompt - cached
        if tokens <= 0:
            return 0.0
        saved = wc.prefill_ctx_s(tokens)
        return (1.0 + locality * worth_waiting(wait, saved)) * saved

    # ------------------------------------------------------------------ stickiness

    def _sticky_worker(self, hashes: Sequence[int], depth: int, now: float) -> WorkerId | None:
        """The worker that last got the deepest matched block, if within the sticky window."""
        if depth <= 0:
            return None
        hit = self._sticky.get(hashes[depth - 1])
        if hit is None or now - hit[1] > self.p.sticky_window_s:
            return None
        return hit[0]

    def _remember(self, hashes: Sequence[int], depth: int, w: WorkerId, now: float) -> None:
        """Stick the matched prefix and the whole chain (the next turn's prefix) to ``w``."""
        if not hashes or len(hashes) < self.deps.index.settings.min_prefix_blocks:
            return
        sticky = self._sticky
        for h in {hashes[depth - 1], hashes[-1]} if depth > 0 else (hashes[-1],):
            sticky[h] = (w, now)
            sticky.move_to_end(h)
        while len(sticky) > self.p.sticky_max_entries:
            sticky.popitem(last=False)

    # ------------------------------------------------------------------ consistent-hash home

    def _home(self, req: RouteRequest, workers: Sequence[WorkerView]) -> WorkerId | None:
        key = req.route_key if req.route_key is not None else (req.hashes[0] if req.hashes else None)
        if key is None:
            return None
        self._ring.ensure(w.id for w in workers)
        loads = {w.id: float(w.inflight) for w in workers}
        return self._ring.owner_bounded(key, loads, self.p.ring_load_factor)
