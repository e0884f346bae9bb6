"""RouterCore: the router's whole state and decision, without I/O.

The service feeds it heartbeats, cache events and completions and asks it to route; the
simulator does the same in virtual time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bus.schema import CacheEvent, Completion, Heartbeat, WorkerId
from router.policies import make_policy
from router.policy import RouteDecision, RouteRequest, RoutingPolicy, WorkerView

log = logging.getLogger(__name__)


@dataclass
class RouterSettings:
    policy: str = "least_loaded"
    block_size: int = 32
    heartbeat_timeout_s: float = 15.0  # a worker silent for longer is excluded


class RouterCore:
    def __init__(self, settings: RouterSettings | None = None, policy: RoutingPolicy | None = None) -> None:
        self.settings = settings or RouterSettings()
        self.policy = policy or make_policy(self.settings.policy)
        self.workers: dict[WorkerId, WorkerView] = {}

    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        view = self.workers.get(hb.worker)
        if view is None:
            view = self.workers[hb.worker] = WorkerView(id=hb.worker, joined_at=now)
            log.info("worker %s joined (state %s)", hb.worker, hb.state)
        view.state = hb.state
        view.model = hb.model
        view.running, view.waiting = hb.running, hb.waiting
        view.kv_used_blocks, view.kv_total_blocks = hb.kv_used_blocks, hb.kv_total_blocks
        view.runtime_tokens, view.capacity_tokens = hb.runtime_tokens, hb.capacity_tokens
        view.queued_prefill_tokens = hb.queued_prefill_tokens
        view.block_size = hb.block_size
        view.last_heartbeat = now
        view.pending = view.pending_tokens = 0  # the heartbeat now counts what we sent

    def on_cache_event(self, ev: CacheEvent, now: float) -> bool:
        """Apply a cache delta; False when a sequence gap means a snapshot is needed."""
        return True

    def on_completion(self, c: Completion, now: float) -> None:
        pass

    def candidates(self, req: RouteRequest, now: float) -> list[WorkerView]:
        limit = self.settings.heartbeat_timeout_s
        return [
            w
            for w in self.workers.values()
            if w.state == "healthy" and now - w.last_heartbeat <= limit and w.model == req.model
        ]

    def route(self, req: RouteRequest, now: float) -> RouteDecision:
        decision = self.policy.route(req, self.candidates(req, now), now)
        if decision.worker is not None:
            view = self.workers[decision.worker]
            view.pending += 1
            view.pending_tokens += req.runtime_tokens
        return decision
