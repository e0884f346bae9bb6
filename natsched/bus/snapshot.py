"""A paced read of a KV bucket's current values, for a service that keeps serving meanwhile.

Why not a KV watch: a watch's consumer pushes the whole bucket at once, and a service reads
everything on one connection. The admitter's ``inflight`` bucket holds, besides the live
reservations, a release marker per request of the last minute (tens of thousands at 1,000
requests/s); pushed in one go they stood between the admitter and its requests on the socket
(`natsched bench pipeline`: a 150-240 ms stall at the first reconciliation, p99 50-100 ms
instead of 15-25 ms). Here the consumer's ack policy is "all" with at most ``window`` messages
unacknowledged: the server sends a window, the reader acks half of it with one ack after a short
pause, and what else arrived on the connection is handled in between. A read of 10,000 records
takes ~0.4 s longer than at full speed and no longer shows in the service's latency.

The consumer has a name, so its filter is in the create subject (``natsched.ops.auth`` can pin a
role to its bucket), and it goes by itself if the reader dies (``inactive_threshold``).

Why not nats-py's ``kv.keys()`` / ``kv.history()`` either: they end at the watcher's first
"nothing more" marker, which nats-py sends when the consumer reports nothing pending and the
client has counted no message yet. A message the server has already sent but the client has not
parsed makes both return short: an empty list and ``NoKeysError`` on a bucket that holds keys
(nats-io/nats.py#842; it failed ``natsched quota show`` once in CI on a busy machine). Here the
end is the count the server gives when it creates the consumer, and the stream's last sequence.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from typing import Any

from nats.js import api

from natsched.bus.aio import wait_event
from natsched.bus.errors import SnapshotError

KV_OPERATION, KV_DELETE, KV_PURGE = "KV-Operation", "DEL", "PURGE"  # NATS KV's delete markers
WINDOW = 256  # messages the server may have sent and we not yet acknowledged
PAUSE_S = 0.005  # between half windows: a background read takes a fraction of the service's time
STALL_S = 10.0  # nothing arriving this long with messages still pending: the read fails


def windowed_consumer(bucket: str, keys: str, deliver_subject: str, window: int = WINDOW,
                      stall_s: float = STALL_S, history: bool = False,
                      headers_only: bool = False) -> api.ConsumerConfig:
    """The last value of each key (every stored revision with ``history``), pushed to
    ``deliver_subject`` at most ``window`` ahead of the reader's acks (one ack covers everything
    before it)."""
    return api.ConsumerConfig(
        name=uuid.uuid4().hex, filter_subject=f"$KV.{bucket}.{keys}", deliver_subject=deliver_subject,
        deliver_policy=api.DeliverPolicy.ALL if history else api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.ALL, headers_only=headers_only or None,
        max_ack_pending=window, ack_wait=60.0, inactive_threshold=stall_s, mem_storage=True, num_replicas=1,
    )


async def read_kv(nc: Any, js: Any, bucket: str, keys: str = ">", window: int = WINDOW,
                  stall_s: float = STALL_S, pause_s: float = PAUSE_S) -> dict[str, tuple[bytes, int]]:
    """The current value and revision of every live key of ``bucket`` matching ``keys``.

    Ends at what was stored when the read began (values written meanwhile may or may not be
    in it, as with any snapshot of a changing bucket); deleted keys are left out. Raises
    :class:`SnapshotError` if the server stops sending with messages pending.
    """
    rows = await read_records(nc, js, bucket, keys, window=window, stall_s=stall_s, pause_s=pause_s)
    return {key: (value, rev) for key, value, rev, _op in rows if value is not None}


async def read_records(nc: Any, js: Any, bucket: str, keys: str = ">", *, history: bool = False,
                       headers_only: bool = False, window: int = WINDOW, stall_s: float = STALL_S,
                       pause_s: float = PAUSE_S) -> list[tuple[str, bytes | None, int, str]]:
    """The stored records of the keys matching ``keys``, oldest first: (key, value or None for
    a delete or purge, revision, operation ``PUT`` / ``DEL`` / ``PURGE``). The last record of each
    key, or every record the bucket keeps with ``history``; with ``headers_only`` the values are
    empty (``b""``), for listing keys without moving their values.

    Same ending and errors as :func:`read_kv`; a missing bucket raises nats-py's ``NotFoundError``
    (the KV handle turns it into ``StreamNotFound``).
    """
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    got: collections.deque = collections.deque()
    arrived = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        got.append(msg)
        arrived.set()

    sub = await nc.subscribe(nc.new_inbox(), cb=on_msg, pending_msgs_limit=4 * window + 100)
    config = windowed_consumer(bucket, keys, sub.subject, window, stall_s, history, headers_only)
    out: list[tuple[str, bytes | None, int, str]] = []
    created = False
    try:
        last = (await js.stream_info(stream)).state.last_seq  # read up to here, not chased
        pending = (await js.add_consumer(stream, config)).num_pending
        created = True
        unacked = 0
        while pending:
            if not got:
                arrived.clear()
                if not await wait_event(arrived, stall_s):
                    raise SnapshotError(f"reading {bucket}: nothing for {stall_s:g}s with {pending} pending") from None
                continue
            msg = got.popleft()
            meta = msg.metadata
            pending = 0 if meta.sequence.stream >= last else meta.num_pending
            op = (msg.headers or {}).get(KV_OPERATION) or "PUT"
            out.append((msg.subject[len(prefix):], None if op in (KV_DELETE, KV_PURGE) else msg.data,
                        meta.sequence.stream, op))
            unacked += 1
            if pending and unacked >= window // 2:  # one ack for the half window: the next half comes
                await asyncio.sleep(pause_s)
                await msg.ack()
                unacked = 0
    finally:
        await sub.unsubscribe()
        if created:
            try:
                await js.delete_consumer(stream, config.name)
            except Exception:  # it goes by itself anyway (inactive_threshold)
                pass
    return out
