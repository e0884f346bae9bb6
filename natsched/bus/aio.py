"""Small asyncio helpers the services' loops share, and the Python 3.11 cancellation race.

Why not ``asyncio.wait_for``: on Python 3.11 it swallows a cancellation that arrives in the
same loop turn as its inner future's result (it returns the result instead of raising;
fixed in 3.12, where ``wait_for`` is built on ``asyncio.timeout``). A loop around it then never
ends: ``Bus.close`` waited its whole budget for such a task, and a producer's reply loop
(nats-py's ``Subscription.next_msg`` is a ``wait_for``) went on reading the tokens of a stream
whose HTTP client had gone, so the gateway's one cancel was lost and the worker generated
thousands of tokens for nobody. ``asyncio.timeout`` counts cancellations and passes this one on;
it also costs no extra task per wait. Two defences, each enough for the race it covers:

- at the source: :func:`wait_event` and :class:`Mailbox` wait with ``asyncio.timeout``;
- at the canceller: :func:`cancel_and_wait` cancels again until the task is really done, for
  code below us that still uses ``wait_for`` (nats-py's request, flush, JetStream calls).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

#: how long :func:`cancel_and_wait` lets a cancelled task run before cancelling it again
RECANCEL_S = 0.05


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """True when ``event`` is set within ``timeout`` seconds (None: no bound), False otherwise."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_and_wait(task: asyncio.Future, every_s: float = RECANCEL_S) -> None:
    """Cancel ``task`` and return once it is done, cancelling it again while it runs on.

    A single ``task.cancel()`` can be swallowed (see the module docstring): the task then
    carries on as if nothing happened. Re-cancelling every ``every_s`` until it ends closes
    that window whatever the task awaits; a task that ends at the first cancel costs one wait.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every_s)


def raise_if_cancelled() -> None:
    """Raise :class:`asyncio.CancelledError` when the current task was cancelled and carried on.

    For a loop whose awaits go through ``wait_for`` below us (nats-py's KV reads): a cancel they
    swallowed still counts in ``Task.cancelling()``, so checking once per turn ends the loop
    (``natsched status --watch`` once redrew on after Ctrl-C)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Mailbox:
    """The messages of one core subscription, read one at a time (a producer's replies).

    The subscription's callback puts each message here (in order: nats-py runs one callback
    task per subscription), and :meth:`get` waits with ``asyncio.timeout``, never
    ``wait_for``: a cancelled reader is cancelled, and a message that arrived meanwhile stays
    queued. Bounded like nats-py's own pending queue: past ``max_pending`` a message is dropped
    and counted (a reader that slow has lost its stream anyway).
    """

    def __init__(self, subject: str, max_pending: int) -> None:
        self.subject = subject
        self._queue: asyncio.Queue[Any] = asyncio.Queue(max_pending)
        self.dropped = 0

    async def put(self, msg: Any) -> None:
        try:
            self._queue.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("%s: reader too slow, %d message(s) dropped", self.subject, self.dropped)

    async def get(self, timeout: float | None) -> Any:
        """The next message; ``TimeoutError`` when none arrives within ``timeout`` seconds."""
        async with asyncio.timeout(timeout):
            return await self._queue.get()
