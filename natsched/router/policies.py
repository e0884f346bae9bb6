"""Every routing policy by name, the simple baselines, and :func:`make_policy`.

Names (``POLICIES``): ``natsched`` (default, cache- and load-aware, :mod:`natsched.router.natsched`),
``round_robin``, ``least_loaded``, ``consistent_hash`` (baselines, here), and the peers
``sglang_cache_aware`` (:mod:`natsched.router.sglang`), ``dynamo_kv``, ``llmd_scorers``, ``preble_e2``,
``llmd_affinity``, ``vllm_smetric``, ``aibrix_prefix`` (:mod:`natsched.router.peers`). All share one interface (:class:`natsched.router.policy.RoutingPolicy`) and one
constructor shape ``Policy(deps, params)``, so the service, the simulator and a canary build
them alike.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from natsched.router.deps import PolicyDeps, build_params
from natsched.router.errors import ConfigError, UnknownPolicyError
from natsched.router.hashring import HashRing
from natsched.router.natsched import NatschedPolicy
from natsched.router.peers import AibrixPrefix, DynamoKv, LlmdAffinity, LlmdScorers, PrebleE2, VllmSmetric
from natsched.router.policy import RouteDecision, RouteRequest, RoutingPolicy, WorkerView
from natsched.router.sglang import SglangCacheAware


class LeastLoaded:
    """Fewest in-flight requests (running + waiting + assigned since the last heartbeat)."""

    name = "least_loaded"
    Params = None

    def __init__(self, deps: PolicyDeps | None = None, params: None = None) -> None:
        pass

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        scores = {w.id: float(w.inflight) for w in workers}
        best = min(workers, key=lambda w: (w.inflight, w.load_tokens, w.id))
        return RouteDecision(best.id, self.name, scores, reason="load")


class RoundRobin:
    """Each worker in turn (in id order), ignoring load and cache."""

    name = "round_robin"
    Params = None

    def __init__(self, deps: PolicyDeps | None = None, params: None = None) -> None:
        self._next = 0

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        ordered = sorted(workers, key=lambda w: w.id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(chosen.id, self.name, reason="turn")


@dataclass
class ConsistentHashParams:
    vnodes: int = 160  # ketama's 160 points per server

    def __post_init__(self) -> None:
        if self.vnodes < 1:
            raise ConfigError("consistent_hash: vnodes must be >= 1")


class ConsistentHash:
    """Ring of ``vnodes`` points per worker; key = route key, else first block hash, else the id.

    Pure affinity, no load bound: the classic baseline (a bounded-load ring is ``natsched``'s
    optional home).
    """

    name = "consistent_hash"
    Params = ConsistentHashParams

    def __init__(self, deps: PolicyDeps | None = None, params: ConsistentHashParams | None = None) -> None:
        self.p = params or ConsistentHashParams()
        self._ring = HashRing(self.p.vnodes)

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        if req.route_key is not None:
            key = req.route_key
        elif req.hashes:
            key = req.hashes[0]
        else:
            key = zlib.crc32(req.id.encode())
        self._ring.ensure(w.id for w in workers)
        return RouteDecision(self._ring.owner(key), self.name, reason="ring")


POLICIES: dict[str, type] = {
    p.name: p
    for p in (
        NatschedPolicy,
        RoundRobin,
        LeastLoaded,
        ConsistentHash,
        SglangCacheAware,
        DynamoKv,
        LlmdScorers,
        PrebleE2,
        LlmdAffinity,
        VllmSmetric,
        AibrixPrefix,
    )
}


def make_policy(
    name: str, deps: PolicyDeps | None = None, weights: Mapping[str, Any] | None = None
) -> RoutingPolicy:
    """Build policy ``name`` with shared ``deps`` and ``weights`` overriding its parameters.

    Raises :class:`UnknownPolicyError` (a ``ValueError``) for an unknown name and
    :class:`ConfigError` for an unknown or ill-typed weight.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return cls(deps or PolicyDeps(), build_params(cls.Params, weights, name))


__all__ = ["POLICIES", "make_policy", "LeastLoaded", "RoundRobin", "ConsistentHash"]
