"""``natsched``: the default policy — estimated time to finish, traded against cached prefix.

For each candidate worker ``w`` (lower score wins)::

    est(w)   = prefill queued on w + this request's UNCACHED prefill + its decode (steps slowed by
               everything running on w) + waiting for KV room           (CostModel.finish_s)
    score(w) = est(w)
             - locality(u) x prefill time of the tokens w has cached
             - stickiness  (w got this prefix within sticky_window_s)
             - warm-up     (w joined less than warmup_s ago)
             - home        (optional: w owns the prefix's route key on a bounded-load hash ring)

Choices, and why:

- The cache always counts *fully* through ``est`` (uncached tokens cost prefill, cached ones do
  not): that is physics, not a preference. ``locality(u) = locality_boost x (1 - u)^k`` adds up to
  ``locality_boost`` times more weight at an idle cluster and fades to nothing as the mean
  utilisation ``u`` of the candidates nears 1. Reason: at low load, concentrating a prefix costs
  nothing and keeps it warm for the next request; at high load, ``est``'s queueing terms must
  decide alone or holders of popular prefixes become hot spots. ``k = 2`` keeps locality strong
  until about half load (0.25 of the boost left at u = 0.5).
- Minimum gain: a match under ``min_gain`` (30 %) of the prompt is ignored — it saves too little
  to justify pulling the request away from a less loaded worker, and it is mostly noise.
- Replica cap: when ``replica_cap`` workers already hold a useful match, new copies are not made
  (the others are not candidates) — unless every holder is past ``replica_raise_util``: then the
  prefix's load exceeds what its replicas serve and one more replica is allowed.
- Stickiness: the worker that most recently got the matched prefix wins ties by a hysteresis of
  ``max(stickiness_s, stickiness x est)``, for ``sticky_window_s`` — a prefix does not bounce
  between replicas on small load wiggles.
- Warm-up: a new (or re-registered) worker has a cold cache and would lose every cache-weighted
  comparison; it is treated as if ``warmup_boost`` of the prompt were cached, decaying linearly
  to nothing over ``warmup_s``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from bus.schema import BlockHash, WorkerId
from router.deps import PolicyDeps, cached_tokens
from router.errors import ConfigError
from router.hashring import HashRing
from router.policy import RouteDecision, RouteRequest, WorkerView


@dataclass
class NatschedParams:
    locality_boost: float = 1.0  # extra weight of cached tokens at an idle cluster
    locality_exponent: float = 2.0  # k in (1 - u)^k
    min_gain: float = 0.3  # matches below this share of the prompt are ignored
    sticky_window_s: float = 30.0  # how long a prefix stays with the worker that last got it
    stickiness: float = 0.05  # hysteresis as a share of the sticky worker's estimate
    stickiness_s: float = 0.01  # ... and at least this many seconds
    replica_cap: int = 3  # workers that may hold one hot prefix ...
    replica_raise_util: float = 0.85  # ... unless all of them are busier than this
    warmup_s: float = 60.0  # how long a newly joined worker gets a boost
    warmup_boost: float = 0.5  # as if this share of the prompt were cached on it, at join time
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

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        d, p = self.deps, self.p
        prompt = req.prompt_tokens
        raw = d.index.match(req.hashes, now, [w.id for w in workers])
        useful = self._useful(raw, prompt)
        pool, capped = self._apply_replica_cap(workers, useful)
        depth = max(raw.values()) if raw else 0
        sticky = self._sticky_worker(req.hashes, depth, now) if useful else None
        home = self._home(req, workers) if p.consistent_hash and not useful else None
        scores = self._score(req, pool, workers, useful, sticky, home, now)
        best = min(pool, key=lambda w: (scores[w.id], w.inflight, w.id))
        self._remember(req.hashes, depth, best.id, now)
        reason = "sticky" if best.id == sticky else "cache" if best.id in useful else "home" if best.id == home else "load"
        if capped:
            reason += "+capped"
        expected = cached_tokens(raw.get(best.id, 0), d.block_tokens, prompt)
        return RouteDecision(best.id, self.name, scores, expected, reason)

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

    def _apply_replica_cap(self, workers: Sequence[WorkerView], useful: dict[WorkerId, int]):
        """Only holders stay candidates once ``replica_cap`` hold it, unless all of them are busy."""
        if len(useful) < self.p.replica_cap:
            return workers, False
        holders = [w for w in workers if w.id in useful]
        util = self.deps.cost.utilisation
        if all(util(w) >= self.p.replica_raise_util for w in holders):
            return workers, False  # the prefix needs more replicas than it has
        return holders, True

    def _score(self, req, pool, workers, useful, sticky, home, now) -> dict[str, float]:
        p, cost = self.p, self.deps.cost
        prompt, out = req.prompt_tokens, req.expected_output
        u = sum(cost.utilisation(w) for w in workers) / len(workers)
        locality = p.locality_boost * (1.0 - u) ** p.locality_exponent
        full_prefill = cost.prefill_s(prompt)
        scores: dict[str, float] = {}
        for w in pool:
            c = useful.get(w.id, 0)
            est = cost.finish_s(w, prompt - c, prompt, out)
            s = est - locality * cost.prefill_s(c)
            if w.id == sticky:
                s -= max(p.stickiness_s, p.stickiness * est)
            age = now - w.joined_at
            if age < p.warmup_s:
                s -= p.warmup_boost * (1.0 - age / p.warmup_s) * full_prefill
            if w.id == home:
                s -= p.home_bonus * est
            scores[w.id] = s
        return scores

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
