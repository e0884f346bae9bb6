"""``sglang_cache_aware``: SGLang router's cache-aware load balancing, over block hashes.

Faithful to sgl-router's ``cache_aware`` policy (defaults as given in the natsched brief; sgl-router
0.1.x shipped cache_threshold 0.5, balance_abs_threshold 32, balance_rel_threshold 1.0001,
max_tree_size 2^24, while the later SGLang model gateway moved to 0.3 / 64 / 1.5 — all are
settings here):

- the router keeps, per worker, an *approximate* tree of the prompts it routed there (never the
  worker's real cache); prompts are block-hash chains, so a per-worker LRU dict of chained hashes
  is the radix tree (a hash names its whole prefix);
- imbalanced — ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold x min``
  in-flight requests — sends the request to the shortest queue (still inserting it into that
  worker's tree);
- otherwise, if the best match ratio (matched / prompt tokens) exceeds ``cache_threshold``, the
  best-matching worker; else the worker with the smallest tree (most free cache);
- trees are trimmed LRU to ``max_tree_size`` tokens (sgl-router trims on a timer; here on insert,
  touching leaves before their root so shared roots are trimmed last).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from natsched.wire.schema import WorkerId
from natsched.wire.ids import BlockHash
from natsched.router.deps import PolicyDeps, cached_tokens, tie_key
from natsched.router.errors import ConfigError
from natsched.router.policy import RouteDecision, RouteRequest, WorkerView


@dataclass
class SglangParams:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1
    max_tree_size: int = 2**24  # tokens per worker tree

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0 or self.max_tree_size < 1:
            raise ConfigError("sglang_cache_aware: cache_threshold in [0, 1], max_tree_size >= 1")


class SglangCacheAware:
    name = "sglang_cache_aware"
    Params = SglangParams
    cache_belief = "own"  # expected_cached_tokens comes from its own trees, not the index

    def __init__(self, deps: PolicyDeps | None = None, params: SglangParams | None = None) -> None:
        self.deps = deps or PolicyDeps()
        self.p = params or SglangParams()
        self._trees: dict[WorkerId, OrderedDict[BlockHash, None]] = {}

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        loads = [w.inflight for w in workers]
        hi, lo = max(loads), min(loads)
        matches = {w.id: self._match(w.id, req.hashes) for w in workers}
        bt, prompt = self.deps.block_tokens, req.prompt_tokens
        if hi - lo > self.p.balance_abs_threshold and hi > self.p.balance_rel_threshold * lo:
            chosen, reason = min(workers, key=tie_key), "imbalanced"
        else:
            best = min(workers, key=lambda w: (-matches[w.id], w.inflight, w.id))
            ratio = cached_tokens(matches[best.id], bt, prompt) / prompt if prompt > 0 else 0.0
            if ratio > self.p.cache_threshold:
                chosen, reason = best, "cache"
            else:
                chosen = min(workers, key=lambda w: (len(self._trees.get(w.id, ())), w.inflight, w.id))
                reason = "smallest_tree"
        self._insert(chosen.id, req.hashes)
        scores = {w: float(n) for w, n in matches.items()}
        expected = cached_tokens(matches[chosen.id], bt, prompt)  # what this policy believes
        return RouteDecision(chosen.id, self.name, scores, expected, reason)

    def _match(self, w: WorkerId, hashes: Sequence[int]) -> int:
        tree = self._trees.get(w)
        if not tree:
            return 0
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _insert(self, w: WorkerId, hashes: Sequence[int]) -> None:
        tree = self._trees.get(w)
        if tree is None:
            tree = self._trees[w] = OrderedDict()
        for h in reversed(hashes):
            tree[h] = None
            tree.move_to_end(h)
        limit = max(1, self.p.max_tree_size // self.deps.block_tokens)
        while len(tree) > limit:
            tree.popitem(last=False)

    def tree_blocks(self, w: WorkerId) -> int:
        return len(self._trees.get(w, ()))
