"""A run's time limits, enforced on the worker: time to first token, stream idle, total.

Why on the worker and not only in the client: a producer that gives up cancels the run, but a
producer that is gone (crashed, partitioned) cancels nothing, and an engine stuck mid-stream
holds its KV blocks until someone notices. The request carries its limits (``ttft_deadline``,
``idle_timeout``, ``deadline``), so the worker stops the run itself when one passes and reports
the reason (``ttft_timeout``, ``idle_timeout``, ``deadline_exceeded``) with the tokens produced.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import AsyncIterator, Callable, TypeVar

from natsched.wire.schema import Request
from natsched.workers.errors import RunTimeout

T = TypeVar("T")

TTFT_TIMEOUT, IDLE_TIMEOUT, DEADLINE_EXCEEDED = "ttft_timeout", "idle_timeout", "deadline_exceeded"
#: every reason a run is stopped by its time limits (the worker's timeouts metric labels)
TIMEOUT_REASONS = (TTFT_TIMEOUT, IDLE_TIMEOUT, DEADLINE_EXCEEDED)


def next_limit(req: Request, first_seen: bool, now: float) -> tuple[float, str] | None:
    """(seconds left, reason) of the limit that ends the wait for the next output first; None: none.

    Pure: the request's limits and what the run has seen, in; the binding one, out.
    """
    limits = []
    if req.deadline is not None:
        limits.append((req.deadline - now, DEADLINE_EXCEEDED))
    if not first_seen and req.ttft_deadline is not None:
        limits.append((req.ttft_deadline - now, TTFT_TIMEOUT))
    if first_seen and req.idle_timeout is not None:
        limits.append((req.idle_timeout, IDLE_TIMEOUT))
    return min(limits) if limits else None


async def limited(outputs: AsyncIterator[T], req: Request, is_output: Callable[[T], bool],
                  clock: Callable[[], float] = time.time) -> AsyncIterator[T]:
    """``outputs`` as they come, until a limit passes: then the engine's stream is closed (the
    engine aborts the request) and :class:`RunTimeout` raised. ``is_output(item)``: the item
    counts as a token (the first one ends the TTFT wait)."""
    first_seen = False
    try:
        while True:
            limit = next_limit(req, first_seen, clock())
            left = math.inf if limit is None else max(0.0, limit[0])
            try:
                async with asyncio.timeout(None if left == math.inf else left):
                    item = await outputs.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                assert limit is not None
                raise RunTimeout(limit[1], req.id) from None
            first_seen = first_seen or is_output(item)
            yield item
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()
