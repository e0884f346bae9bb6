"""The gateway's request path: key -> tenant, body -> Request, bus outcome -> HTTP answer.

Thin on purpose: parsing and templates are pure (:mod:`natsched.gateway.protocol`, :mod:`natsched.wire.chat`),
admission is the admitter's and routing the router's. What is decided here is only how long
to wait and what each outcome means in HTTP:

=====================================  ======  ==========================================
outcome on the bus                     status  body / headers
=====================================  ======  ==========================================
result                                 200     completion (or SSE chunks, then [DONE])
degraded to the offline path           422     ``code: degraded_to_job``, ``job_id``, ``Location``
                                               (``GET /v1/natsched/jobs/{id}`` has its result)
rejected with ``retry_after``          429     ``Retry-After`` (quota, tenant cap, queue)
rejected, never admissible as sent     400     the admitter's reason as ``code``
rejected: ``unknown_tenant``           403
failed: ``no_worker`` / no healthy     503     ``Retry-After``
worker serves the model
failed: ``prompt_too_long``, invalid   400
failed: engine error                   502
a time limit passed (TTFT, total,      504     ``code``: ``ttft_timeout``, ``timeout``,
stream idle)                                   ``idle_timeout`` (the request is cancelled)
already submitted (same id)            409
bus unreachable                        503
=====================================  ======  ==========================================

The wait: a request may stay queued as long as the client waits — the ``x-natsched-timeout``
header, else the OpenAI SDK's ``x-stainless-read-timeout``, capped by ``max_wait_s`` — and its
``deadline`` is set to the end of that wait, so a request nobody waits for any more is dropped
by the admitter or the worker instead of run. Beside it, ``x-natsched-ttft-timeout`` and
``x-natsched-stream-idle-timeout`` (else the ``ttft_timeout_s``/``stream_idle_timeout_s`` settings) set the
other two tiers; all three travel with the request, so its worker stops it at the same limits.

Why a degraded request is an error answer and not a 202 job object: OpenAI clients parse every
2xx as the completion they asked for (the SDK made a ``ChatCompletion`` with ``choices=None``
out of it, and ordinary code crashed). 422 is not retried by the SDK (nor by the common retry
libraries; ``x-should-retry: false`` says so too): a retry would start a second job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import orjson

from natsched.bus.metrics import watch as watch_bus
from natsched.client.batch import JobStore
from natsched.wire import subjects as S
from natsched.client.producer import MIGRATIONS, Chunk, Client, Result, ResultStatus, Timeouts
from natsched.wire.blocks import estimate_prompt_tokens
from natsched.errors import NatschedError
from natsched.client.errors import DuplicateRequest, Rejected, RequestError, RequestFailed, RequestTimeout
from natsched.wire.schema import Request, RequestId, TenantId
from natsched.gateway import protocol as P
from natsched.gateway.errors import (ApiError, BadRequest, ConfigError, Conflict, Degraded, Forbidden, GatewayTimeout,
                                    NotFound, RateLimited, Unavailable, Upstream)
from natsched.gateway.keys import KeyRing, Principal
from natsched.gateway.metrics import GatewayMetrics
from natsched.gateway.status import StatusCollector

log = logging.getLogger(__name__)

TIMEOUT_HEADERS = ("x-natsched-timeout", "x-stainless-read-timeout")
TTFT_HEADER, IDLE_HEADER = "x-natsched-ttft-timeout", "x-natsched-stream-idle-timeout"
QUEUE_WAIT_HEADER = "x-natsched-queue-wait"  # the admitter's estimate for a request it queued (s)
JOBS_PATH = "/v1/natsched/jobs/"
#: a limit that ran out -> its error code and its cancelled-metric reason
TIMEOUT_CODES = {"total": "timeout", "ttft": "ttft_timeout", "stream_idle": "idle_timeout",
                 "deadline_exceeded": "timeout", "ttft_timeout": "ttft_timeout", "idle_timeout": "idle_timeout"}


@dataclass
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 768 * 1024  # a request must still fit one 1 MiB bus message
    default_max_tokens: int = 128
    max_tokens_limit: int = 32768
    max_wait_s: float = 600.0  # the longest any request is held (queued + running), whatever the client says
    min_wait_s: float = 1.0
    ttft_timeout_s: float | None = None  # first token within this, unless the x-natsched-ttft-timeout header says
    stream_idle_timeout_s: float | None = None  # next token of a stream within this (x-natsched-stream-idle-timeout)
    keepalive_s: float = 15.0  # an SSE comment on a stream quiet this long (proxies drop idle connections)
    no_worker_retry_after_s: float = 5.0
    models: tuple[str, ...] = ()  # announced before any worker says it serves them
    status_page: bool = True  # /status and /status.json (and following DECISIONS / COMPLETIONS for them)
    status_refresh_s: float = 2.0
    metrics_port: int | None = None
    name: str = "gateway"
    # --- the edge: what a connection may cost before it is a call (docs/gateway.md "Edge limits")
    max_connections: int = 1024  # open sockets; one more is answered 503 and closed as it is accepted
    header_timeout_s: float = 10.0  # connection (or a request's first byte) -> end of headers, else 408
    body_timeout_s: float = 30.0  # end of headers -> end of body, else 408
    idle_timeout_s: float = 5.0  # a kept-alive connection with no request is closed after this
    max_header_bytes: int = 32 * 1024  # request line and headers (431 above)
    max_per_key: int = 64  # inference calls in flight per API key (429 above; the open tenant is one key)
    max_prompt_token_ids: int = 131072  # token ids in one prompt (400 above)
    allowed_hosts: tuple[str, ...] = ()  # open mode: Host names accepted besides loopback and --host ("*": any)
    allowed_origins: tuple[str, ...] = ()  # open mode: browser origins that may call (besides the gateway's own)
    #: a stream whose worker dies goes on from another worker this many times (0: the stream ends
    #: with an error, as before); natsched.client.producer.Migration
    stream_migrations: int = MIGRATIONS

    def __post_init__(self) -> None:
        m = self.stream_migrations
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ConfigError(f"gateway setting stream_migrations must be an integer >= 0, got {m!r}")
        for name in ("max_wait_s", "min_wait_s", "keepalive_s", "ttft_timeout_s", "stream_idle_timeout_s"):
            value = getattr(self, name)
            if value is None and name in ("ttft_timeout_s", "stream_idle_timeout_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"gateway setting {name} must be a positive number of seconds, got {value!r}")


@dataclass
class Call:
    """One inference call in flight: who, what, when, and the bus request it became."""

    principal: Principal
    inference: P.Inference
    request: Request
    received: float  # monotonic
    created: int  # unix seconds, for the response bodies
    timeout_s: float
    endpoint: str
    timeouts: Timeouts | None = None  # the client's stage waits with this call's three limits


class Gateway:
    def __init__(self, client: Client, keys: KeyRing, settings: GatewaySettings | None = None,
                 metrics: GatewayMetrics | None = None, status: StatusCollector | None = None) -> None:
        self.client = client
        self.keys = keys
        self.settings = settings or GatewaySettings()
        self.metrics = metrics or GatewayMetrics()
        watch_bus(self.metrics.registry, client.bus)  # its records lost, reconnects (natsched.bus.metrics)
        self.status = status or StatusCollector(client.bus, follow_records=self.settings.status_page)
        self.jobs = JobStore(client.bus)
        self._in_flight: dict[str, int] = {}  # per API key (Principal.key): calls being answered

    # --- per-key concurrency ----------------------------------------------------------------
    def take_slot(self, principal: Principal) -> None:
        """Count one call of ``principal``'s key in flight, or refuse it (429) at the limit: before
        the body is read, so a key at its limit costs no parsing and no bus round trip."""
        n = self._in_flight.get(principal.key, 0)
        if n >= self.settings.max_per_key:
            self.metrics.shed.labels("per_key").inc()
            raise RateLimited(f"this API key has {n} requests in flight, its limit; retry when one has ended",
                              code="too_many_concurrent_requests", retry_after=1)
        self._in_flight[principal.key] = n + 1

    def give_slot(self, principal: Principal) -> None:
        n = self._in_flight.get(principal.key, 0) - 1
        if n > 0:
            self._in_flight[principal.key] = n
        else:
            self._in_flight.pop(principal.key, None)

    async def start(self) -> None:
        await self.status.start()

    # --- models and health ----------------------------------------------------------------
    def models(self) -> dict[str, bool]:
        live = self.status.state.models(time.time())
        return {**{m: False for m in self.settings.models}, **live}

    def model_cards(self) -> dict[str, dict]:
        return self.status.state.model_cards()

    def check_model(self, model: str) -> None:
        models = self.models()
        if model in models:
            if not models[model]:
                raise Unavailable(f"no healthy worker serves model {model!r} right now", code="no_healthy_worker",
                                  retry_after=self.settings.no_worker_retry_after_s)
            return
        if not models:
            raise Unavailable("no worker is serving yet", code="no_healthy_worker",
                              retry_after=self.settings.no_worker_retry_after_s)
        raise NotFound(f"model {model!r} is not served here; GET /v1/models lists the served models",
                       code="model_not_found", param="model")

    # --- jobs -------------------------------------------------------------------------------
    async def find_job(self, job_id: str, tenant: str) -> Any:
        """The job record of ``job_id`` if it is ``tenant``'s (another tenant's is not found either)."""
        try:
            S.token(job_id, "job id")
        except ValueError as exc:
            raise BadRequest(str(exc), code="invalid_job_id", param="job_id") from None
        try:
            found = await self.jobs.find(job_id, tenant)
        except NatschedError as exc:
            raise bus_unavailable(exc) from None
        if found is None:
            raise NotFound(f"no job {job_id} of this key's tenant", code="job_not_found", param="job_id")
        return found[1]

    # --- building the call ----------------------------------------------------------------
    def timeout(self, headers: Any) -> float:
        for name in TIMEOUT_HEADERS:
            value = _seconds(headers, name)
            if value is not None:
                return max(self.settings.min_wait_s, min(value, self.settings.max_wait_s))
        return self.settings.max_wait_s

    def timeouts(self, headers: Any, total_s: float) -> Timeouts:
        """The client's stage waits with this call's three limits (headers over settings)."""
        ttft = _seconds(headers, TTFT_HEADER) or self.settings.ttft_timeout_s
        idle = _seconds(headers, IDLE_HEADER) or self.settings.stream_idle_timeout_s
        return dataclasses.replace(self.client.timeouts, total=total_s, ttft=None if ttft is None else min(ttft, total_s),
                                   stream_idle=idle)

    def call(self, principal: Principal, cls: str, inf: P.Inference, request_id: str, timeout_s: float,
             endpoint: str) -> Call:
        now = time.time()
        request = Request(id=RequestId(request_id), tenant=TenantId(principal.tenant), cls=cls, model=inf.model,
                          prompt=inf.prompt, prompt_token_ids=inf.prompt_token_ids, system_prompt=inf.system_prompt,
                          max_tokens=inf.max_tokens, deadline=now + timeout_s, created=now, stream=inf.stream)
        return Call(principal, inf, request, time.monotonic(), int(now), timeout_s, endpoint)

    def limit(self, call: Call, headers: Any) -> Call:
        call.timeouts = self.timeouts(headers, call.timeout_s)
        return call

    # --- non-streaming ------------------------------------------------------------------------
    async def complete(self, call: Call) -> tuple[int, dict[str, Any], float | None]:
        """(status, body, estimated queue wait) of a non-streaming call; raises ApiError."""
        try:
            async with asyncio.timeout(call.timeout_s + BACKSTOP_S):  # the client's own limits end it first
                result = await self.client.submit(call.request, timeouts=call.timeouts)
        except TimeoutError:
            self.metrics.cancelled.labels("timeout").inc()
            raise GatewayTimeout(f"no result within {call.timeout_s:g}s (the client's timeout); the request was "
                                 "cancelled", code="timeout") from None
        except RequestError as exc:
            raise self._error(exc) from None
        except NatschedError as exc:
            raise bus_unavailable(exc) from None
        return (*self._final(call, result), result.est_wait)

    def _error(self, exc: RequestError) -> ApiError:
        err = api_error(exc, self.settings)
        if isinstance(err, GatewayTimeout):
            self.metrics.cancelled.labels(err.code or "timeout").inc()
        return err

    def _final(self, call: Call, result: Result) -> tuple[int, dict[str, Any]]:
        if result.status == ResultStatus.DEGRADED:
            raise degraded(call, result)
        self._observe(call, result)
        return 200, P.response_body(call.inference, call.request.id, call.created, result.text,
                                    result.finish_reason, result.prompt_tokens, result.output_tokens,
                                    result.cached_tokens, result.worker)

    def _observe(self, call: Call, result: Result) -> None:
        m, tenant = self.metrics, call.principal.tenant
        m.tokens.labels(tenant, "prompt").inc(result.prompt_tokens)
        m.tokens.labels(tenant, "cached").inc(result.cached_tokens)
        m.tokens.labels(tenant, "output").inc(result.output_tokens)
        if result.migrations:
            m.migrations.labels(tenant).inc(result.migrations)
        if result.tpot is not None:
            m.tpot.labels(call.endpoint).observe(result.tpot)

    # --- streaming ------------------------------------------------------------------------------
    async def open_stream(self, call: Call) -> tuple[Chunk | Result, AsyncIterator[Chunk | Result], Any]:
        """Start a streaming call and wait (up to the client's timeout) for its first event.

        Errors before the first token are raised here, so they still become a proper HTTP status.
        """
        stream = self.client.stream(call.request, timeouts=call.timeouts)
        events = _events(stream)
        try:
            async with asyncio.timeout(call.timeout_s + BACKSTOP_S):  # the client's own limits end it first
                first = await events.__anext__()
        except TimeoutError:
            await events.aclose()
            self.metrics.cancelled.labels("timeout").inc()
            raise GatewayTimeout(f"no first token within {call.timeout_s:g}s (the client's timeout); the request "
                                 "was cancelled", code="timeout") from None
        except RequestError as exc:
            await events.aclose()
            raise self._error(exc) from None
        except NatschedError as exc:
            await events.aclose()
            raise bus_unavailable(exc) from None
        except BaseException:
            await events.aclose()
            raise
        if isinstance(first, Result) and first.status == ResultStatus.DEGRADED:
            await events.aclose()
            raise degraded(call, first)
        self.metrics.ttft.labels(call.endpoint).observe(time.monotonic() - call.received)
        return first, events, stream

    async def sse(self, call: Call, first: Chunk | Result, events: AsyncIterator[Chunk | Result]) -> AsyncIterator[bytes]:
        """The SSE body: chunks, the finish chunk, usage (when asked), ``[DONE]``; an error event on
        failure; a comment line (``: keep-alive``) whenever the stream is quiet for ``keepalive_s``.

        A stream that ends before its result (the client left, a limit, a failure) is metered with
        the tokens it really sent, and the prompt the worker prefilled for them.
        """
        inf, rid, created = call.inference, call.request.id, call.created
        item: Chunk | Result | None = first
        sent_first = False
        sent_tokens = 0
        completed = False
        quiet = with_keepalive(events, self.settings.keepalive_s)
        try:
            while item is not None:
                if item is KEEPALIVE:
                    self.metrics.keepalives.inc()
                    yield b": keep-alive\n\n"
                elif isinstance(item, Chunk):
                    yield _data(P.chunk(inf, rid, created, item.text, first=not sent_first))
                    sent_first = True
                    sent_tokens += len(item.token_ids) if item.token_ids else int(bool(item.text))
                else:
                    completed = True
                    if not sent_first:
                        yield _data(P.chunk(inf, rid, created, "", first=True))
                    self._observe(call, item)
                    yield _data(P.chunk(inf, rid, created, reason=item.finish_reason or "stop"))
                    if inf.include_usage:
                        yield _data(P.chunk(inf, rid, created, usage_body=P.usage(
                            item.prompt_tokens, item.output_tokens, item.cached_tokens)))
                    yield b"data: [DONE]\n\n"
                    return
                try:
                    item = await quiet.__anext__()
                except StopAsyncIteration:
                    item = None
        except RequestError as exc:  # after the first token: the status is sent, say it in the stream
            yield _data(self._error(exc).body())
        except NatschedError as exc:
            yield _data(bus_unavailable(exc).body())
        finally:
            await quiet.aclose()
            await events.aclose()
            if not completed and sent_tokens:
                self._meter_partial(call, sent_tokens)

    def _meter_partial(self, call: Call, output_tokens: int) -> None:
        """A stream that ended early: the output it sent, and its prompt (prefilled to make it),
        counted as the worker counts them (its completion has the same numbers for the audit)."""
        tenant = call.principal.tenant
        self.metrics.tokens.labels(tenant, "prompt").inc(estimate_prompt_tokens(call.request))
        self.metrics.tokens.labels(tenant, "output").inc(output_tokens)
        log.info("request %s ended early after %d streamed tokens (metered)", call.request.id, output_tokens)


#: the gateway's own wait on the client is this much longer than the call's limit: the client's
#: limits (which cancel on the worker and say which limit it was) end the call first
BACKSTOP_S = 1.0
KEEPALIVE = object()  # what with_keepalive yields when the stream was quiet


async def with_keepalive(events: AsyncIterator[Any], every_s: float) -> AsyncIterator[Any]:
    """``events``, with :data:`KEEPALIVE` whenever none came for ``every_s``; the pending
    ``__anext__`` is kept (not cancelled), so no event is lost."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield KEEPALIVE
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)


def degraded(call: Call, result: Result) -> Degraded:
    """The answer for a request the admitter moved to the offline path: its job, and where to ask."""
    job = result.job_id or call.request.id
    return Degraded(f"request {call.request.id} was moved to the offline path as job {job}; GET "
                    f"{JOBS_PATH}{job} returns its result when it is done", code="degraded_to_job", job_id=job,
                    location=JOBS_PATH + job)


def _seconds(headers: Any, name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"header {name} must be a number of seconds, got {raw!r}", code="invalid_timeout",
                         param=name) from None
    if not math.isfinite(value) or value <= 0:
        raise BadRequest(f"header {name} must be a positive number of seconds", code="invalid_timeout", param=name)
    return value


async def _events(stream: Any) -> AsyncIterator[Chunk | Result]:
    """A stream's chunks, then its Result: one sequence the SSE writer can pull from."""
    inner = stream.__aiter__()
    try:
        async for chunk in inner:
            yield chunk
        if stream.result is not None:
            yield stream.result
    finally:
        await inner.aclose()


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# --- outcome -> HTTP ------------------------------------------------------------------------

_BAD_FAILURES = {"prompt_too_long", "invalid_request", "invalid", "invalid_max_tokens"}


def api_error(exc: RequestError, settings: GatewaySettings) -> ApiError:
    """What a bus outcome that is not a result means for the HTTP client."""
    if isinstance(exc, Rejected):
        message = str(exc)
        if exc.reason == "unknown_tenant":
            return Forbidden(message, code=exc.reason)
        if exc.reason == "deadline_exceeded":
            return GatewayTimeout(message, code=exc.reason)
        if exc.reason in ("unknown_model", "no_pool"):  # no worker serves it / no router pool routes it
            return NotFound(message, code="model_not_found", param="model")
        if exc.retry_after is not None:
            return RateLimited(message, code=exc.reason, retry_after=exc.retry_after)
        return BadRequest(message, code=exc.reason)
    if isinstance(exc, RequestFailed):
        if exc.reason == "no_worker":
            return Unavailable(str(exc), code=exc.reason, retry_after=settings.no_worker_retry_after_s)
        if exc.reason in _BAD_FAILURES:
            return BadRequest(str(exc), code=exc.reason)
        if exc.reason in TIMEOUT_CODES:
            return GatewayTimeout(str(exc), code=TIMEOUT_CODES[exc.reason])
        return Upstream(str(exc), code=exc.reason)
    if isinstance(exc, DuplicateRequest):
        return Conflict(str(exc), code="duplicate_request")
    if isinstance(exc, RequestTimeout):
        return GatewayTimeout(str(exc), code=TIMEOUT_CODES.get(exc.reason, "timeout"))
    return Upstream(str(exc), code="request_error")


def bus_unavailable(exc: NatschedError) -> Unavailable:
    log.warning("bus error: %s", exc)
    return Unavailable("the scheduler cannot be reached right now", code="bus_unavailable", retry_after=5)

