"""The gateway's request path: key -> tenant, body -> Request, bus outcome -> HTTP answer.

Thin on purpose: parsing and templates are pure (:mod:`natsched.gateway.protocol`, :mod:`natsched.wire.chat`),
admission is the admitter's and routing the router's. What is decided here is only how long
to wait and what each outcome means in HTTP:

=====================================  ======  ==========================================
outcome on the bus                     status  body / headers
=====================================  ======  ==========================================
result                                 200     completion (or SSE chunks, then [DONE])
degraded to the offline path           202     ``{"object": "natsched.job", "job_id"}``
rejected with ``retry_after``          429     ``Retry-After`` (quota, tenant cap, queue)
rejected, never admissible as sent     400     the admitter's reason as ``code``
rejected: ``unknown_tenant``           403
failed: ``no_worker`` / no healthy     503     ``Retry-After``
worker serves the model
failed: ``prompt_too_long``, invalid   400
failed: engine error                   502
no result within the client's timeout  504     (the request is cancelled on its worker)
already submitted (same id)            409
bus unreachable                        503
=====================================  ======  ==========================================

The wait: a request may stay queued as long as the client waits — the ``x-natsched-timeout``
header, else the OpenAI SDK's ``x-stainless-read-timeout``, capped by ``max_wait_s`` — and its
``deadline`` is set to the end of that wait, so a request nobody waits for any more is dropped
by the admitter or the worker instead of run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import orjson

from natsched.client.producer import Chunk, Client, Result, ResultStatus
from natsched.errors import NatschedError
from natsched.client.errors import DuplicateRequest, Rejected, RequestError, RequestFailed, RequestTimeout
from natsched.wire.schema import Request, RequestId, TenantId
from natsched.gateway import protocol as P
from natsched.gateway.errors import (ApiError, BadRequest, Conflict, Forbidden, GatewayTimeout, NotFound, RateLimited,
                            Unavailable, Upstream)
from natsched.gateway.keys import KeyRing, Principal
from natsched.gateway.metrics import GatewayMetrics
from natsched.gateway.status import StatusCollector

log = logging.getLogger(__name__)

TIMEOUT_HEADERS = ("x-natsched-timeout", "x-stainless-read-timeout")


@dataclass
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 768 * 1024  # a request must still fit one 1 MiB bus message
    default_max_tokens: int = 128
    max_tokens_limit: int = 32768
    max_wait_s: float = 600.0  # the longest any request is held (queued + running), whatever the client says
    min_wait_s: float = 1.0
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


class Gateway:
    def __init__(self, client: Client, keys: KeyRing, settings: GatewaySettings | None = None,
                 metrics: GatewayMetrics | None = None, status: StatusCollector | None = None) -> None:
        self.client = client
        self.keys = keys
        self.settings = settings or GatewaySettings()
        self.metrics = metrics or GatewayMetrics()
        self.status = status or StatusCollector(client.bus, follow_records=self.settings.status_page)
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

    # --- building the call ----------------------------------------------------------------
    def timeout(self, headers: Any) -> float:
        for name in TIMEOUT_HEADERS:
            raw = headers.get(name)
            if raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                raise BadRequest(f"header {name} must be a number of seconds, got {raw!r}", code="invalid_timeout",
                                 param=name) from None
            if not math.isfinite(value) or value <= 0:
                raise BadRequest(f"header {name} must be a positive number of seconds", code="invalid_timeout",
                                 param=name)
            return max(self.settings.min_wait_s, min(value, self.settings.max_wait_s))
        return self.settings.max_wait_s

    def call(self, principal: Principal, cls: str, inf: P.Inference, request_id: str, timeout_s: float,
             endpoint: str) -> Call:
        now = time.time()
        request = Request(id=RequestId(request_id), tenant=TenantId(principal.tenant), cls=cls, model=inf.model,
                          prompt=inf.prompt, prompt_token_ids=inf.prompt_token_ids, system_prompt=inf.system_prompt,
                          max_tokens=inf.max_tokens, deadline=now + timeout_s, created=now, stream=inf.stream)
        return Call(principal, inf, request, time.monotonic(), int(now), timeout_s, endpoint)

    # --- non-streaming ------------------------------------------------------------------------
    async def complete(self, call: Call) -> tuple[int, dict[str, Any]]:
        """(status, body) of a non-streaming call; raises ApiError."""
        try:
            async with asyncio.timeout(call.timeout_s):
                result = await self.client.submit(call.request)
        except TimeoutError:
            self.metrics.cancelled.labels("timeout").inc()
            raise GatewayTimeout(f"no result within {call.timeout_s:g}s (the client's timeout); the request was "
                                 "cancelled", code="timeout") from None
        except RequestError as exc:
            raise api_error(exc, self.settings) from None
        except NatschedError as exc:
            raise bus_unavailable(exc) from None
        return self._final(call, result)

    def _final(self, call: Call, result: Result) -> tuple[int, dict[str, Any]]:
        if result.status == ResultStatus.DEGRADED:
            return 202, {"id": call.request.id, "object": "natsched.job", "status": "degraded",
                         "job_id": result.job_id, "created": call.created, "model": call.inference.model}
        self._observe(call, result)
        return 200, P.response_body(call.inference, call.request.id, call.created, result.text,
                                    result.finish_reason, result.prompt_tokens, result.output_tokens,
                                    result.cached_tokens, result.worker)

    def _observe(self, call: Call, result: Result) -> None:
        m, tenant = self.metrics, call.principal.tenant
        m.tokens.labels(tenant, "prompt").inc(result.prompt_tokens)
        m.tokens.labels(tenant, "cached").inc(result.cached_tokens)
        m.tokens.labels(tenant, "output").inc(result.output_tokens)
        if result.tpot is not None:
            m.tpot.labels(call.endpoint).observe(result.tpot)

    # --- streaming ------------------------------------------------------------------------------
    async def open_stream(self, call: Call) -> tuple[Chunk | Result, AsyncIterator[Chunk | Result], Any]:
        """Start a streaming call and wait (up to the client's timeout) for its first event.

        Errors before the first token are raised here, so they still become a proper HTTP status.
        """
        stream = self.client.stream(call.request)
        events = _events(stream)
        try:
            async with asyncio.timeout(call.timeout_s):
                first = await events.__anext__()
        except TimeoutError:
            await events.aclose()
            self.metrics.cancelled.labels("timeout").inc()
            raise GatewayTimeout(f"no first token within {call.timeout_s:g}s (the client's timeout); the request "
                                 "was cancelled", code="timeout") from None
        except RequestError as exc:
            await events.aclose()
            raise api_error(exc, self.settings) from None
        except NatschedError as exc:
            await events.aclose()
            raise bus_unavailable(exc) from None
        except BaseException:
            await events.aclose()
            raise
        self.metrics.ttft.labels(call.endpoint).observe(time.monotonic() - call.received)
        return first, events, stream

    async def sse(self, call: Call, first: Chunk | Result, events: AsyncIterator[Chunk | Result]) -> AsyncIterator[bytes]:
        """The SSE body: chunks, the finish chunk, usage (when asked), ``[DONE]``; an error event on failure."""
        inf, rid, created = call.inference, call.request.id, call.created
        item: Chunk | Result | None = first
        sent_first = False
        try:
            while item is not None:
                if isinstance(item, Chunk):
                    yield _data(P.chunk(inf, rid, created, item.text, first=not sent_first))
                    sent_first = True
                else:
                    if item.status == ResultStatus.DEGRADED:
                        yield _data({"error": {"message": f"degraded to the offline path: job {item.job_id}",
                                               "type": "natsched_degraded", "param": None, "code": "degraded"}})
                        return
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
                    item = await events.__anext__()
                except StopAsyncIteration:
                    item = None
        except RequestError as exc:  # after the first token: the status is sent, say it in the stream
            yield _data(api_error(exc, self.settings).body())
        except NatschedError as exc:
            yield _data(bus_unavailable(exc).body())
        finally:
            await events.aclose()


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
        if exc.retry_after is not None:
            return RateLimited(message, code=exc.reason, retry_after=exc.retry_after)
        return BadRequest(message, code=exc.reason)
    if isinstance(exc, RequestFailed):
        if exc.reason == "no_worker":
            return Unavailable(str(exc), code=exc.reason, retry_after=settings.no_worker_retry_after_s)
        if exc.reason in _BAD_FAILURES:
            return BadRequest(str(exc), code=exc.reason)
        if exc.reason == "deadline_exceeded":
            return GatewayTimeout(str(exc), code=exc.reason)
        return Upstream(str(exc), code=exc.reason)
    if isinstance(exc, DuplicateRequest):
        return Conflict(str(exc), code="duplicate_request")
    if isinstance(exc, RequestTimeout):
        return GatewayTimeout(str(exc), code="timeout")
    return Upstream(str(exc), code="request_error")


def bus_unavailable(exc: NatschedError) -> Unavailable:
    log.warning("bus error: %s", exc)
    return Unavailable("the scheduler cannot be reached right now", code="bus_unavailable", retry_after=5)

