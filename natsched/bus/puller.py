"""Reading a durable pull consumer continuously: pull requests kept topped up, messages in batches.

Why not nats-py's ``fetch``: each ``fetch`` is one pull request (a JSON body published to
``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``) and one wait with a timer, for whatever
arrived by then — under a steady load that is a request per message or two, and a pull request
costs the server and the client about what the message itself costs. Here the consumer keeps
``batch`` messages asked for at all times (a new request when half of them have arrived), so a
busy consumer sends one small request per ``batch / 2`` messages, and an idle one one per
``expires_s``. It is what the newer JetStream clients call *consume*.

Liveness: the server sends an idle heartbeat while a request waits with nothing to deliver.
When neither a message nor a heartbeat has come for ``2 x heartbeat_s`` (a reconnect to another
node, a restarted server: the requests it held are gone), the count of requests in flight is
reset and a new one is sent. A status reply (request expired, leadership change, too many
waiting requests) carries how many of its messages it will not deliver; those are subtracted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import orjson

from natsched.bus.aio import wait_event

log = logging.getLogger(__name__)

STATUS = "Status"
PENDING_MSGS = "Nats-Pending-Messages"
HEARTBEAT = "100"
UNFULFILLED = {"404", "408", "409"}  # no messages (no_wait), request expired, conflict of some kind


class Puller:
    """Deliveries of one durable consumer, in batches of what has arrived (up to ``batch``)."""

    def __init__(self, nc: Any, stream: str, durable: str, batch: int, expires_s: float = 5.0,
                 heartbeat_s: float = 1.0) -> None:
        self.nc = nc
        self.batch = max(1, batch)
        self.expires_s = expires_s
        self.heartbeat_s = heartbeat_s
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = ""
        self._sub: Any = None
        self._ready: collections.deque = collections.deque()
        self._arrived = asyncio.Event()
        self._asked = 0  # messages requested and not yet delivered (or declared undeliverable)
        self._heard = time.monotonic()  # last message, heartbeat or status from the server
        self.pull_requests = 0  # sent so far (for tests and metrics)

    async def start(self) -> None:
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_msg, pending_msgs_limit=10 * self.batch + 1000)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # closed connection: nothing left to undo
                pass

    async def _on_msg(self, msg: Any) -> None:
        self._heard = time.monotonic()
        status = msg.headers.get(STATUS) if msg.headers else None
        if status is None:
            self._asked = max(0, self._asked - 1)  # (a request we had given up on may still deliver)
            self._ready.append(msg)
            self._arrived.set()
        elif status in UNFULFILLED:
            left = msg.headers.get(PENDING_MSGS)
            # without a count (an old server, an unknown conflict) assume the whole ask is gone:
            # at worst one request too many waits on the server, which is harmless
            self._asked = max(0, self._asked - int(left)) if left and left.isdigit() else 0
            if status == "409":
                log.debug("pull on %s: %s %s", self._next_subject, status, msg.headers.get("Description"))
            self._arrived.set()  # wake the reader so it asks again
        # 100: an idle heartbeat, only liveness

    async def _ask(self) -> None:
        """Top the requests up to ``batch`` messages once half of the previous ask has arrived."""
        if self._asked > self.batch // 2:
            return
        want = self.batch - self._asked
        body = {"batch": want, "expires": int(self.expires_s * 1e9),
                "idle_heartbeat": int(self.heartbeat_s * 1e9)}
        await self.nc.publish(self._next_subject, orjson.dumps(body), reply=self._inbox)
        self._asked += want
        self.pull_requests += 1

    async def next_batch(self, timeout: float | None = None) -> list[Any]:
        """What has arrived (at least one message), up to ``batch``; [] after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            await self._ask()
            self._arrived.clear()
            wait = 2 * self.heartbeat_s
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            if not await wait_event(self._arrived, wait):
                if time.monotonic() - self._heard > 2 * self.heartbeat_s:
                    self._asked = 0  # the server forgot our requests (reconnect, restart): ask anew
                    self._heard = time.monotonic()
                if deadline is not None and time.monotonic() >= deadline:
                    return []
        n = min(self.batch, len(self._ready))
        msgs = [self._ready.popleft() for _ in range(n)]
        await self._ask()
        return msgs
