"""Answers that notice a client leaving: the producer stops, and its request is cancelled.

Why not the framework's streaming response: the ASGI servers only report a disconnect to
whoever calls ``receive()``, and a stream that is waiting for the next token (or a request
still queued) calls nothing; the generation would run to its end for nobody. Here a second
task waits on ``receive()`` and cancels the work the moment ``http.disconnect`` arrives; the
cancellation closes the :mod:`natsched.client.producer` exchange, which tells the worker to stop.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from natsched.bus.aio import cancel_and_wait

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, unless the client leaves first: then ``work`` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await asyncio.shield(cancel_and_wait(task))
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    # again and again until it is done: one cancel can be swallowed on Python 3.11 (bus.aio)
    await cancel_and_wait(task)
    if not task.cancelled():
        task.exception()  # it ended on its own as the client left: nobody wants what it raised
    raise ClientGone()


class EventStream:
    """An ASGI ``text/event-stream`` response fed by ``events``; a disconnect cancels the feed.

    ``on_disconnect`` runs (once) when the client left before the feed ended; ``on_close`` once
    the response is over, however it ended (even if the feed never started).
    """

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_disconnect: Callable[[], None] | None = None, on_close: Callable[[], None] | None = None) -> None:
        self.events = events
        self.headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                        "x-accel-buffering": "no", **(headers or {})}
        self.on_disconnect = on_disconnect
        self.on_close = on_close

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        try:
            await self._serve(receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _serve(self, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode(), v.encode()) for k, v in self.headers.items()]})

        async def pump() -> None:
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                await asyncio.sleep(0)  # with tokens queued up, neither call suspends: let the watcher run
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, pump())
        except ClientGone:
            if self.on_disconnect is not None:
                self.on_disconnect()
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
