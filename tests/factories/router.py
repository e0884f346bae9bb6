"""Factories for router tests and simulations: every argument has a keyword default.

In the spirit of vLLM's ``tests/v1/core/utils.py``: a test states only what it is about, e.g.
``make_req(hashes=chain(10, "sys"))`` or ``make_hb("w1", waiting=40)``. Pure, no I/O.
"""

from __future__ import annotations

from typing import Any, Sequence

from natsched.wire.schema import CacheEvent, Completion, Heartbeat, RequestId, TenantId, WorkerId
from natsched.wire.ids import BlockHash
from natsched.router.hashring import mix64
from natsched.router.policy import RouteRequest, WorkerView

_MASK63 = (1 << 63) - 1


def chain(n: int, tag: str = "p", start: int = 0) -> list[BlockHash]:
    """``n`` deterministic block hashes; equal ``tag`` means equal prefix (``start`` skips ahead)."""
    seed = mix64(sum(ord(c) << (8 * (i % 7)) for i, c in enumerate(tag)) + len(tag))
    return [BlockHash(mix64(seed + i) & _MASK63) for i in range(start, start + n)]


def make_req(
    id: str = "r0",
    *,
    hashes: Sequence[int] | None = None,
    n_blocks: int = 10,
    tag: str = "p",
    block_tokens: int = 32,
    prompt_tokens: int | None = None,
    expected_output: int = 100,
    runtime_tokens: int = 0,
    model: str = "default",
    route_key: int | None = None,
    tenant: str = "t",
) -> RouteRequest:
    hs = list(hashes) if hashes is not None else chain(n_blocks, tag)
    return RouteRequest(
        id=RequestId(id),
        tenant=TenantId(tenant),
        prompt_tokens=prompt_tokens if prompt_tokens is not None else len(hs) * block_tokens,
        hashes=[BlockHash(h) for h in hs],
        expected_output=expected_output,
        runtime_tokens=runtime_tokens,
        model=model,
        route_key=BlockHash(route_key) if route_key is not None else None,
    )


def make_hb(worker: str = "w0", *, seq: int = 1, ts: float = 0.0, state: str = "healthy",
            started_at: float = 1.0, capacity_tokens: int = 400_000, inflight: Sequence[str] = (),
            **load: Any) -> Heartbeat:
    """A heartbeat; ``load`` sets any other Heartbeat field (running, waiting, kv_seq, ...)."""
    return Heartbeat(worker=WorkerId(worker), seq=seq, ts=ts, state=state, started_at=started_at,
                     capacity_tokens=capacity_tokens, inflight=list(inflight), **load)


def make_view(id: str = "w0", **fields: Any) -> WorkerView:
    """A worker view for calling a policy directly (defaults: healthy, idle, 400k KV tokens)."""
    fields.setdefault("capacity_tokens", 400_000)
    return WorkerView(id=WorkerId(id), **fields)


def make_event(worker: str = "w0", seq: int = 1, kind: str = "stored", hashes: Sequence[int] = (),
               ts: float = 0.0) -> CacheEvent:
    return CacheEvent(worker=WorkerId(worker), seq=seq, kind=kind, ts=ts, hashes=list(hashes))


def make_completion(request_id: str = "r0", worker: str | None = "w0", *, cached: int = 0,
                    expected: int | None = None, status: str = "ok", runtime_tokens: int = 0,
                    prompt_tokens: int = 0) -> Completion:
    return Completion(request_id=RequestId(request_id), tenant=TenantId("t"), status=status,
                      runtime_tokens=runtime_tokens, worker=WorkerId(worker) if worker else None,
                      cached_tokens=cached, expected_cached_tokens=expected, prompt_tokens=prompt_tokens)


def make_core(n_workers: int = 4, *, policy: str = "natsched", now: float = 100.0, joined_at: float = 0.0,
              **settings: Any):
    """A RouterCore with ``n_workers`` healthy idle workers ``w0..`` that joined at ``joined_at``.

    ``settings`` are RouterSettings fields. Workers send one heartbeat at ``joined_at`` (so the
    warm-up is over by ``now`` with the defaults) and another at ``now``.
    """
    from natsched.router.core import RouterCore, RouterSettings

    core = RouterCore(RouterSettings(policy=policy, **settings))
    for i in range(n_workers):
        core.on_heartbeat(make_hb(f"w{i}"), joined_at)
        core.on_heartbeat(make_hb(f"w{i}", seq=2), now)
    return core
