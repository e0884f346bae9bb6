"""The Bus: the one object services use to talk to NATS (they never import nats themselves).

It owns the connection (reconnect forever, time-budgeted publish retries), JetStream
publishing with dedup ids, core pub/sub, KV access and durable pull consumers whose loop
turns unusable messages into dead letters instead of endless redeliveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import traceback
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import orjson

import nats
from nats.errors import ConnectionClosedError, NoRespondersError, NoServersError
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from natsched.wire import subjects as S
from natsched.wire.fence import reply_key
from natsched.bus.aio import Mailbox
from natsched.bus.acks import AckInbox
from natsched.bus.errors import BusError, BusTimeout, ConnectError, NoServerError, PublishFailed, PublishRefused
from natsched.wire.errors import MessageError
from natsched.bus.provision import (ProvisionSettings, StreamLimits, apply_retention, cluster_nodes,
                                    fit_stored_limits, overrides_to_json, provision, provision_jobs,
                                    stored_overrides, stored_settings)
from natsched.bus.puller import Puller
from natsched.wire.schema import DeadLetter, Reply, Schema
from natsched.bus.kv import KV
from natsched.bus.streams import Stream
from natsched.bus.server import DEFAULT_URL

log = logging.getLogger(__name__)

T = TypeVar("T")
JS_NO_MESSAGE_FOUND = 10057  # JetStream's err_code for a message sequence that is not stored
JS_WRONG_LAST_SEQUENCE = 10071  # ... for a conditional publish whose subject moved on
HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
#: headers that make a publish on a KV key's subject a create: refused when the key has a value,
#: or a delete marker (a released reservation's lives MARKER_TTL_S): one record per request id
CREATE_ONLY = {HDR_EXPECTED_LAST_SUBJECT_SEQ: "0"}
_RETRYABLE = (NatsTimeout, NoRespondersError, NoStreamResponseError, ServiceUnavailableError, asyncio.TimeoutError)
#: "nobody took the request" (no stream leader, e.g. during an election): a compare-and-swap may be
#: sent again without risk; after a timeout it may have been applied, and the caller must re-read
_NOT_PROCESSED = (NoRespondersError, NoStreamResponseError, ServiceUnavailableError)


#: ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>``
_ACK_V1_TOKENS = 9


class Delivery:
    """One JetStream message handed to a consumer handler, with its ack verbs."""

    __slots__ = ("_msg", "subject", "data", "headers", "settled")

    def __init__(self, msg: Any) -> None:
        self._msg = msg
        self.subject: str = msg.subject
        self.data: bytes = msg.data
        self.headers: dict[str, str] = msg.headers or {}
        self.settled = False  # acked, nak'd or terminated

    @property
    def num_pending(self) -> int:
        """Messages still waiting for this consumer after this one (0: the stream is drained)."""
        return self._msg.metadata.num_pending

    @property
    def num_delivered(self) -> int:
        """Read off the ack subject's one token: every handler asks (is this a redelivery?), and
        nats-py's full ``metadata`` (sequences, a datetime, names) costs several times more."""
        tokens = (self._msg.reply or "").split(".")
        if len(tokens) == _ACK_V1_TOKENS and tokens[:2] == ["$JS", "ACK"] and tokens[4].isdigit():
            return int(tokens[4])
        return self._msg.metadata.num_delivered  # the domain form, or not a JetStream message (raises)

    @property
    def stream_seq(self) -> int:
        return self._msg.metadata.sequence.stream

    @property
    def timestamp(self) -> float:
        return self._msg.metadata.timestamp.timestamp()

    async def ack(self) -> None:
        self.settled = True
        await self._msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        self.settled = True
        await self._msg.nak(delay=delay)

    async def term(self) -> None:
        self.settled = True
        await self._msg.term()

    async def in_progress(self) -> None:
        await self._msg.in_progress()


DEAD_LETTER_MAX_DATA = 512 * 1024

#: (subject, message, msg id, headers) for :meth:`Bus.jpublish_batch`
Outgoing = tuple[str, "Schema | bytes", "str | None", "dict[str, str] | None"]
BATCH_ACK_WAIT_S = 2.0  # a batch's acks normally take a round trip; then each is retried alone
#: how long a durable consumer's creation is retried on timeouts (a cluster electing leaders)
BIND_BUDGET_S = 30.0
#: a background retry of an audit record (:meth:`Bus.jpublish_nowait`) goes on this long: past a
#: leader election on a loaded machine, inside the streams' 2-minute duplicate window (a retry
#: whose first copy was stored after all is then dropped by its msg id, not stored twice)
RECORD_BUDGET_S = 90.0
MAX_RECORD_RETRIES = 10_000  # records waiting for the server at once; beyond, each is counted lost


def _with_msg_id(headers: dict[str, str] | None, msg_id: str | None) -> dict[str, str] | None:
    """``headers`` plus ``Nats-Msg-Id`` when there is a msg id (None when both are empty)."""
    out = dict(headers or {})
    if msg_id:
        out[S.HDR_MSG_ID] = msg_id
    return out or None


Handler = Callable[[Delivery], Awaitable[None]]
BatchHandler = Callable[[list[Delivery]], Awaitable[None]]


@dataclass
class ConsumerSpec:
    """A durable pull consumer: who reads what, how long a message may stay un-acked."""

    stream: str
    durable: str
    filter_subject: str | None = None
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    max_ack_pending: int = 1000
    batch: int = 64
    deliver_new: bool = False  # start at new messages instead of the whole stream
    redeliver_delay_s: float = 1.0


@dataclass
class Credentials:
    """Who a connection is, for a server that requires auth (``natsched auth init`` writes one
    JSON file of these per role; :meth:`load` reads it).

    ``inbox_prefix`` matters as much as the password: replies (JetStream acks, pulled messages,
    KV reads) travel on inbox subjects, and a role allowed ``_INBOX.>`` could read every other
    role's. Each role therefore gets its own prefix and may subscribe only below it. Relative
    file paths in a loaded file are relative to that file.
    """

    user: str | None = None
    password: str | None = None
    nkey_seed: str | None = None  # path of an nkey seed file (needs the nkeys package)
    creds: str | None = None  # path of a NATS .creds file (JWT + seed: operator mode)
    inbox_prefix: str | None = None
    tls_ca: str | None = None  # CA that signed the server's certificate
    tls_cert: str | None = None  # client certificate (servers that verify clients)
    tls_key: str | None = None
    #: the JetStream API prefix of a role outside the services' account (its account imports
    #: the services' API under this name: ``natsched.wire.roles.IMPORTED_JS_API``)
    js_prefix: str | None = None
    #: the key that signs and checks assignments' fencing tokens (``natsched.wire.fence``): only
    #: the scheduler's services (admitter, router, admin) are given it
    fence_key: str | None = None
    #: per tenant, the key that checks workers' replies (``natsched.wire.fence.reply_key``): given
    #: to the producers, batch producers and gateway of those tenants instead of the fence key
    reply_keys: dict[str, str] | None = None

    @classmethod
    def load(cls, path: str | Path) -> "Credentials":
        path = Path(path)
        try:
            raw = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ConnectError(f"cannot read credentials {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ConnectError(f"credentials {path} must be a JSON object")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        for key in ("nkey_seed", "creds", "tls_ca", "tls_cert", "tls_key"):
            if key in values:
                values[key] = str((path.parent / values[key]).resolve())
        return cls(**values)

    def tls_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca or self.tls_cert):
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        out: dict[str, Any] = {}
        if self.user is not None:
            out["user"], out["password"] = self.user, self.password
        if self.nkey_seed:
            out["nkeys_seed"] = self.nkey_seed
        if self.creds:
            out["user_credentials"] = self.creds
        if self.inbox_prefix:
            out["inbox_prefix"] = self.inbox_prefix
        tls = self.tls_context()
        if tls is not None:
            out["tls"] = tls
        return out


def server_urls(url: str | list[str]) -> list[str]:
    """``nats://a:4222,nats://b:4223`` (or a list) -> every URL: a cluster connect."""
    parts = url if isinstance(url, list) else url.split(",")
    return [u.strip() for u in parts if u.strip()]


class Received:
    """One core NATS message as a handle hands it out: subject, body, headers."""

    __slots__ = ("subject", "data", "headers")

    def __init__(self, msg: Any) -> None:
        self.subject: str = msg.subject
        self.data: bytes = msg.data
        self.headers: dict[str, str] = msg.headers or {}


class Subscription:
    """A core subscription; :meth:`unsubscribe` ends it."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    @property
    def subject(self) -> str:
        return self._sub.subject

    async def unsubscribe(self) -> None:
        await self._sub.unsubscribe()


class Inbox(Subscription):
    """A subscription read one message at a time (a producer's reply stream).

    Not nats-py's ``next_msg``: it waits with ``asyncio.wait_for``, which on Python 3.11 swallows
    a cancellation that meets a message (:mod:`natsched.bus.aio`): a gateway whose client left
    cancelled the reader once, the reader went on, and the request ran to its end for nobody.
    """

    def __init__(self, sub: Any, box: Mailbox, more: list[Any] | None = None) -> None:
        super().__init__(sub)
        self._box = box
        self._more = more or []

    async def unsubscribe(self) -> None:
        for sub in self._more:
            await sub.unsubscribe()
        await super().unsubscribe()

    async def next_msg(self, timeout: float) -> Received:
        """The next message; :class:`BusTimeout` when none comes within ``timeout`` seconds."""
        try:
            return Received(await self._box.get(timeout))
        except TimeoutError:
            raise BusTimeout(f"nothing on {self._sub.subject} within {timeout:g}s") from None


class Bus:
    """A connected NATS client with JetStream, used by every natsched service and producer."""

    def __init__(self, nc: Any, name: str, publish_budget_s: float) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.name = name
        self.publish_budget_s = publish_budget_s
        self._tasks: list[asyncio.Task] = []
        self._kv: dict[str, Any] = {}
        self.closing = False  # loops check it: nats-py's fetch can swallow a cancellation
        self.lost_publishes = 0
        #: how long a record of :meth:`jpublish_nowait` is retried in the background
        self.record_budget_s = RECORD_BUDGET_S
        self._record_retries = 0
        self.fence_key: str | None = None  # natsched.wire.fence (None: the public default)
        self.reply_keys: dict[str, str] = {}  # tenant -> its reply key (natsched.wire.fence.reply_key)
        self._acks: AckInbox | None = None
        self._acks_lock = asyncio.Lock()
        self.server_id = self._server_id()
        self.server_changes = 0  # reconnects that found another server process (a restart, or another node)
        self._on_server_change: list[Callable[[], None]] = []

    def _server_id(self) -> str:
        return str((getattr(self.nc, "_server_info", None) or {}).get("server_id", ""))

    def check_server(self) -> None:
        """Notice a server change now, if the reconnect callback has not run yet: nats-py delivers
        messages of the new connection before it calls the callback, so a consumer asks first."""
        self._reconnected()

    def on_server_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (synchronously, from the reconnect) whenever a reconnect finds another
        server than before: a nats-server restarted (each start draws a new id) or another cluster
        node. What that server acknowledged but had not yet written may be gone (docs/reliability.md)."""
        self._on_server_change.append(callback)

    def _reconnected(self) -> None:
        new = self._server_id()
        if new == self.server_id:
            return
        log.warning("%s reconnected to another server process (%s -> %s)", self.name, self.server_id[:8] or "?",
                    new[:8] or "?")
        self.server_id = new
        self.server_changes += 1
        for callback in self._on_server_change:
            callback()

    @classmethod
    async def connect(
        cls,
        url: str = DEFAULT_URL,
        name: str = "natsched",
        connect_budget_s: float = 10.0,
        publish_budget_s: float = 10.0,
        credentials: "Credentials | str | Path | None" = None,
        **options: Any,
    ) -> "Bus":
        """Connect, retrying until ``connect_budget_s``; afterwards reconnect forever.

        ``url`` may list several servers (comma-separated): a cluster, any node will do.
        ``credentials`` (or a path to a credentials file) authenticates; other ``options``
        go to ``nats.connect`` as they are.
        """
        js_prefix = fence_key = reply_keys = None
        if credentials is not None:
            creds = credentials if isinstance(credentials, Credentials) else Credentials.load(credentials)
            options = {**creds.options(), **options}
            js_prefix, fence_key, reply_keys = creds.js_prefix, creds.fence_key, creds.reply_keys
        servers = server_urls(url)
        deadline = time.monotonic() + connect_budget_s
        made: list[Bus] = []  # the Bus once built: the reconnect callback reports to it

        async def reconnected() -> None:
            if made:
                made[0]._reconnected()
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                # the first connection is bounded by our budget, not nats-py's retry loop
                remaining = max(0.1, deadline - time.monotonic())
                nc = await asyncio.wait_for(
                    nats.connect(
                        servers if len(servers) > 1 else servers[0],
                        name=name,
                        connect_timeout=min(2.0, remaining),
                        allow_reconnect=False,
                        max_reconnect_attempts=1,
                        reconnect_time_wait=0.2,
                        error_cb=_log_first_connect,  # our loop retries: the last error is raised
                        reconnected_cb=reconnected,
                        **options,
                    ),
                    remaining,
                )
                nc.options["allow_reconnect"] = True  # once connected, reconnect forever
                nc.options["max_reconnect_attempts"] = -1
                nc._error_cb = _log_error  # nats-py keeps the callback here: a lost connection is news
                bus = cls(nc, name, publish_budget_s)
                bus.fence_key = fence_key
                bus.reply_keys = dict(reply_keys or {})
                if js_prefix:
                    bus.js = nc.jetstream(prefix=js_prefix)
                made.append(bus)
                return made[0]
            except (NoServersError, OSError, NatsTimeout, asyncio.TimeoutError) as exc:
                last = exc
                await asyncio.sleep(0.2)
            except NatsError as exc:
                if "authorization violation" not in str(exc).lower():
                    raise
                raise ConnectError(f"NATS at {url} refused the credentials of {name!r} (authorization "
                                   "violation): pass --credentials FILE from natsched auth init") from None
        why = str(last) or type(last).__name__
        raise NoServerError(f"could not reach NATS at {url} within {connect_budget_s:g}s: {why}", url)

    async def provision(self, settings: ProvisionSettings | None = None, jobs: bool = False) -> None:
        """Create or update every stream and bucket; by default with the limits an operator stored
        (``natsched retention set``), so a restarting service never resets them. ``jobs``: also
        OUTCOMES and bucket ``jobs`` (the batch producer's and the offline runner's), with their
        stored limits too.

        Retried within the publish budget on timeouts: a service restarted while a cluster node
        is down meets an election (a chaos run's admitter exited here once, unready for 60 s);
        provisioning is idempotent, so running it again is safe."""
        async def once(_remaining: float) -> None:
            await provision(self.js, settings or await stored_settings(self.js))

        await self._retrying(once, None, "provisioning", logging.WARNING)
        if jobs:
            await self.provision_jobs()

    async def set_partitions(self, partitions: int) -> bool:
        """Store requests in ``partitions`` partitions from now on (REQUESTS' subject transform and
        bucket ``budget``: :func:`natsched.bus.provision.set_partitions`); True when it changed."""
        from natsched.bus.provision import set_partitions

        return await set_partitions(self.js, partitions)

    async def partitions(self) -> int:
        """How many partitions REQUESTS stores requests in now (1: unpartitioned, or no stream)."""
        from natsched.bus.provision import stream_partitions

        try:
            return stream_partitions((await self.js.stream_info(S.STREAM_REQUESTS)).config)
        except NotFoundError:
            return 1

    async def provision_jobs(self) -> None:
        """Create or update OUTCOMES and bucket ``jobs`` (idempotent; a batch reader may be the
        first natsched process on a fresh server)."""
        await provision_jobs(self.js)

    async def fit_to_disk(self, free_bytes: int) -> dict[str, StreamLimits]:
        """Size every stream's limits to a disk with ``free_bytes`` free, stored as retention
        overrides (:func:`natsched.bus.provision.fit_stored_limits`); ProvisionError when too small."""
        return await fit_stored_limits(self.js, free_bytes)

    async def stored_overrides(self) -> dict[str, StreamLimits]:
        """What ``natsched retention set`` stored (:func:`natsched.bus.provision.stored_overrides`)."""
        return await stored_overrides(self.js)

    async def set_retention(self, limits: dict[str, StreamLimits]) -> None:
        """Store ``limits`` (per stream, or bucket ``jobs``) among the overrides (``natsched
        retention set``) and apply them now; every later provisioning keeps them."""
        overrides = {**await self.stored_overrides(), **limits}
        await self.kv(S.BUCKET_CONFIG).put(S.KEY_RETENTION, overrides_to_json(overrides))
        for target, kept in limits.items():
            await apply_retention(self.js, target, kept)

    def cluster_nodes(self) -> int:
        """How many servers the connected cluster has (1 when not clustered)."""
        return cluster_nodes(self.js)

    async def jetstream_ready(self) -> None:
        """Returns once JetStream answers (a cluster has elected its meta leader); raises otherwise."""
        await self.js.account_info()

    async def stream_sizes(self) -> dict[str, dict[str, int]]:
        """Messages and bytes of every stream on the server, and its last sequence number (what
        was ever stored: a work queue's or KV bucket's ``messages`` shrink as they are removed)."""
        infos = await self.js.streams_info()
        return {i.config.name: {"messages": i.state.messages, "bytes": i.state.bytes, "last_seq": i.state.last_seq}
                for i in infos}

    # --- the connection ----------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    @property
    def closed(self) -> bool:
        """Closed for good (stopped, or reconnects exhausted), not merely reconnecting."""
        return bool(self.nc.is_closed)

    async def flush(self, timeout: float = 10.0) -> None:
        """Until the server has everything published so far (a round trip)."""
        try:
            await self.nc.flush(timeout=timeout)
        except (NatsTimeout, asyncio.TimeoutError):
            raise BusTimeout(f"flush not answered within {timeout:g}s") from None

    async def close(self, budget_s: float = 3.0) -> None:
        """Flush what is buffered within a budget, then close: a dead server never hangs us.

        (Not ``drain()``: with pull subscriptions it waits on queues nats-py never marks done.)
        """
        self.closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=budget_s)
            for task in pending:  # a task that ignores cancellation must not hang the shutdown
                log.warning("task %s did not stop within %.0fs: %s", task.get_name(), budget_s,
                            "".join(traceback.format_stack(task.get_stack()[-1])) if task.get_stack() else "?")
        self._tasks.clear()
        if self.nc.is_closed:
            return
        try:
            if self.nc.is_connected:
                await self.nc.flush(timeout=budget_s)
        except Exception:  # closing anyway
            pass
        if not self.nc.is_closed:
            await self.nc.close()

    # --- publishing ---------------------------------------------------------------------
    async def publish(self, subject: str, msg: Schema | bytes, headers: dict[str, str] | None = None,
                      reply: str = "") -> None:
        """Core NATS publish (at most once): replies, heartbeats, cache events. ``reply``: the NATS
        reply subject (natsched's own traffic names none; ``natsched chaos --scenario hostile``
        does, as an attacker would)."""
        data = msg if isinstance(msg, bytes) else msg.encode()
        await self.nc.publish(subject, data, reply=reply, headers=headers)

    async def jpublish(
        self,
        subject: str,
        msg: Schema | bytes,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        budget_s: float | None = None,
    ) -> Stored:
        """JetStream publish with an ack, retried within a time budget.

        ``msg_id`` becomes ``Nats-Msg-Id``: a retry after a lost ack (or a leader change) is
        then deduplicated by the server instead of stored twice. What the budget cannot save
        raises a :class:`BusError` (:class:`BusTimeout` when nothing answered, a
        :class:`PublishRefused` when the server said no), never a nats exception.
        """
        with _as_bus_errors(subject):
            return Stored.of(await self._jpublish(subject, msg, msg_id, headers, budget_s))

    async def _jpublish(self, subject: str, msg: Schema | bytes, msg_id: str | None,
                        headers: dict[str, str] | None, budget_s: float | None) -> api.PubAck:
        """:meth:`jpublish` as nats-py answers it (its ack, its exceptions)."""
        data = msg if isinstance(msg, bytes) else msg.encode()
        hdrs = _with_msg_id(headers, msg_id)
        started = time.monotonic()
        try:  # the first attempt on the shared ack inbox (bus/acks.py: no request machinery)
            return await (await (await self._ack_inbox()).publish(subject, data, hdrs))
        except _RETRYABLE as exc:
            log.warning("publish to %s failed (%s); retrying", subject, type(exc).__name__)
        attempts = 1  # its copy may be stored: a retry that finds it is no one else's duplicate
        budget_s = (budget_s if budget_s is not None else self.publish_budget_s) - (time.monotonic() - started)

        def attempt(remaining: float) -> Awaitable[api.PubAck]:
            nonlocal attempts
            attempts += 1
            return self.js.publish(subject, data, timeout=max(0.5, min(2.0, remaining)), headers=hdrs)

        ack = await self._retrying(attempt, budget_s, f"publish to {subject}", logging.WARNING)
        if ack.duplicate and attempts > 1:
            # a retry found its own first attempt stored (that ack was lost): not someone else's copy
            ack.duplicate = False
        return ack

    async def jpublish_batch(self, items: list[Outgoing]) -> list[Stored | None]:
        """Publish several messages (in this order on the connection) and wait once for every ack.

        The same guarantee as :meth:`jpublish` for each, at a fraction of its cost: one reply
        future per message on a shared inbox instead of a request with its own timer, and one
        wait for the batch. A message whose ack is an error or does not come within
        ``BATCH_ACK_WAIT_S`` is published again through :meth:`jpublish` (with its msg id, a
        copy the server did store is deduplicated); what still fails raises, as there. A
        create-only message (:data:`CREATE_ONLY`: a KV put made a create) whose subject holds a
        message gets None instead: the key exists, or was deleted a moment ago.
        """
        inbox = await self._ack_inbox()
        futures = []
        for subject, msg, msg_id, headers in items:
            data = msg if isinstance(msg, bytes) else msg.encode()
            futures.append(await inbox.publish(subject, data, _with_msg_id(headers, msg_id)))
        if futures:
            await asyncio.wait(futures, timeout=BATCH_ACK_WAIT_S)
        acks = []
        for (subject, msg, msg_id, headers), f in zip(items, futures):
            if f.done() and not f.cancelled() and f.exception() is None:
                acks.append(Stored.of(f.result()))
            elif f.done() and not f.cancelled() and _refused_condition(f.exception(), headers):
                acks.append(None)  # a create-only write (expected last subject sequence 0) found the key
            else:
                inbox.forget(f)
                try:
                    with _as_bus_errors(subject, create_only=headers):
                        acks.append(Stored.of(await self._jpublish(subject, msg, msg_id, headers, None)))
                except _CreateRefused:
                    acks.append(None)
        return acks

    async def _ack_inbox(self) -> AckInbox:
        """The connection's one ack inbox, subscribed on first use."""
        if self._acks is not None:
            return self._acks
        async with self._acks_lock:  # (two first publishers at once: still one inbox)
            if self._acks is None:
                acks = AckInbox(self.nc, timeout_s=BATCH_ACK_WAIT_S)
                await acks.start()
                self._acks = acks
                self.spawn(acks.sweep_loop(), "publish-acks")
        return self._acks

    async def jpublish_nowait(self, subject: str, msg: Schema | bytes, msg_id: str | None = None) -> None:
        """JetStream publish whose ack is checked in the background (audit records).

        The caller does not wait a round trip; a publish the server does not acknowledge is
        retried in the background through :meth:`jpublish` for ``record_budget_s``, and otherwise
        logged and counted in ``lost_publishes``. That budget is longer than the publish budget
        on purpose: the caller has moved on (its hand-off, stored with the publish budget and
        redelivered if that ran out, cannot wait for it), so a record sent into a leader election
        that outlasts the publish budget would otherwise be the one thing of its request lost (CI
        once lost 14 admission records of 30 that way on a loaded machine).
        """
        data = msg if isinstance(msg, bytes) else msg.encode()
        future = await (await self._ack_inbox()).publish(subject, data, _with_msg_id(None, msg_id))

        def done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:  # stored
                return
            if self._record_retries >= MAX_RECORD_RETRIES:  # a long outage: memory stays bounded
                self._lose(subject, f, "too many records waiting for the server")
                return
            self._record_retries += 1
            self.spawn(self._retry_publish(subject, data, msg_id, f), f"republish:{subject}")

        future.add_done_callback(done)

    async def _retry_publish(self, subject: str, data: bytes, msg_id: str | None, f: asyncio.Future) -> None:
        try:
            await self.jpublish(subject, data, msg_id=msg_id, budget_s=self.record_budget_s)
        except Exception as exc:
            self._lose(subject, f, exc)
        finally:
            self._record_retries -= 1

    @property
    def records_retrying(self) -> int:
        """Audit records of :meth:`jpublish_nowait` being published again in the background now."""
        return self._record_retries

    def _lose(self, subject: str, f: asyncio.Future, why: object) -> None:
        self.lost_publishes += 1
        log.error("publish to %s lost (%s, then %s)", subject, None if f.cancelled() else f.exception(), why)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        """Core request/reply: the answer's body; :class:`BusTimeout` when none comes in time (or nobody listens)."""
        try:
            msg = await self.nc.request(subject, data, timeout=timeout)
        except (NatsTimeout, asyncio.TimeoutError):
            raise BusTimeout(f"no answer on {subject} within {timeout:g}s") from None
        except NoRespondersError:
            raise BusTimeout(f"no answer on {subject}: nobody listens") from None
        return msg.data

    async def respond(self, subject: str, answer: Callable[[bytes], Awaitable[bytes]]) -> Subscription:
        """Answer every request on ``subject`` with ``await answer(body)``."""
        async def cb(msg: Any) -> None:
            await msg.respond(await answer(msg.data))

        return Subscription(await self.nc.subscribe(subject, cb=cb))

    async def jpublish_once(self, subject: str, data: bytes) -> None:
        """One JetStream publish as nats-py makes it (a request with its own timer), never
        retried: a reference latency for benchmarks, not for services."""
        await self.js.publish(subject, data)

    async def jpublish_pipelined(self, subject: str, data: bytes, headers: dict[str, str] | None = None
                                 ) -> asyncio.Future:
        """nats-py's asynchronous publish: the future resolves with the ack (or an error); a load
        generator's way to keep many publishes in flight. Not retried."""
        return await self.js.publish_async(subject, data, headers=headers)

    @contextlib.asynccontextmanager
    async def scratch_stream(self, name: str, subjects: list[str], max_age_s: float = 60.0,
                             max_bytes: int = 64 << 20) -> AsyncIterator[None]:
        """A memory stream that exists for the ``async with`` block (a benchmark's reference)."""
        await self.js.add_stream(api.StreamConfig(name=name, subjects=subjects, storage=api.StorageType.MEMORY,
                                                  max_age=max_age_s, max_bytes=max_bytes))
        try:
            yield
        finally:
            await self.js.delete_stream(name)

    # --- subscribing --------------------------------------------------------------------
    async def subscribe(self, subject: str, handler: Callable[..., Awaitable[None]], queue: str = "",
                        with_reply: bool = False, pending_msgs: int | None = None):
        """Core subscription; the handler gets (subject, data, headers), with ``with_reply`` also the
        message's reply subject (a JetStream delivery's is its ack subject), and must not raise."""

        async def cb(msg: Any) -> None:
            try:
                if with_reply:
                    await handler(msg.subject, msg.data, msg.headers or {}, msg.reply or "")
                else:
                    await handler(msg.subject, msg.data, msg.headers or {})
            except Exception:
                log.exception("handler for %s failed", msg.subject)

        limits = {} if pending_msgs is None else {"pending_msgs_limit": pending_msgs}
        return Subscription(await self.nc.subscribe(subject, queue=queue, cb=cb, **limits))

    def reply_key(self, tenant: str) -> str:
        """The key this connection checks ``tenant``'s workers' replies with: the one its
        credentials carry, else derived from its fence key (the services', or without
        credentials the public default: :mod:`natsched.wire.fence`)."""
        return self.reply_keys.get(tenant) or reply_key(self.fence_key, tenant)

    async def inbox(self, subject: str, *more: str, max_pending: int = 100_000) -> Inbox:
        """A subscription read with ``await sub.next_msg(timeout)`` (producers' reply streams);
        ``more`` subjects feed the same reader (a reply subject and its workers' sub-subjects)."""
        box = Mailbox(subject, max_pending)
        subs = [await self.nc.subscribe(s, cb=box.put, pending_msgs_limit=max_pending) for s in (subject, *more)]
        return Inbox(subs[0], box, subs[1:])

    # --- durable consumers --------------------------------------------------------------
    async def consume(self, spec: ConsumerSpec, handler: Handler, source: str) -> asyncio.Task:
        """Run ``handler`` on every message of a durable pull consumer until the Bus closes.

        A handler raising :class:`MessageError` (bad input) gets the message dead-lettered,
        an error reply sent when a reply subject is known, and the message terminated.
        Any other exception is a transient failure: redelivered after a delay, and
        dead-lettered once ``max_deliver`` is reached, so nothing loops or vanishes.
        """

        async def one_by_one(batch: list[Delivery]) -> None:
            for d in batch:
                if self.closing:
                    return  # left un-acked: redelivered to whoever consumes next
                try:
                    await handler(d)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    await self.settle_failed(d, spec, source, exc)

        return await self.consume_batches(spec, one_by_one, source)

    async def consume_batches(self, spec: ConsumerSpec, handler: BatchHandler, source: str) -> asyncio.Task:
        """Like :meth:`consume`, but ``handler`` gets every available message at once (up to
        ``spec.batch``), so a service can decide a batch and commit and publish it together.
        Messages the handler leaves unsettled when it raises are settled by the same rules."""
        config = api.ConsumerConfig(
            durable_name=spec.durable,
            filter_subject=spec.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=spec.ack_wait_s,
            max_deliver=spec.max_deliver,
            max_ack_pending=spec.max_ack_pending,
            deliver_policy=api.DeliverPolicy.NEW if spec.deliver_new else api.DeliverPolicy.ALL,
        )
        # binds (creating it if needed) the durable consumer; its own fetch is not used. Retried:
        # a service started while its cluster still elects stream leaders gets timeouts at first
        await self._retrying(
            lambda _remaining: self.js.pull_subscribe(spec.filter_subject or "", durable=spec.durable,
                                                      stream=spec.stream, config=config),
            BIND_BUDGET_S, f"binding consumer {spec.durable}", logging.WARNING)
        puller = Puller(self.nc, spec.stream, spec.durable, spec.batch)
        await puller.start()
        task = asyncio.create_task(self._consume_loop(puller, spec, handler, source), name=f"consume:{spec.durable}")
        self._tasks.append(task)
        return task

    async def _consume_loop(self, puller: Puller, spec: ConsumerSpec, handler: BatchHandler, source: str) -> None:
        """Pull batches and hand them to ``handler`` one after the other.

        (Handling the next batch while the previous one waits for its acks was tried twice,
        before and after admission credit: smaller batches, longer waits for their acks, and at
        1,000/s up to twice the latency; see docs/pipeline-notes.md.)
        """
        while not self.closing:
            try:
                msgs = await puller.next_batch()
            except (ConnectionClosedError, asyncio.CancelledError):
                return
            except Exception as exc:  # the connection is reconnecting: back off and ask again
                log.warning("pull on %s failed: %s", spec.durable, exc)
                await asyncio.sleep(0.5)
                continue
            if self.closing:
                return
            batch = [Delivery(m) for m in msgs]
            try:
                await handler(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                for d in batch:
                    if not d.settled:
                        try:
                            await self.settle_failed(d, spec, source, exc)
                        except Exception as again:  # one message must never stop the consumer
                            log.error("could not settle %s on %s (%r): left to redelivery", d.subject,
                                      spec.durable, again)

    async def settle_failed(self, d: Delivery, spec: ConsumerSpec, source: str, exc: Exception) -> None:
        """Bad input is dead-lettered and terminated; anything else is retried, up to max_deliver."""
        if isinstance(exc, MessageError):
            await self.dead_letter(d, source, exc.code, str(exc))
        elif d.num_delivered >= spec.max_deliver:
            log.error("giving up on %s after %d deliveries: %s", d.subject, d.num_delivered, exc)
            await self.dead_letter(d, source, "max_deliver", f"{type(exc).__name__}: {exc}")
        else:
            log.error("handler %s failed on %s (delivery %d): %r", source, d.subject, d.num_delivered, exc)
            # doubling: 1, 2, 4, 8 s by default, so a few seconds of leader election cannot use up
            # every delivery and dead-letter a request that was only unlucky
            await d.nak(delay=min(30.0, spec.redeliver_delay_s * 2 ** max(0, d.num_delivered - 1)))

    async def dead_letter(self, d: Delivery, source: str, reason: str, error: str) -> None:
        """Keep the message on ``dead.<source>``, terminate it, then tell its producer (when we know
        who that is): a producer that hears of the failure finds the message settled, not pending."""
        await self.dead_letter_raw(d.subject, d.data, source, reason, error, d.headers)
        await d.term()
        reply_to = d.headers.get(S.HDR_REPLY)
        request_id = d.headers.get(S.HDR_MSG_ID, "unknown")
        parts = d.subject.split(".")
        # req.<class>.<tenant>, adm.<pool>.<class>.<tenant>: the last token names the tenant
        tenant = parts[-1] if (parts[0], len(parts)) in (("req", 3), ("adm", 4)) else None
        if reply_to and S.reply_allowed(reply_to, tenant):  # never publish where a producer points us
            try:
                await self.publish(reply_to, Reply(request_id=request_id, kind="error", reason=reason, message=error))
            except Exception as exc:  # a reply subject nobody can publish to (e.g. with a space) is no reason to
                # keep the message: it would come back until max_deliver, and raise there again
                log.warning("dead letter %s: no error reply to %r: %r", request_id, reply_to, exc)
        log.warning("dead-lettered %s from %s: %s: %s", request_id, d.subject, reason, error)

    async def dead_letter_raw(self, subject: str, data: bytes, source: str, reason: str, error: str,
                              headers: dict[str, str] | None = None) -> None:
        """Keep bytes that came from ``subject`` on ``dead.<source>`` (cut to fit one message)."""
        record = DeadLetter(subject=subject, reason=reason, error=error, ts=time.time(),
                            data=data[: DEAD_LETTER_MAX_DATA], headers=headers or {}, by=self.name)
        await self.jpublish(S.deadletter(source), record)

    # --- KV -----------------------------------------------------------------------------
    def kv(self, bucket: str) -> KV:
        """The handle of one bucket (:mod:`natsched.bus.kv`), one per bucket and connection."""
        handle = self._kv.get(bucket)
        if handle is None:
            handle = self._kv[bucket] = KV(self, bucket)
        return handle

    #: the retry set of a compare-and-swap write (:class:`natsched.bus.kv.KV`)
    not_processed = _NOT_PROCESSED

    async def write_marker(self, subject: str, headers: dict[str, str]) -> None:
        """An empty JetStream message carrying only ``headers`` (a KV purge marker): first on the
        shared ack inbox (one of these per completion, no request timer each), sent again like
        any compare-and-swap write when nobody took it (an election)."""
        try:
            await (await (await self._ack_inbox()).publish(subject, b"", headers))
            return
        except _NOT_PROCESSED:
            pass
        await self._retrying(lambda _remaining: self.js.publish(subject, b"", headers=headers), None,
                             "KV write", logging.INFO, _NOT_PROCESSED)

    # --- streams (audit, tests) -------------------------------------------------------------
    def stream(self, name: str) -> Stream:
        """The reader of one stream (:mod:`natsched.bus.streams`)."""
        return Stream(self, name)

    async def stream_messages(self, stream: str, subject: str | None = None) -> list[tuple[str, bytes]]:
        """Every stored message of a stream (optionally one subject), oldest first.

        Reads by sequence number between the first and last sequence at the time of the call: a
        snapshot with no consumer, so nothing is delivered twice (an ordered consumer that resets
        under load can) and work-queue streams, which allow no second consumer, read the same way.
        For tests and small streams; audits read windows with :func:`natsched.audit.records.read_window`.
        """
        info = await self._read(lambda: self.js.stream_info(stream))
        if info.state.messages == 0:
            return []
        return await self._direct_messages(stream, info.state.first_seq, info.state.last_seq, subject)

    async def messages_between(self, stream: str, first: int, last: int) -> list[tuple[str, bytes]]:
        """(subject, data) of the messages stored with sequences ``first``..``last`` (gaps skipped),
        read one by one with no consumer: for short ranges (a rescue's unprocessed completions)."""
        return await self._direct_messages(stream, max(1, first), last, None)

    async def _direct_messages(self, stream: str, first: int, last: int, subject: str | None):
        out = []
        for seq in range(first, last + 1):
            try:
                raw = await self._read(lambda: self.js.get_msg(stream, seq))
            except NotFoundError:
                continue
            if subject is None or raw.subject == subject:
                out.append((raw.subject, raw.data or b""))
        return out

    async def stream_last_seq(self, stream: str) -> int:
        """The sequence of the newest message stored in ``stream`` (0 when it never held one)."""
        return (await self._read(lambda: self.js.stream_info(stream))).state.last_seq

    async def consumer_progress(self, stream: str, durable: str) -> tuple[int, int]:
        """(ack floor, last delivered): the stream sequences up to which ``durable`` has acked
        everything, and the last one it handed to a subscriber."""
        info = await self._read(lambda: self.js.consumer_info(stream, durable))
        return (info.ack_floor.stream_seq if info.ack_floor else 0,
                info.delivered.stream_seq if info.delivered else 0)

    async def consumer_backlog(self, stream: str, durable: str) -> tuple[int, int] | None:
        """(not yet delivered, delivered and not acked) of ``durable``, or None when it does not exist."""
        try:
            info = await self._read(lambda: self.js.consumer_info(stream, durable))
        except NotFoundError:
            return None
        return info.num_pending or 0, info.num_ack_pending or 0

    async def subject_counts(self, stream: str, subjects: str) -> dict[str, int]:
        """Stored messages per subject matching ``subjects`` (e.g. each worker's ``work.<id>``)."""
        info = await self._read(lambda: self.js.stream_info(stream, subjects_filter=subjects))
        return dict(info.state.subjects or {})

    async def next_message(self, stream: str, subject: str, from_seq: int) -> tuple[int, bytes] | None:
        """The first stored message on ``subject`` at or after ``from_seq``: (sequence, data), or None."""
        try:
            raw = await self._read(lambda: self.js.get_msg(stream, max(1, from_seq), subject=subject, next=True))
        except NotFoundError:
            return None
        return raw.seq, raw.data or b""

    async def delete_message(self, stream: str, seq: int) -> bool:
        """Remove one stored message; False when it was already gone (someone else removed it)."""
        try:
            return await self._read(lambda: self.js.delete_msg(stream, seq))
        except NotFoundError:
            return False
        except APIError as exc:  # "no message found" comes as a 500 with this error code
            if exc.err_code == JS_NO_MESSAGE_FOUND:
                return False
            raise

    async def _read(self, call: Callable[[], Awaitable[T]]) -> T:
        """An idempotent read, retried like a publish: in a cluster, a stream whose leader just
        died answers nothing until the election (a few seconds) is over."""
        return await self._retrying(lambda _remaining: call(), None, "read", logging.INFO)

    async def _retrying(self, call: Callable[[float], Awaitable[T]], budget_s: float | None, what: str,
                        level: int, retry_on: tuple[type[BaseException], ...] = _RETRYABLE) -> T:
        """``call(remaining_s)`` until it succeeds or the budget (default: the publish budget) is
        spent; only ``retry_on`` (timeouts and "no responders") is retried, with a doubling pause,
        and when the budget is spent it raises :class:`BusTimeout`, never nats-py's own error."""
        deadline = time.monotonic() + (budget_s if budget_s is not None else self.publish_budget_s)
        delay = 0.05
        while True:
            try:
                return await call(deadline - time.monotonic())
            except retry_on as exc:
                if time.monotonic() + delay >= deadline:  # the budget is spent: the transport's own error
                    raise BusTimeout(f"{what}: no answer within the budget ({type(exc).__name__})") from exc
                log.log(level, "%s failed (%s); retrying", what, type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task:
        """A background task that ends with the Bus."""
        task = asyncio.create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.append(task)
        return task


@dataclass(frozen=True, slots=True)
class Stored:
    """The server's acknowledgement of a JetStream publish: where the message is stored.

    ``duplicate`` means the server already held a message with this ``Nats-Msg-Id`` (someone
    else's copy: a retry that found its own first attempt is not a duplicate).
    """

    stream: str
    seq: int
    duplicate: bool = False

    @classmethod
    def of(cls, ack: api.PubAck) -> Stored:
        return cls(ack.stream, ack.seq, bool(ack.duplicate))


class _CreateRefused(Exception):
    """A create-only write found its key (jpublish_batch answers None for it)."""


@contextlib.contextmanager
def _as_bus_errors(subject: str, create_only: dict[str, str] | None = None):
    """Translate what nats-py raises for a publish into the transport's own errors."""
    try:
        yield
    except BusError:
        raise
    except APIError as exc:
        if create_only is not None and _refused_condition(exc, create_only):
            raise _CreateRefused() from exc
        raise PublishRefused(f"publish to {subject} refused: {exc.description or exc}",
                             code=exc.code, err_code=exc.err_code) from exc
    except (NatsTimeout, asyncio.TimeoutError) as exc:
        raise BusTimeout(f"publish to {subject}: no acknowledgement in time") from exc
    except NatsError as exc:
        raise PublishFailed(f"publish to {subject} failed: {type(exc).__name__}: {exc}") from exc


def _refused_condition(exc: BaseException | None, headers: dict[str, str] | None) -> bool:
    """A create-only publish (:data:`CREATE_ONLY`) refused because its subject holds a message; any
    other refused condition is an error, raised."""
    return (isinstance(exc, APIError) and exc.err_code == JS_WRONG_LAST_SEQUENCE
            and (headers or {}).get(HDR_EXPECTED_LAST_SUBJECT_SEQ) == "0")


def transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the bus failing (a server away, a timeout, a closed connection), not the
    caller's own code: services report those as ``bus_unavailable``, never as their own error."""
    return isinstance(exc, (NatsError, BusError, asyncio.TimeoutError, ConnectionError))


async def _log_error(exc: Exception) -> None:
    log.warning("nats: %s", exc)


async def _log_first_connect(exc: Exception) -> None:
    """A refused first attempt: the connect loop retries within its budget, then raises the last error."""
    log.debug("nats: %s", exc)
