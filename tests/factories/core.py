"""Factory helpers with keyword defaults, so a test names only what it is about."""

from __future__ import annotations

import asyncio
import itertools
import time

from natsched.wire.schema import Completion, Heartbeat, Request, RequestId, TenantId, WorkerId

_ids = itertools.count()


def make_request(
    prompt: str | None = "hello world",
    *,
    tenant: str = "t1",
    cls: str = "online",
    max_tokens: int = 8,
    prompt_token_ids: list[int] | None = None,
    **fields,
) -> Request:
    fields.setdefault("id", RequestId(f"r{next(_ids)}"))
    if prompt_token_ids is not None:
        prompt = None
    return Request(tenant=TenantId(tenant), cls=cls, prompt=prompt, prompt_token_ids=prompt_token_ids,
                   max_tokens=max_tokens, created=time.time(), **fields)


def apply_cache_event(view: set, ev) -> None:
    """A worker's cache as a reader of its events sees it: ``ev`` (a CacheEvent) applied to ``view``."""
    if ev.kind in ("snapshot", "cleared"):
        view.clear()
        view.update(ev.hashes)
    elif ev.kind == "stored":
        view.update(ev.hashes)
    elif ev.kind == "removed":
        view.difference_update(ev.hashes)


async def submit_shared_prefix(client, tenant: str, prefix: list[int], *, model: str, n: int = 4,
                               max_tokens: int = 3) -> list:
    """``n`` token-id requests sharing ``prefix`` (each with its own 16-token tail), one after the
    other: ``[(request, result)]``. The first finds nothing cached; the rest should find the prefix."""
    from natsched.client.producer import make_request as new_request

    out = []
    for i in range(n):
        tail = [11 + ((i + 1) * 97 + j) % 1000 for j in range(16)]
        req = new_request(tenant, prompt_token_ids=prefix + tail, model=model, max_tokens=max_tokens)
        out.append((req, await client.submit(req)))
    assert out[0][1].status == "completed" and out[0][1].cached_tokens == 0
    return out


def make_heartbeat(worker: str = "w1", *, seq: int = 1, ts: float | None = None, **fields) -> Heartbeat:
    return Heartbeat(worker=WorkerId(worker), seq=seq, ts=ts if ts is not None else time.time(), **fields)


def make_completion(request_id: str, *, tenant: str = "t1", runtime_tokens: int = 10, **fields) -> Completion:
    fields.setdefault("status", "ok")
    return Completion(request_id=RequestId(request_id), tenant=TenantId(tenant), runtime_tokens=runtime_tokens,
                      **fields)


async def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll until ``predicate()`` (sync or async) holds; a bound on waiting, never a timing assertion."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value or time.monotonic() > deadline:
            return bool(value)
        await asyncio.sleep(interval)


def read_until_up(proc, timeout: float, what: str = "natsched up", extra=lambda: "") -> list[str]:
    """Lines a ``natsched up`` child printed until "natsched is up"; AssertionError if it never was."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("natsched is up"):
            return lines
    raise AssertionError(f"{what} did not come up: {lines} {extra()}")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock only moves when nothing is ready: a sleep of any length returns at
    once in wall time, in the order real time would give, so timing-shaped code (latency knees,
    timeouts) runs deterministically however busy the machine is. I/O still works (polled)."""

    def __init__(self) -> None:
        super().__init__()
        self.virtual_now = 0.0
        self._selector = _JumpingSelector(self._selector, self)

    def time(self) -> float:
        return self.virtual_now


class _JumpingSelector:
    def __init__(self, inner, loop: VirtualTimeLoop) -> None:
        self._inner, self._loop = inner, loop

    def select(self, timeout=None):
        events = self._inner.select(0)
        if not events and timeout is not None and timeout > 0:
            self._loop.virtual_now += timeout  # jump to the next timer instead of waiting for it
        return events

    def __getattr__(self, name):
        return getattr(self._inner, name)


def run_in_virtual_time(coro):
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop`."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
