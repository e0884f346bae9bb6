"""Peer cache-aware policies, each reduced to its documented rule and defaults.

They read the same shared prefix index (events + our decisions) and the same worker views as
``natsched``, so a benchmark compares the *rules*, not the quality of their inputs.

- ``dynamo_kv`` (NVIDIA Dynamo KV router): cost = overlap_score_weight (1.0) x prefill blocks
  not cached on the worker + the worker's active decode blocks (including this request's);
  lowest cost wins; temperature 0 (deterministic), > 0 samples softmax(-cost / T) on costs
  normalised to [0, 1], as Dynamo does.
- ``llmd_scorers`` (llm-d inference scheduler default profile): max of 3 x prefix-cache score
  (matched / request blocks) + 2 x queue score (min-max normalised, short queue = 1) + 2 x
  KV-cache-utilisation score (1 - used fraction).
- ``preble_e2`` (Preble, ICLR 2025, E2 scheduling): *exploit* — if the longest cached prefix is
  longer than what is left to compute, send to a worker holding it (least loaded among them);
  otherwise *explore* — the worker with the least load cost + eviction cost + prefill cost, all
  in seconds from each worker's cost model (learned, as for ``natsched``). Preble's post-assignment rebalancing and prefix
  autoscaling are not modelled.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from natsched.router.deps import PolicyDeps, cached_tokens, tie_key
from natsched.router.errors import ConfigError
from natsched.router.policy import RouteDecision, RouteRequest, WorkerView


@dataclass
class DynamoParams:
    overlap_score_weight: float = 1.0
    temperature: float = 0.0
    seed: int = 0  # for temperature > 0 only

    def __post_init__(self) -> None:
        if self.overlap_score_weight < 0 or self.temperature < 0:
            raise ConfigError("dynamo_kv: overlap_score_weight and temperature must be >= 0")


class DynamoKv:
    name = "dynamo_kv"
    Params = DynamoParams
    cache_belief = "index"  # expected_cached_tokens is the shared index's match

    def __init__(self, deps: PolicyDeps | None = None, params: DynamoParams | None = None) -> None:
        self.deps = deps or PolicyDeps()
        self.p = params or DynamoParams()
        self._rng = random.Random(self.p.seed)

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        bt, prompt = self.deps.block_tokens, req.prompt_tokens
        overlap = self.deps.index.match(req.hashes, now, [w.id for w in workers])
        request_blocks = -(-prompt // bt)
        costs: dict[str, float] = {}
        for w in workers:
            prefill_blocks = (prompt - cached_tokens(overlap.get(w.id, 0), bt, prompt)) / bt
            decode_blocks = w.load_tokens / bt + request_blocks
            costs[w.id] = self.p.overlap_score_weight * prefill_blocks + decode_blocks
        if self.p.temperature > 0:
            chosen = self._sample(workers, costs)
        else:
            chosen = min(workers, key=lambda w: (costs[w.id], w.inflight, w.id))
        expected = cached_tokens(overlap.get(chosen.id, 0), bt, prompt)
        return RouteDecision(chosen.id, self.name, costs, expected, "cost")

    def _sample(self, workers: Sequence[WorkerView], costs: dict[str, float]) -> WorkerView:
        lo, hi = min(costs.values()), max(costs.values())
        span = hi - lo or 1.0
        weights = [math.exp(-((costs[w.id] - lo) / span) / self.p.temperature) for w in workers]
        return self._rng.choices(list(workers), weights)[0]


@dataclass
class LlmdParams:
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0


class LlmdScorers:
    name = "llmd_scorers"
    Params = LlmdParams
    cache_belief = "index"  # expected_cached_tokens is the shared index's match

    def __init__(self, deps: PolicyDeps | None = None, params: LlmdParams | None = None) -> None:
        self.deps = deps or PolicyDeps()
        self.p = params or LlmdParams()

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        p, cost = self.p, self.deps.cost
        n_blocks = len(req.hashes)
        matched = self.deps.index.match(req.hashes, now, [w.id for w in workers]) if n_blocks else {}
        queues = {w.id: w.waiting + w.pending for w in workers}
        qmin, qmax = min(queues.values()), max(queues.values())
        scores: dict[str, float] = {}
        for w in workers:
            prefix = matched.get(w.id, 0) / n_blocks if n_blocks else 0.0
            queue = (qmax - queues[w.id]) / (qmax - qmin) if qmax > qmin else 1.0
            used = w.load_tokens / cost.capacity_tokens(w)
            kv = 1.0 - (used if used < 1.0 else 1.0)
            scores[w.id] = p.prefix_weight * prefix + p.queue_weight * queue + p.kv_weight * kv
        chosen = min(workers, key=lambda w: (-scores[w.id], w.inflight, w.id))
        expected = cached_tokens(matched.get(chosen.id, 0), self.deps.block_tokens, req.prompt_tokens)
        return RouteDecision(chosen.id, self.name, scores, expected, "score")


class PrebleE2:
    name = "preble_e2"
    Params = None
    cache_belief = "index"  # expected_cached_tokens is the shared index's match

    def __init__(self, deps: PolicyDeps | None = None, params: None = None) -> None:
        self.deps = deps or PolicyDeps()

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        bt, prompt, out = self.deps.block_tokens, req.prompt_tokens, req.expected_output
        matched = self.deps.index.match(req.hashes, now, [w.id for w in workers])
        cached = {w: cached_tokens(n, bt, prompt) for w, n in matched.items()}
        longest = max(cached.values(), default=0)
        costs = self.deps.costs  # each worker's own (learned) model
        if longest > prompt - longest:
            pool = [w for w in workers if cached.get(w.id, 0) == longest]
            loads = {w.id: costs.of(w.id).finish_s(w, prompt - longest, prompt, out) for w in pool}
            chosen = min(pool, key=lambda w: (loads[w.id], w.inflight, w.id))
            return RouteDecision(chosen.id, self.name, loads, longest, "exploit")
        scores: dict[str, float] = {}
        for w in workers:
            c = cached.get(w.id, 0)
            cost = costs.of(w.id)
            evict = w.load_tokens + prompt + out - cost.capacity_tokens(w)  # tokens pushed out
            scores[w.id] = cost.finish_s(w, prompt - c, prompt, out) + cost.prefill_s(max(0.0, evict))
        chosen = min(workers, key=lambda w: (scores[w.id], *tie_key(w)))
        return RouteDecision(chosen.id, self.name, scores, cached.get(chosen.id, 0), "explore")
