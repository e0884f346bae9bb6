"""The routing interface: what a policy sees and what it returns. Pure, no I/O.

A policy is a synchronous object, ``route(request, workers, now) -> RouteDecision``, like
vLLM's ``SchedulerInterface.schedule()``: the router service and the simulator call the very
same objects, so a benchmark measures the code that ships.

``workers`` are the *candidates* (healthy, fresh, same model) that :class:`natsched.router.core.RouterCore`
selected; a policy only ranks them. Policies that need shared knowledge (the prefix index, the
cost model) receive it through their constructor, see :mod:`natsched.router.deps`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from natsched.wire.blocks import estimate_prefill_tokens, request_block_hashes
from natsched.wire.schema import Request, RequestId, TenantId, WorkerId
from natsched.wire.ids import BlockHash


@dataclass
class RouteRequest:
    """A request as the router sees it: sizes and its prefix chain, no text."""

    id: RequestId
    tenant: TenantId
    prompt_tokens: int
    hashes: list[BlockHash]
    expected_output: int
    runtime_tokens: int = 0
    cls: str = "online"
    model: str = "default"
    route_key: BlockHash | None = None  # model-level key for consistent hashing
    avoid: frozenset[str] = frozenset()  # workers found dead while holding it: never again

    @classmethod
    def from_request(cls, request: Request, block_size: int, runtime_tokens: int = 0) -> "RouteRequest":
        hashes = request_block_hashes(request, block_size)
        resumed = len(request.resume_token_ids or ())  # a migrated stream: prefilled, not generated
        return cls(
            id=request.id,
            tenant=request.tenant,
            prompt_tokens=estimate_prefill_tokens(request),
            hashes=hashes,
            expected_output=max(1, (request.expected_output_tokens or request.max_tokens) - resumed),
            runtime_tokens=runtime_tokens,
            cls=request.cls,
            model=request.model,
            route_key=hashes[0] if hashes else None,
        )


@dataclass
class WorkerView:
    """What the router knows about one worker, from heartbeats and its own assignments."""

    id: WorkerId
    state: str = "healthy"
    model: str = "default"
    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    runtime_tokens: int = 0
    capacity_tokens: int = 0
    queued_prefill_tokens: int = 0
    block_size: int = 32
    last_heartbeat: float = 0.0
    heartbeat_interval: float = 0.0  # the worker's own period (from its heartbeats); 0: unknown
    joined_at: float = 0.0  # first heartbeat, or the last re-registration (warm-up starts here)
    started_at: float = 0.0  # the worker's own start time; a new value means it restarted
    kv_seq: int = 0  # last cache-event sequence number the worker says it published
    serves: frozenset[str] = frozenset()  # models and LoRA adapters it serves besides ``model`` (Heartbeat.served)
    active: frozenset[str] = frozenset()  # ... of them, the adapters in its engine's batch now (loaded)
    # assigned by this router but not yet counted in a heartbeat (so bursts spread out)
    pending: int = 0
    pending_tokens: int = 0  # KV tokens those assignments will hold
    pending_prefill_tokens: int = 0  # their uncached prompt tokens (prefill queued on the worker)
    # finished since the last heartbeat, although that heartbeat still counted them
    finished: int = 0
    finished_tokens: int = 0
    # router time at which the worker should have computed all prefill queued on it, ours
    # included (natsched.router.backlog); None: not estimated (then the token counts above are used)
    busy_until: float | None = None

    @property
    def inflight(self) -> int:
        """Requests on the worker now: its report, plus our new assignments, minus completions."""
        n = self.running + self.waiting + self.pending - self.finished
        return n if n > 0 else 0

    @property
    def load_tokens(self) -> int:
        """KV tokens held on the worker now, by the same accounting as :attr:`inflight`."""
        n = self.runtime_tokens + self.pending_tokens - self.finished_tokens
        return n if n > 0 else 0


@dataclass
class RouteDecision:
    """The chosen worker (None when no worker can take it), with every candidate's score."""

    worker: WorkerId | None
    policy: str
    scores: dict[str, float] = field(default_factory=dict)
    expected_cached_tokens: int = 0  # prompt tokens the router predicts the worker has cached
    reason: str | None = None  # why: "no_worker", "cache", "load", "sticky", "imbalanced", ...
    terms: dict[str, dict[str, float]] = field(default_factory=dict)  # worker -> score terms (audit)


class RoutingPolicy(Protocol):
    """A routing policy: pure and synchronous; may keep its own state (trees, rings)."""

    name: str

    def route(self, req: RouteRequest, workers: Sequence[WorkerView], now: float) -> RouteDecision: ...
