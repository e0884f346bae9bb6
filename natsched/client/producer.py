"""The producer client: submit a request, get its result or stream its tokens.

The request id is the JetStream ``Nats-Msg-Id``: a publish retried after a lost ack is
stored once, and a second submission of the same id within the dedup window raises
:class:`DuplicateRequest` instead of running twice. Every wait has a timeout that says which
stage it was waiting for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from natsched.wire import chat
from natsched.wire import fence
from natsched.wire import subjects as S
from natsched.wire import msgids as M
from natsched.bus.connection import Bus
from natsched.bus.errors import BusTimeout
from natsched.client.errors import (ClientSettingsError, DuplicateRequest, Rejected, RequestError, RequestFailed,
                                    RequestTimeout)
from natsched.client.retry import Retry
from natsched import tracing
from natsched.wire.errors import DecodeError, SchemaError
from natsched.wire.ids import scoped
from natsched.wire.schema import Control, Reply, ReplyKind, ReplyStatus, Request, RequestId, TenantId, WorkerId
from natsched.bus.server import DEFAULT_URL

log = logging.getLogger(__name__)


def new_request_id() -> RequestId:
    return RequestId(uuid.uuid4().hex)


def make_request(tenant: str, prompt: str | None = None, *, cls: str = S.ONLINE, messages: list | None = None,
                 **fields: Any) -> Request:
    """A request with a fresh id (or ``id``) in ``tenant``'s scope and a creation time; keyword
    fields as in :class:`Request`.

    ``messages`` (OpenAI-style chat messages, instead of ``prompt``) are rendered by the one chat
    template (:mod:`natsched.wire.chat`), with ``system_prompt`` as a leading system message: the
    same conversation sent through the gateway or a batch file is the same text, so it hashes to
    the same prefix blocks and shares their KV cache. With ``prompt``, ``system_prompt`` and
    ``prompt`` are raw text (as ``/v1/completions``). Malformed messages raise
    :class:`~natsched.wire.errors.ChatError` (a ``ValueError``).
    """
    fields["id"] = scoped(tenant, fields.get("id") or new_request_id())  # the id it is submitted under
    if messages is not None:
        if prompt is not None:
            raise ValueError("give a prompt or messages, not both")
        fields["system_prompt"], prompt = chat.render(messages, fields.get("system_prompt"))
    return Request(tenant=TenantId(tenant), cls=cls, prompt=prompt, created=time.time(), **fields)


@dataclass
class Chunk:
    """Output produced so far: one streamed piece."""

    text: str
    token_ids: list[int] | None
    index: int


class ResultStatus(enum.StrEnum):
    """How a request ended for its producer (:attr:`Result.status`)."""

    COMPLETED = "completed"  # it ran: ``text`` is its output
    DEGRADED = "degraded"  # handed to the offline path: ``job_id`` names the job


@dataclass
class Result:
    """The final outcome of a request that ran (or was handed to the offline path)."""

    request_id: str
    status: ResultStatus
    text: str = ""
    worker: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float = 0.0
    job_id: str | None = None
    statuses: list[ReplyStatus] = field(default_factory=list)  # queued / admitted / assigned, in order
    est_wait: float | None = None  # the admitter's estimate when it queued the request (None: not queued)
    attempts: int = 1  # tries it took (more than one with a retry policy or a migration)
    migrations: int = 0  # times its stream went on from another worker after one died mid-stream


@dataclass
class Timeouts:
    """How long to wait (seconds): the stage waits, and the request's own three limits.

    The stage waits bound each wait on the bus. The limits (None: none) are the tiers a caller
    sets per request — time to first token, total, stream idle — and travel with it
    (``ttft_deadline``, ``deadline``, ``idle_timeout``), so the worker stops the run at the same
    limit even when this client is gone. A non-streaming caller sees no tokens: its TTFT limit is
    enforced by the worker alone (the failure reason is then ``ttft_timeout``).
    """

    publish: float = 10.0  # JetStream ack of the request, retries included
    admission: float = 30.0  # first status from the admitter
    queued: float = 600.0  # total wait while the admitter holds the request in its queue
    idle: float = 120.0  # between two messages once admitted (first token, next token)
    ttft: float | None = None  # submitted -> first token
    total: float | None = None  # submitted -> result (retries included): the request's deadline
    stream_idle: float | None = None  # between two tokens of a stream

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in LIMITS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ClientSettingsError(f"timeout {f.name} must be a positive number of seconds"
                                          f"{' or None' if f.name in LIMITS else ''}, got {value!r}")

    def apply(self, request: Request, now: float) -> None:
        """Put the limits on the request (an earlier deadline it already has is kept)."""
        if self.total is not None:
            request.deadline = min(request.deadline or math.inf, now + self.total)
        if self.ttft is not None:
            request.ttft_deadline = now + self.ttft
        if self.stream_idle is not None and request.stream:
            request.idle_timeout = self.stream_idle


#: the per-request limits of :class:`Timeouts` (the rest are stage waits)
LIMITS = ("ttft", "total", "stream_idle")


@dataclass
class _Progress:
    """What one exchange has learnt so far: where it runs, whether it ended."""

    worker: WorkerId | None = None
    final: bool = False
    abandoned: set[str] = field(default_factory=set)  # workers it was rescued from
    attempt: int = 0  # the newest attempt it took a worker's reply from (older ones are stale)
    est_wait: float | None = None  # the admitter's estimate, once it queued the request


#: migrations per stream by default: a second death of the same stream is rare, a third is a pattern
MIGRATIONS = 2


class Stream:
    """``async for chunk in stream`` yields :class:`Chunk`; afterwards ``stream.result`` is set.

    Leaving the loop early (``break``, an exception, a cancelled task) cancels the request on
    its worker: nobody reads the rest, so the engine stops generating it.
    """

    def __init__(self, client: "Client", request: Request, timeouts: Timeouts | None = None,
                 retry: Retry | None = None) -> None:
        self._client = client
        self._request = request
        self._timeouts = timeouts
        self._retry = retry
        self._progress = _Progress()
        self.result: Result | None = None
        self.produced = 0  # tokens yielded so far (what a consumer that leaves early has been given)

    @property
    def est_wait(self) -> float | None:
        """The admitter's estimated wait, once it queued the request (None: not queued)."""
        return self._progress.est_wait

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._run()

    async def _run(self) -> AsyncIterator[Chunk]:
        attempts = self._client._attempts(self._request, self._timeouts, self._retry, self)
        try:
            async for item in attempts:
                if isinstance(item, Chunk):
                    self.produced += len(item.token_ids) if item.token_ids else int(bool(item.text))
                    yield item
                else:
                    self.result = item
        finally:  # closed at a yield (the consumer stopped): end the exchange now, not at GC
            await attempts.aclose()


class Client:
    """Submit requests to natsched over an existing :class:`Bus` (or one it connects)."""

    def __init__(self, bus: Bus, timeouts: Timeouts | None = None, retry: Retry | None = None,
                 migrations: int = MIGRATIONS) -> None:
        self.bus = bus
        self.timeouts = timeouts or Timeouts()
        self.retry = retry  # the default policy of submit/stream (None: one try)
        if not isinstance(migrations, int) or isinstance(migrations, bool) or migrations < 0:
            raise ClientSettingsError(f"migrations must be an integer >= 0, got {migrations!r}")
        #: a stream whose worker dies mid-stream goes on from another worker this many times (0: it
        #: fails with ``worker_lost``, as a stream that cannot be continued does)
        self.migrations = migrations
        #: workers' replies not taken, by reason (natsched.wire.fence.reply_problem): forged,
        #: misattributed or stale output never reaches the caller
        self.refused_replies: dict[str, int] = {}

    @classmethod
    async def connect(cls, url: str = DEFAULT_URL, timeouts: Timeouts | None = None, **kw: Any) -> "Client":
        return cls(await Bus.connect(url, name="natsched-producer", **kw), timeouts)

    async def close(self) -> None:
        await self.bus.close()

    async def submit(self, request: Request, *, timeouts: Timeouts | None = None,
                     retry: Retry | None = None) -> Result:
        """Publish and wait for the final result (raises Rejected / RequestFailed / RequestTimeout).

        ``timeouts`` (default: the client's) and ``retry`` (default: the client's; None: one try)
        are this request's: see :class:`Timeouts` and :class:`~natsched.client.retry.Retry`.
        """
        result = None
        async for item in self._attempts(request, timeouts, retry):
            if isinstance(item, Result):
                result = item
        assert result is not None
        return result

    def stream(self, request: Request, *, timeouts: Timeouts | None = None, retry: Retry | None = None) -> Stream:
        """Like :meth:`submit`, streaming output chunks as the worker produces them. A retry
        policy retries a stream that already yielded output only with ``after_output``."""
        request.stream = True
        return Stream(self, request, timeouts, retry)

    async def _attempts(self, request: Request, timeouts: Timeouts | None, retry: Retry | None,
                        stream: Stream | None = None) -> AsyncIterator[Chunk | Result]:
        """The exchange, tried again under ``retry`` after an outcome a retry can change, each try
        under a fresh id (``<id>-r<n>``: every stage dedups on the id), never past the deadline.
        A stream whose worker died after output went out is *migrated* first (:class:`Migration`):
        the next try continues after the output its consumer has."""
        timeouts = timeouts or self.timeouts
        retry = retry if retry is not None else self.retry
        timeouts.apply(request, time.time())
        attempt, current = 1, request
        moved = Migration(request, self.migrations if stream is not None else 0)
        while True:
            progress = stream._progress if stream is not None else _Progress()
            produced = False
            exchange = self._exchange(current, timeouts, progress)
            moved.begin()
            try:
                async for item in exchange:
                    produced = produced or isinstance(item, Chunk)
                    if isinstance(item, Result):
                        item.attempts = attempt
                    yield moved.took(item)
                return
            except RequestError as exc:
                if moved.migrates(exc):
                    wait = 0.0  # the worker died, not an overload: go on at once
                    log.info("request %s: %s; its stream goes on after %d tokens (try %d)", current.id, exc,
                             len(moved.token_ids), attempt + 1)
                else:
                    # a continuation refused before new output is tried again as one: nothing is repeated
                    again = moved.migrations > 0 and not produced
                    wait = retry.next_delay(exc, attempt, moved.chunks > 0 and not again, time.time(),
                                            current.deadline) if retry else None
                    if wait is None:
                        raise
                    log.info("request %s: %s; try %d in %.2fs", current.id, exc, attempt + 1, wait)
                    if not again:
                        moved.restart()
            finally:  # closed at a yield (the consumer stopped): end the exchange now, not at GC
                await exchange.aclose()
            await asyncio.sleep(wait)
            current = moved.request(_next_try(request, attempt))
            attempt += 1
            if stream is not None:
                stream._progress = _Progress()
            if current.ttft_deadline is not None and timeouts.ttft is not None:
                current.ttft_deadline = time.time() + timeouts.ttft  # each try gets its own first-token wait

    async def cancel(self, tenant: str, request_id: str) -> None:
        """Give up on a request of ``tenant``, wherever it is: queued in an admitter, admitted and
        waiting for a router, or running on its worker (``cancel.<tenant>.<request_id>``; each of
        them ends it and a reservation it holds is released with reason ``cancelled``)."""
        request_id = scoped(tenant, request_id)  # the id it was submitted under (idempotent)
        await self.bus.publish(S.cancel(TenantId(tenant), request_id),
                               Control(kind="cancel", ts=time.time(), by=self.bus.name, request_id=request_id))

    async def _exchange(self, request: Request, timeouts: Timeouts | None = None,
                        progress: _Progress | None = None) -> AsyncIterator[Chunk | Result]:
        timeouts = timeouts or self.timeouts
        # in its tenant's scope (natsched.wire.ids.scoped): another tenant's "same" id is another id
        request.id = scoped(request.tenant, request.id)
        reply_to = request.reply or S.tenant_reply(request.tenant, request.id)
        request.reply = reply_to
        request.created = request.created or time.time()
        # the workers answer on <reply>.<worker> (natsched.wire.subjects.worker_reply)
        workers = (f"{reply_to}.*",) if _fenced(reply_to) else ()
        sub = await self.bus.inbox(reply_to, *workers)
        progress = progress if progress is not None else _Progress()
        duplicate = False
        try:
            ack = await self.bus.jpublish(
                S.request(request.cls, request.tenant),
                request,
                msg_id=M.submission(request.id, self.bus.reply_key(request.tenant)),
                headers=tracing.carry(tracing.current.get(), {S.HDR_REPLY: reply_to}),
                budget_s=timeouts.publish,
            )
            if ack.duplicate:
                duplicate = True
                raise DuplicateRequest(
                    f"request {request.id} was already submitted within the dedup window; "
                    "it runs once and its result went to the first submitter",
                    request.id,
                )
            async for item in self._replies(sub, request, progress, timeouts):
                yield item
        finally:
            # shielded: a canceller that cancels again (natsched.bus.aio.cancel_and_wait) must not
            # cut the cancel short. A duplicate is the first submitter's request, not ours to cancel
            await asyncio.shield(self._close(sub, request, cancel=not duplicate and not progress.final))

    async def _close(self, sub: Any, request: Request, cancel: bool) -> None:
        """End an exchange: stop listening and, if it ended before its final reply (even with a
        publish whose ack was lost: it may be stored), cancel it in whatever state it is."""
        if cancel:  # first: every token generated meanwhile is for nobody
            try:
                await self.cancel(request.tenant, request.id)
            except Exception as exc:  # best effort: the connection may be gone already
                log.warning("could not cancel %s: %s", request.id, exc)
        try:
            await sub.unsubscribe()
        except Exception as exc:  # the connection may be gone already
            log.warning("could not unsubscribe from %s: %s", request.reply, exc)

    def _taken(self, request: Request, subject: str, reply: Reply, progress: _Progress) -> bool:
        """Whether ``reply`` (on ``subject``) may be taken as news of ``request``: output only from
        the worker an assignment of it was signed for, on that worker's own sub-subject; anything
        else is refused, counted and logged, and never reaches the caller."""
        if not request.reply or not _fenced(request.reply):
            return True  # a job's or a benchmark's reply subject: read by services, not fenced here
        source = S.reply_source(subject, request.reply)
        why = fence.reply_problem(self.bus.reply_key(request.tenant), reply, source, request.id, progress.attempt,
                                  progress.abandoned)
        if why is None:
            if source is not None:
                progress.attempt = max(progress.attempt, reply.attempt or 0)
            return True
        self.refused_replies[why] = self.refused_replies.get(why, 0) + 1
        log.warning("request %s: a %s reply from %s refused (%s): not from the worker it was assigned to",
                    request.id, reply.kind, source or "the services' subject", why)
        return False

    async def _replies(self, sub: Any, request: Request, progress: _Progress,
                       timeouts: Timeouts) -> AsyncIterator[Chunk | Result]:
        started = time.monotonic()
        statuses: list[str] = []
        texts: list[str] = []
        wait, stage, reason = timeouts.admission, "admission decision (is an admitter running?)", "admission"
        while True:
            left, why, what = _binding_wait(request, bool(texts), wait, reason, stage)
            try:
                if left <= 0:
                    raise BusTimeout("limit already passed")
                msg = await sub.next_msg(timeout=left)
            except BusTimeout:
                raise RequestTimeout(f"request {request.id}: no {what} within {max(left, 0):.3g}s", request.id,
                                     why) from None
            try:
                reply = Reply.decode(msg.data)
            except (DecodeError, SchemaError):
                continue  # not ours to interpret; a stray message on the reply subject
            if not self._taken(request, msg.subject, reply, progress):
                continue
            if reply.kind == ReplyKind.STATUS and reply.status == ReplyStatus.REROUTED:
                _rerouted(request, reply, progress, texts)
                statuses.append(ReplyStatus.REROUTED)
                continue
            if reply.worker and reply.worker in progress.abandoned:
                continue  # a worker declared dead that was only slow: its re-run elsewhere counts
            if reply.final:
                progress.final = True
            if reply.worker:  # "assigned" names it; so does every token (which may overtake "assigned")
                progress.worker = reply.worker
            if reply.kind == ReplyKind.STATUS:
                if reply.status is not None:
                    statuses.append(reply.status)
                if reply.status == ReplyStatus.DEGRADED:
                    progress.final = True  # the offline path owns it now: leaving cancels nothing
                    yield Result(request.id, ResultStatus.DEGRADED, job_id=reply.job_id, statuses=statuses,
                                 e2e=time.monotonic() - started, est_wait=progress.est_wait)
                    return
                if reply.status == ReplyStatus.QUEUED:
                    progress.est_wait = reply.est_wait
                    wait, stage, reason = timeouts.queued, "dequeue from the admission queue", "queued"
                else:
                    wait, stage, reason = timeouts.idle, "progress from the router or worker", "idle"
            elif reply.kind == ReplyKind.TOKEN:
                texts.append(reply.text or "")
                yield Chunk(reply.text or "", reply.token_ids, reply.index or 0)
            elif reply.kind == ReplyKind.ERROR:
                _raise_error(request.id, reply)
            elif reply.kind == ReplyKind.RESULT:
                yield Result(
                    request_id=request.id,
                    status=ResultStatus.COMPLETED,
                    text=reply.text if reply.text is not None else "".join(texts),
                    worker=reply.worker,
                    finish_reason=reply.finish_reason,
                    prompt_tokens=reply.prompt_tokens or 0,
                    cached_tokens=reply.cached_tokens or 0,
                    output_tokens=reply.output_tokens or 0,
                    ttft=reply.ttft,
                    tpot=reply.tpot,
                    e2e=time.monotonic() - started,
                    statuses=statuses,
                    est_wait=progress.est_wait,
                )
                return


class Migration:
    """A stream's output so far, so that another worker can go on after it when its worker dies.

    Why: on ``rerouted`` (its worker died, the admitter re-admitted it) a stream that had output
    cannot start over: the consumer has the tokens, and a fresh run would not repeat them. With
    every token id of it in hand, the next try carries them (``Request.resume_token_ids``): the
    worker runs prompt + output so far and generates the rest, and the consumer's stream goes on
    (chunk indexes continue, the result covers the whole stream). A chunk without token ids or a
    gap in the chunk indexes (a lost core-NATS reply) leaves the output unknown: then it fails
    with ``worker_lost`` as before, and a retry policy decides.
    """

    def __init__(self, request: Request, limit: int) -> None:
        self.original = request
        self.limit = limit
        self.migrations = 0
        self.token_ids: list[int] = []  # every output token id the consumer has
        self.texts: list[str] = []
        self.chunks = 0  # chunks yielded: the next one's index
        self._base = 0  # output tokens the current try continues after
        self._next_index = 0  # the index the current try's next chunk must have
        self._whole = True

    def begin(self) -> None:
        self._base, self._next_index, self._whole = len(self.token_ids), 0, True

    def took(self, item: "Chunk | Result") -> "Chunk | Result":
        """``item`` as the consumer sees it: indexes and the result over the whole stream."""
        if isinstance(item, Chunk):
            if self.limit:  # kept only for a stream that may migrate
                if item.token_ids and item.index == self._next_index:
                    self.token_ids += item.token_ids
                else:
                    self._whole = False
                self._next_index = item.index + 1
                self.texts.append(item.text)
            self.chunks += 1
            return Chunk(item.text, item.token_ids, self.chunks - 1)
        if self.migrations and item.status == ResultStatus.COMPLETED:
            # the worker counted the output it went on after as prompt, and generated the rest
            item.text = "".join(self.texts)
            item.prompt_tokens = max(0, item.prompt_tokens - self._base)
            item.cached_tokens = min(item.cached_tokens, item.prompt_tokens)
            item.output_tokens += self._base
        item.migrations = self.migrations
        return item

    def migrates(self, exc: Exception) -> bool:
        """Whether another worker can continue the stream ``exc`` ended; if so, it is counted and
        the next :meth:`request` carries the output so far."""
        if not (isinstance(exc, RequestFailed) and exc.reason == "worker_lost" and self._whole and self.token_ids
                and self.migrations < self.limit and len(self.token_ids) < self.original.max_tokens):
            return False
        self.migrations += 1
        return True

    def restart(self) -> None:
        """A retry starts over (``Retry.after_output``): the consumer sees the output again."""
        self.token_ids, self.texts, self.chunks, self.migrations = [], [], 0, 0

    def request(self, next_try: Request) -> Request:
        """The next try, continuing after the output so far (when it is a migration)."""
        if self.migrations:
            next_try.resume_token_ids = list(self.token_ids)
        return next_try


def _fenced(reply_to: str) -> bool:
    """Whether workers answer ``reply_to`` on their own sub-subjects (``resp.`` replies)."""
    return S.worker_reply(reply_to, "w") != reply_to


def _binding_wait(request: Request, got_token: bool, wait: float, reason: str,
                  stage: str) -> tuple[float, str, str]:
    """(seconds, reason, what was awaited) of the wait that ends first: the stage's or a limit."""
    now = time.time()
    waits = [(wait, reason, stage)]
    if request.deadline is not None:
        waits.append((request.deadline - now, "total", "result before the request's total limit"))
    if request.stream and not got_token and request.ttft_deadline is not None:
        waits.append((request.ttft_deadline - now, "ttft", "first token within the TTFT limit"))
    if got_token and request.idle_timeout is not None:
        waits.append((request.idle_timeout, "stream_idle", "next token within the stream-idle limit"))
    return min(waits, key=lambda w: w[0])


def _next_try(request: Request, tries: int) -> Request:
    """The request again under a fresh id (``<id>-r<n>``) and its own reply subject."""
    rid = RequestId(f"{request.id}-r{tries}")
    own_reply = request.reply in (None, S.tenant_reply(request.tenant, request.id))
    return dataclasses.replace(request, id=rid, reply=None if own_reply else request.reply)


def _rerouted(request: Request, reply: Reply, progress: "_Progress", texts: list[str]) -> None:
    """Its worker died and the admitter re-admitted it: start over, unless output was streamed.

    Tokens already handed to a streaming consumer cannot be taken back, so a stream that had
    output fails with ``worker_lost`` (the producer decides whether to retry); otherwise the
    re-run is invisible apart from the ``rerouted`` status.
    """
    if reply.worker:
        progress.abandoned.add(reply.worker)
    progress.worker = None
    if texts and request.stream:
        raise RequestFailed(f"request {request.id} failed: worker_lost: worker {reply.worker} died mid-stream; "
                            "the output so far is incomplete", request.id, "worker_lost")
    texts.clear()


def _raise_error(request_id: str, reply: Reply) -> None:
    reason = reply.reason or "error"
    message = f"request {request_id} {reply.status or 'failed'}: {reason}" + (
        f": {reply.message}" if reply.message else ""
    )
    if reply.status == ReplyStatus.REJECTED or reply.retry_after is not None:
        raise Rejected(message, request_id, reason, reply.retry_after)
    raise RequestFailed(message, request_id, reason)
