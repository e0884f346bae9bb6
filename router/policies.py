"""Baseline routing policies (the cache-aware ones live beside them as the router grows)."""

from __future__ import annotations

from typing import Sequence

from router.policy import RouteDecision, RouteRequest, WorkerView


class LeastLoaded:
    """Fewest in-flight requests (running + waiting + assigned since the last heartbeat)."""

    name = "least_loaded"

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        scores = {w.id: float(w.inflight) for w in workers}
        best = min(workers, key=lambda w: (w.inflight, w.runtime_tokens + w.pending_tokens, w.id))
        return RouteDecision(best.id, self.name, scores)


class RoundRobin:
    """Each worker in turn, ignoring load and cache."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision:
        if not workers:
            return RouteDecision(None, self.name, reason="no_worker")
        ordered = sorted(workers, key=lambda w: w.id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(chosen.id, self.name)


POLICIES = {p.name: p for p in (LeastLoaded, RoundRobin)}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
