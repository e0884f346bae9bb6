"""A KV bucket handle: ``kv = bus.kv(S.BUCKET_QUOTAS)``, then ``await kv.get(key)``.

Shaped like nats-py's ``kv = await js.key_value(bucket)``, with three differences that are the
reason it exists:

- every call rides out a leader election like a publish does (reads and plain puts on any
  transient error, compare-and-swap writes only when the server surely did not apply them);
- it raises natsched errors (:class:`ConflictError` for a lost compare-and-swap,
  :class:`StreamNotFound` for a missing bucket), never ``nats`` ones;
- getting the handle costs nothing: nats-py's ``key_value()`` asks for the bucket's stream info
  (a round trip, and a right a confined role such as a tenant's batch producer lacks), so that
  lookup happens once, on the first call that needs it; :meth:`KV.entries` never makes it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

from nats.js.api import DeliverPolicy
from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from natsched.bus.errors import ConflictError, StreamNotFound
from natsched.bus.snapshot import KV_DELETE, KV_OPERATION, KV_PURGE, read_kv, read_records
from natsched.wire import subjects as S

if TYPE_CHECKING:
    from natsched.bus.connection import Bus

log = logging.getLogger(__name__)
T = TypeVar("T")
#: JetStream's err_codes for "wrong last sequence" on a conditional publish (a purge marker)
_WRONG_LAST = (10071, 10164)


#: while a watch's current values are still coming: this long with nothing arriving, the server
#: is asked again whether any are left (KV.watch)
READY_RECHECK_S = 1.0


async def _next(queue: asyncio.Queue, timeout: float | None) -> Any:
    """The next item, or None after ``timeout`` seconds (None: wait for as long as it takes)."""
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except asyncio.TimeoutError:
        return None


class KV:
    """One bucket (see the module docstring). Handed out by :meth:`natsched.bus.connection.Bus.kv`."""

    def __init__(self, bus: "Bus", bucket: str) -> None:
        self.bus = bus
        self.bucket = bucket
        self.stream = S.kv_stream(bucket)
        self._kv: Any = None

    async def _handle(self) -> Any:
        if self._kv is None:
            try:
                self._kv = await self.bus.js.key_value(self.bucket)
            except BucketNotFoundError:
                raise StreamNotFound(f"bucket {self.bucket} does not exist (has natsched ever run on this "
                                     "server?)") from None
        return self._kv

    async def _cas(self, call: Callable[[], Awaitable[T]]) -> T:
        return await self.bus._retrying(lambda _remaining: call(), None, "KV write", logging.INFO,
                                        self.bus.not_processed)

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """(value, revision), or None when the key does not exist (or was deleted)."""
        kv = await self._handle()
        try:
            entry = await self.bus._read(lambda: kv.get(key))
        except KeyNotFoundError:
            return None
        return (entry.value or b"", entry.revision)

    async def last_operation(self, key: str) -> str | None:
        """What last happened to ``key``: ``PUT``, ``DEL`` or ``PURGE`` (a marker not yet expired),
        or None when nothing is stored for it."""
        try:
            raw = await self.bus._read(lambda: self.bus.js.get_msg(self.stream, subject=S.kv_subject(self.bucket, key)))
        except NotFoundError:
            return None
        return (raw.headers or {}).get(KV_OPERATION, "PUT")

    async def put(self, key: str, value: bytes) -> int:
        kv = await self._handle()
        return await self.bus._read(lambda: kv.put(key, value))  # idempotent: safe to send again

    async def create(self, key: str, value: bytes) -> int:
        """Write only if the key does not exist; :class:`ConflictError` otherwise."""
        kv = await self._handle()
        try:
            return await self._cas(lambda: kv.create(key, value))
        except KeyWrongLastSequenceError as exc:
            raise ConflictError(f"{self.bucket}/{key} already exists") from exc

    async def update(self, key: str, value: bytes, last: int) -> int:
        """Compare-and-swap: :class:`ConflictError` if the key's revision is no longer ``last``."""
        kv = await self._handle()
        try:
            return await self._cas(lambda: kv.update(key, value, last=last))
        except KeyWrongLastSequenceError as exc:
            raise ConflictError(f"{self.bucket}/{key} changed since revision {last}") from exc

    async def delete(self, key: str, last: int | None = None, marker_ttl_s: int | None = None) -> None:
        """Delete (conditioned on revision ``last`` when given: :class:`ConflictError` if it moved).

        A plain KV delete leaves a marker per key for good: a bucket with one key per request
        (reservations) would grow by one stored message per request forever. With
        ``marker_ttl_s`` the key is purged instead and its marker expires after that many
        seconds (a per-message TTL; watchers see the deletion either way).
        """
        try:
            if marker_ttl_s is None:
                kv = await self._handle()
                await self._cas(lambda: kv.delete(key, last=last))
                return
            headers = {KV_OPERATION: KV_PURGE, "Nats-Rollup": "sub", "Nats-TTL": f"{int(marker_ttl_s)}s"}
            if last:
                headers["Nats-Expected-Last-Subject-Sequence"] = str(last)
            await self.bus.write_marker(S.kv_subject(self.bucket, key), headers)
        except APIError as exc:
            if exc.err_code in _WRONG_LAST:
                raise ConflictError(f"{self.bucket}/{key} changed since revision {last}") from exc
            raise

    async def history(self, keys: str = ">") -> list[tuple[str, bytes | None, int, str]]:
        """Every stored revision of the keys matching ``keys`` (as many as the bucket's history
        keeps per key), oldest first: (key, value or None when it is a delete, revision,
        operation ``PUT`` / ``DEL`` / ``PURGE``). Empty when nothing matches. For rollbacks.

        Read through ``natsched.bus.snapshot``, not nats-py's ``kv.history()``, which can end
        before the first record on a busy connection (that module's docstring)."""
        return await self._records(keys, history=True)

    async def keys(self) -> list[str]:
        """Every live key, in the order they were last written (values are not read). An empty
        bucket gives ``[]``; a failed read raises, never passes for an empty bucket."""
        return [key for key, value, _, _ in await self._records(">", headers_only=True) if value is not None]

    async def _records(self, keys: str, **how: bool) -> list[tuple[str, bytes | None, int, str]]:
        try:
            return await self.bus._read(lambda: read_records(self.bus.nc, self.bus.js, self.bucket, keys, **how))
        except NotFoundError:
            raise StreamNotFound(f"bucket {self.bucket} does not exist (has natsched ever run on this "
                                 "server?)") from None

    async def snapshot(self, keys: str = ">") -> dict[str, tuple[bytes, int]]:
        """The current value and revision of every live key matching ``keys``, read in windows
        so the service's other messages are not kept waiting behind it (``natsched.bus.snapshot``)."""
        return await read_kv(self.bus.nc, self.bus.js, self.bucket, keys)

    async def entries(self, pattern: str = ">", timeout: float = 10.0) -> AsyncIterator[tuple[str, bytes]]:
        """The current (key, value) of every live key matching ``pattern``, then the end.

        Read through :meth:`natsched.bus.streams.Stream.filtered`, not a KV watch: a watch's
        consumer is created without a name, so its filter is not in the create subject and no
        permission can confine it; this way a tenant's batch role reads ``job.<tenant>.*.*`` and
        nothing else (``natsched.ops.auth``).
        """
        prefix = S.kv_subject(self.bucket, "")
        async for msg in self.bus.stream(self.stream).filtered(prefix + pattern, last_per_subject=True,
                                                                timeout=timeout):
            if msg.headers.get(KV_OPERATION) not in (KV_DELETE, KV_PURGE):
                yield msg.subject[len(prefix):], msg.data

    async def watch(self, keys: str = ">", ready: asyncio.Event | None = None
                    ) -> AsyncIterator[tuple[str, bytes | None, int]]:
        """Current values, then every change: (key, value or None when deleted, revision).

        ``ready`` is set once the current values have all been yielded: an admitter that starts
        admitting at ``ready`` must have its quotas and the shared usage by then. nats-py's
        ``kv.watch()`` signals the end of the current values too early when the server has sent
        them but the client has not parsed them yet (nats-io/nats.py#842), so this is an ordered
        consumer of its own whose end is counted from the server's consumer info: what the
        consumer had delivered plus what it still held when the info was taken.
        """
        await self._handle()  # a missing bucket: StreamNotFound, before anything is created
        arrived: asyncio.Queue = asyncio.Queue(maxsize=256)  # a full queue holds back the server

        async def on_msg(msg: Any) -> None:
            await arrived.put(msg)

        sub = await self.bus.js.subscribe(S.kv_subject(self.bucket, keys), stream=self.stream, cb=on_msg,
                                          ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                                          inactive_threshold=300.0)
        try:
            info = await self.bus._read(sub.consumer_info)
            current, seen = info.num_pending + info.delivered.consumer_seq, 0
            prefix = S.kv_subject(self.bucket, "")
            while True:
                if ready is not None and not ready.is_set() and seen >= current:
                    ready.set()
                waiting = ready is not None and not ready.is_set()
                msg = await _next(arrived, READY_RECHECK_S if waiting else None)
                if msg is None:
                    # a value counted but gone before it was sent (an expired delete marker):
                    # nothing arrived for a while, so ask the server again whether any are left
                    info = await self.bus._read(sub.consumer_info)
                    current = seen if info.num_pending == 0 else current
                    continue
                seen += 1
                deleted = (msg.headers or {}).get(KV_OPERATION) in (KV_DELETE, KV_PURGE)
                yield msg.subject[len(prefix):], (None if deleted else msg.data), msg.metadata.sequence.stream
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # a closed connection took it already
                pass
