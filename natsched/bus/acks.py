"""JetStream publish acks on one shared inbox, as futures, without a task or timer per publish.

nats-py's ``js.publish`` is a request: a future, a timer and a wait per message; its
``publish_async`` waits on a semaphore through ``asyncio.wait_for``, which starts a task per
message. At hundreds of publishes a second that machinery costs a service more CPU than its own
work. Here a publish is one ``PUB`` with a reply subject ``<inbox>.<n>``, and its ack resolves the
future registered under ``n``; a sweep fails the futures whose ack has not come within
``timeout_s`` (a lost message, a server that died), so nothing waits forever and nothing leaks.
The callers (:meth:`natsched.bus.connection.Bus.jpublish_batch`, ``jpublish_nowait``) publish again what
failed, with its msg id, so a copy the server did store is deduplicated.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import orjson
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError

log = logging.getLogger(__name__)

NO_RESPONDERS = "503"  # no stream (or no leader) took the message
_PLAIN_ACK = {"stream", "seq", "domain", "duplicate"}  # what an ack of a plain publish holds


class AckInbox:
    """Futures for the acks of publishes made through :meth:`publish`."""

    def __init__(self, nc: Any, timeout_s: float = 2.0) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self._prefix = ""
        self._waiting: dict[str, tuple[asyncio.Future, float]] = {}  # token -> (future, sent); oldest first
        self._tokens = itertools.count(1)
        self.expired = 0

    async def start(self) -> None:
        self._prefix = self.nc.new_inbox() + "."  # below the connection's own inbox prefix (auth)
        await self.nc.subscribe(self._prefix + "*", cb=self._on_ack)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> asyncio.Future:
        """Publish; the returned future gets the :class:`api.PubAck` or the error."""
        token = str(next(self._tokens))
        future = asyncio.get_running_loop().create_future()
        self._waiting[token] = (future, time.monotonic())
        try:
            await self.nc.publish(subject, data, reply=self._prefix + token, headers=headers)
        except Exception:
            self._waiting.pop(token, None)
            raise
        return future

    async def _on_ack(self, msg: Any) -> None:
        entry = self._waiting.pop(msg.subject[len(self._prefix):], None)
        if entry is None or entry[0].done():
            return  # expired already (its publish was retried), or cancelled by its caller
        future = entry[0]
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            future.set_exception(NoRespondersError())
            return
        try:
            resp = orjson.loads(msg.data)
            if "error" in resp:
                APIError.from_error(resp["error"])  # raises the error's own class (BadRequestError, ...)
            if resp.keys() <= _PLAIN_ACK:  # built directly: ``from_response`` costs 4x (it introspects)
                future.set_result(api.PubAck(stream=resp["stream"], seq=resp["seq"], domain=resp.get("domain"),
                                             duplicate=resp.get("duplicate")))
            else:  # counters, batches: whatever else a newer server says
                future.set_result(api.PubAck.from_response(resp))
        except APIError as exc:
            future.set_exception(exc)
        except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
            future.set_exception(APIError(description=f"unreadable publish ack: {exc}"))

    def sweep(self, now: float | None = None) -> int:
        """Fail the futures older than ``timeout_s`` (in sending order: stop at the first young one)."""
        now = time.monotonic() if now is None else now
        failed = 0
        for token, (future, sent) in list(self._waiting.items()):
            if now - sent < self.timeout_s:
                break
            del self._waiting[token]
            if not future.done():
                future.set_exception(NatsTimeout())
                failed += 1
        self.expired += failed
        return failed

    async def sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.timeout_s / 4)
            failed = self.sweep()
            if failed:
                log.warning("%d publish acks missing after %gs: those publishes are retried", failed, self.timeout_s)

    def forget(self, future: asyncio.Future) -> None:
        """A caller that gave up on a future (it publishes again itself): drop it now."""
        if not future.done():
            future.cancel()
