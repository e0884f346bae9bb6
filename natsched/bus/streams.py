"""A stream reader: what JetStream kept, read back by time, by sequence or by subject.

``reader = bus.stream(S.STREAM_REQUESTS)`` hands out one :class:`Stream`; services, the audit,
replay and the status page read through it and never see a ``nats`` object. Two ways to walk a
stream, for two kinds of reader:

- :meth:`Stream.window` (an ephemeral pull consumer with ``DeliverPolicy.BY_START_TIME``,
  optionally headers only, which makes scanning for one id cheap: :meth:`Stream.find` fetches
  bodies only for the matches) -- for an operator who may read everything;
- :meth:`Stream.filtered` -- the way a role confined to some subjects may read: its batch
  producer's own requests and job records (``natsched.ops.auth``); a KV bucket's live values are
  read on it by :meth:`natsched.bus.kv.KV.entries`.

Errors are :class:`natsched.bus.errors.ReadError` (:class:`StreamNotFound` for a missing stream).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import NotFoundError

from natsched.bus.errors import ReadError, StreamNotFound
from natsched.bus.provision import fmt_age, fmt_size
from natsched.wire import subjects as S

if TYPE_CHECKING:
    from natsched.bus.connection import Bus

#: status of a JetStream control message (flow control request, idle heartbeat)
_CONTROL_STATUS = "100"


@dataclass
class Stored:
    """One stored message: subject, body (empty when read headers-only), headers, position, time."""

    subject: str
    data: bytes
    headers: dict[str, str]
    seq: int
    ts: float

    @property
    def msg_id(self) -> str:
        return self.headers.get(S.HDR_MSG_ID, "")


@dataclass
class Retention:
    """A stream's limits and what it holds now (for "aged out" messages)."""

    stream: str
    max_age_s: float
    max_bytes: int
    messages: int
    first_ts: float | None  # oldest stored message, None when empty
    first_seq: int = 0  # > 1: older messages were removed (limits, purge)

    @property
    def lost_some(self) -> bool:
        return self.first_seq > 1

    def describe(self) -> str:
        return f"{self.stream} keeps messages for {fmt_age(self.max_age_s)} and at most {fmt_size(self.max_bytes)}"


@dataclass
class StreamState:
    """What a stream holds and how it is configured (the part of nats' StreamInfo natsched reads)."""

    name: str
    messages: int
    bytes: int
    first_seq: int
    last_seq: int
    max_age_s: float
    max_bytes: int
    replicas: int
    leader: str | None  # the cluster's leader for this stream, None when not clustered


@dataclass
class ConsumerState:
    """Where a durable consumer of the stream stands (the part of nats' ConsumerInfo natsched reads)."""

    durable: str
    pending: int  # stored, not yet delivered
    ack_pending: int  # delivered, not yet acked
    redelivered: int
    ack_floor: int  # the stream sequence up to which every message is acked
    delivered_stream_seq: int  # the last one handed out, as a stream sequence
    delivered_consumer_seq: int  # ... and as the consumer's own count of deliveries


def state_of(info: Any) -> StreamState:
    cluster = getattr(info, "cluster", None)
    return StreamState(info.config.name, info.state.messages, info.state.bytes, info.state.first_seq,
                       info.state.last_seq, info.config.max_age or 0.0, info.config.max_bytes,
                       info.config.num_replicas or 1, cluster.leader if cluster else None)


def _missing(stream: str) -> StreamNotFound:
    return StreamNotFound(f"stream {stream} does not exist (has natsched ever run on this server?)")


class Stream:
    """The read primitives of one stream (see the module docstring)."""

    def __init__(self, bus: "Bus", name: str) -> None:
        self.bus = bus
        self.name = name

    async def info(self) -> StreamState:
        try:
            return state_of(await self.bus._read(lambda: self.bus.js.stream_info(self.name)))
        except NotFoundError:
            raise _missing(self.name) from None

    async def consumer(self, durable: str) -> ConsumerState:
        """The state of the durable consumer ``durable`` on this stream."""
        try:
            info = await self.bus._read(lambda: self.bus.js.consumer_info(self.name, durable))
        except NotFoundError:
            raise StreamNotFound(f"no consumer {durable} on stream {self.name}") from None
        floor, delivered = info.ack_floor, info.delivered
        return ConsumerState(durable, info.num_pending or 0, info.num_ack_pending or 0, info.num_redelivered or 0,
                             floor.stream_seq if floor else 0, delivered.stream_seq if delivered else 0,
                             delivered.consumer_seq if delivered else 0)

    async def retention(self) -> Retention:
        """The stream's limits, how much it holds and since when."""
        state = await self.info()
        first = await self.get(state.first_seq) if state.messages else None
        return Retention(self.name, state.max_age_s, state.max_bytes, state.messages,
                         first.ts if first else None, state.first_seq)

    async def get(self, seq: int) -> Stored | None:
        """One message by stream sequence (its body, after a headers-only scan), None if gone."""
        try:
            raw = await self.bus.js.get_msg(self.name, seq)
        except NotFoundError:
            return None
        return Stored(raw.subject, raw.data or b"", dict(raw.headers or {}), raw.seq, _raw_ts(raw))

    async def tail(self, count: int, parallel: int = 64) -> list[bytes]:
        """The bodies of the last ``count`` messages, oldest first (direct gets by sequence, so a
        status page stays cheap on a week-long audit stream); deleted ones are gaps."""
        state = await self.info()
        if not state.messages or count <= 0:
            return []
        seqs = list(range(max(state.first_seq, state.last_seq - count + 1), state.last_seq + 1))
        out: list[bytes] = []
        for i in range(0, len(seqs), parallel):
            got = await asyncio.gather(*(self.bus.js.get_msg(self.name, seq) for seq in seqs[i:i + parallel]),
                                       return_exceptions=True)
            out += [m.data or b"" for m in got if not isinstance(m, BaseException)]
        return out

    async def window(self, since: float | None = None, until: float | None = None,
                     subject: str | Sequence[str] | None = None, headers_only: bool = False,
                     batch: int = 512) -> AsyncIterator[Stored]:
        """Every message stored in ``[since, until]`` (unix seconds; None = open end), oldest
        first, optionally only ``subject`` (wildcards allowed; several non-overlapping filters
        are read by one consumer, in stream order). Ends at the newest message."""
        js = self.bus.js
        subjects = [subject] if isinstance(subject, str) else list(subject or ())
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_TIME if since else api.DeliverPolicy.ALL,
            opt_start_time=dt.datetime.fromtimestamp(since, dt.timezone.utc) if since else None,
            headers_only=headers_only or None,
            inactive_threshold=60.0,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            filter_subjects=subjects if len(subjects) > 1 else None,
            mem_storage=True,
        )
        try:
            last = (await js.stream_info(self.name)).state.last_seq  # a busy stream is read up to here, not chased
            psub = await js.pull_subscribe(config.filter_subject or "", durable=None, stream=self.name, config=config)
        except NotFoundError:
            raise _missing(self.name) from None
        info = await psub.consumer_info()
        try:
            pending = info.num_pending
            while pending > 0:
                try:
                    msgs = await psub.fetch(min(batch, pending), timeout=2.0)
                except (NatsTimeout, asyncio.TimeoutError):
                    break  # the stream shrank under us (limits): what is left is newer than we need
                for msg in msgs:
                    meta = msg.metadata
                    ts = meta.timestamp.timestamp()
                    if (until is not None and ts > until) or meta.sequence.stream > last:
                        return
                    yield Stored(msg.subject, msg.data or b"", dict(msg.headers or {}), meta.sequence.stream, ts)
                    pending = meta.num_pending
        finally:
            try:
                await psub.unsubscribe()
                await js.delete_consumer(self.name, info.name)
            except Exception:  # it expires by itself anyway (inactive_threshold)
                pass

    async def find(self, wanted: Callable[[str], bool], since: float | None, until: float | None = None,
                   subject: str | Sequence[str] | None = None) -> list[Stored]:
        """Bodies of the messages in the window whose ``Nats-Msg-Id`` is ``wanted`` (a headers-only
        scan; only the matches' bodies are fetched)."""
        out = []
        async for head in self.window(since, until, subject, headers_only=True):
            if wanted(head.msg_id):
                full = await self.get(head.seq)
                if full is not None:
                    out.append(full)
        return out

    async def filtered(self, subject: str, since: float | None = None, last_per_subject: bool = False,
                       headers_only: bool = False, timeout: float = 10.0) -> AsyncIterator[Stored]:
        """The messages on ``subject`` (wildcards allowed) stored from ``since`` (None: all;
        ``last_per_subject``: only the newest of each subject, as a KV snapshot), oldest first;
        ends once the consumer has nothing more pending.

        Why not :meth:`window`: a pull consumer is read through ``CONSUMER.MSG.NEXT.<stream>.<name>``,
        a subject that names no filter, so a role allowed it could pull from any consumer of the stream
        (the admitter's, full of other tenants' prompts). Here the ephemeral consumer has a name, so its
        create subject carries the filter (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``, which
        the server checks against the request body), and it pushes to this connection's own inbox: a
        permission on that one create subject confines a role to what it may read (``natsched.ops.auth``).
        Nor does it ask for consumer info or delete the consumer (both name no filter either): the
        consumer goes by itself once nobody listens on its inbox (``inactive_threshold``).
        """
        nc, js = self.bus.nc, self.bus.js
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        config = api.ConsumerConfig(
            name=uuid.uuid4().hex,
            filter_subject=subject,
            deliver_subject=inbox,
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=(api.DeliverPolicy.LAST_PER_SUBJECT if last_per_subject
                            else api.DeliverPolicy.BY_START_TIME if since else api.DeliverPolicy.ALL),
            opt_start_time=dt.datetime.fromtimestamp(since, dt.timezone.utc) if since and not last_per_subject else None,
            headers_only=headers_only or None,
            flow_control=True,  # the server waits for our answer instead of overrunning the inbox
            idle_heartbeat=min(5.0, timeout / 2),
            inactive_threshold=max(5.0, timeout),
            mem_storage=True,
            num_replicas=1,
        )
        try:
            try:
                pending = (await js.add_consumer(self.name, config)).num_pending
            except NotFoundError:
                raise _missing(self.name) from None
            except (NatsTimeout, asyncio.TimeoutError):
                raise ReadError(f"no answer to reading {subject} from {self.name}: the server is busy, or these "
                                "credentials may not read it") from None
            while pending:
                try:
                    msg = await sub.next_msg(timeout)
                except (NatsTimeout, asyncio.TimeoutError):
                    raise ReadError(f"reading {subject} from {self.name} stalled: nothing for {timeout:g}s with "
                                    f"{pending} message(s) pending") from None
                headers = dict(msg.headers or {})
                if headers.get("Status") == _CONTROL_STATUS:
                    answer = msg.reply or headers.get(api.Header.CONSUMER_STALLED.value)
                    if answer:  # a flow-control request (or a stalled heartbeat): we have read all before it
                        await nc.publish(answer, b"")
                    continue
                meta = msg.metadata
                pending = meta.num_pending
                yield Stored(msg.subject, msg.data or b"", headers, meta.sequence.stream, meta.timestamp.timestamp())
        finally:
            await sub.unsubscribe()


def _iso_ts(value: Any) -> float | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _raw_ts(raw: Any) -> float:
    value = getattr(raw, "time", None)
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return _iso_ts(value) or 0.0
