"""The HTTP surface: routes, the request-id middleware, and the error answers.

Framework: Starlette on uvicorn (uvloop event loop, httptools parser). Why: it is the thinnest
mainstream ASGI toolkit — routing and a request object, no per-request validation layer (we
validate ourselves, to answer in OpenAI's error format) — and uvicorn with httptools and uvloop
is among the fastest Python HTTP servers; both are widely used and actively maintained, and
vLLM's own OpenAI server runs on the same pair, so a vLLM deployment already has them.

Order of checks on an inference call, cheapest refusal first: (the socket's limits, before any
of this: :mod:`natsched.gateway.edge`) -> open mode only: Host, Origin, Content-Type (403/415,
:mod:`natsched.gateway.origin`) -> declared body size (413) -> API key (401) -> the key's calls
in flight (429) -> class header (400/403) -> body read within the limit (413) -> JSON (400) ->
fields (400) -> model (404/503) -> the bus. A client that leaves while its body is being read
is counted (``shed{reason="client_abort"}``) and logged on one line, without a traceback.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from natsched.client.producer import new_request_id
from natsched.wire.ids import scoped
from natsched.gateway import protocol as P
from natsched.gateway.errors import (ApiError, BadRequest, Forbidden, MethodNotAllowed, NotFound, PayloadTooLarge,
                                     Unauthorized)
from natsched.gateway.keys import CLASS_HEADER, Principal, effective_class, status_credentials
from natsched.gateway.origin import check_host, check_json, check_origin
from natsched import tracing
from natsched.gateway.jobs import job_body
from natsched.gateway.service import JOBS_PATH, QUEUE_WAIT_HEADER, Gateway
from natsched.gateway.sse import ClientGone, EventStream, until_disconnect
from natsched.gateway.status_page import render_html

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz", "/health", "/status", "/status.json")


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(err: ApiError) -> JSON:
    return JSON(err.body(), status_code=err.status, headers=err.headers)


class RequestIdMiddleware:
    """Every answer carries ``x-request-id``; for inference calls it is the natsched request id
    (the one ``natsched audit`` takes). It also counts and times every answer."""

    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.app = app
        self.metrics = gateway.metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        started = time.monotonic()
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else \
            JOBS_PATH + "{id}" if scope["path"].startswith(JOBS_PATH) else "other"
        status = [500]

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                # the id the request was submitted under (in its tenant's scope, once the key said whose)
                xid = state.get("request_id", rid)
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", xid.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                self.metrics.duration.labels(endpoint, str(bool(state.get("stream")))).observe(
                    time.monotonic() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over the {limit}-byte limit", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _declared_length(request: Request, limit: int) -> None:
    raw = request.headers.get("content-length")
    if raw is None:
        return
    if not raw.isdigit():
        raise BadRequest("malformed Content-Length header", code="invalid_body")
    if int(raw) > limit:
        raise PayloadTooLarge(f"request body of {raw} bytes is over the {limit}-byte limit", code="body_too_large")


def _json(body: bytes) -> Any:
    if not body.strip():
        raise BadRequest("empty request body: send a JSON object", code="invalid_json")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"could not parse the JSON body: {exc}", code="invalid_json") from None


def _open_checks(request: Request, gw: Gateway, body: bool) -> None:
    """The open mode's CSRF and DNS-rebinding defences (:mod:`natsched.gateway.origin`)."""
    if not gw.keys.is_open:
        return
    s, headers = gw.settings, request.headers
    check_host(headers.get("host"), s.host, s.allowed_hosts)
    check_origin(headers.get("origin"), headers.get("host"), s.allowed_origins)
    if body:
        check_json(headers.get("content-type"))


async def _inference(request: Request, kind: str) -> Any:
    gw: Gateway = request.app.state.gateway
    try:
        _open_checks(request, gw, body=True)
        _declared_length(request, gw.settings.max_body_bytes)
        principal = gw.keys.authenticate(request.headers.get("authorization"))
        gw.take_slot(principal)
    except ApiError as err:
        return _failed(gw, err)
    streaming = False
    try:
        response = await _answer(request, gw, kind, principal)
        streaming = isinstance(response, EventStream)
        return response
    finally:
        if not streaming:  # a stream gives its slot back when it ends (EventStream's on_close)
            gw.give_slot(principal)


async def _answer(request: Request, gw: Gateway, kind: str, principal: Principal) -> Any:
    s = gw.settings
    try:
        cls = effective_class(principal, request.headers.get(CLASS_HEADER))
        inf = P.parse(kind, _json(await _read_body(request, s.max_body_bytes)), s.default_max_tokens,
                      s.max_tokens_limit, s.max_prompt_token_ids)
        gw.check_model(inf.model)
        # the id every record names, and the one x-request-id answers (natsched.wire.ids.scoped)
        request.state.request_id = scoped(principal.tenant, request.state.request_id)
        call = gw.limit(gw.call(principal, cls, inf, request.state.request_id, gw.timeout(request.headers),
                                request.url.path), request.headers)
    except ApiError as err:
        return _failed(gw, err)
    except ClientDisconnect:  # it left mid-body (or its body was too slow): nothing to answer, nothing ran
        gw.metrics.shed.labels("client_abort").inc()
        log.info("request %s: client left before its body was complete", request.state.request_id)
        return Response(status_code=499)
    request.state.stream = inf.stream
    gw.metrics.inflight.inc()
    streaming = False
    span = tracing.start("natsched.gateway", request.headers, call.request.id, {
        "http.route": request.url.path, "natsched.tenant": principal.tenant, "natsched.model": inf.model,
        "natsched.stream": inf.stream}, kind="server")
    tracing.current.set(span)  # this request's task: the producer's publish carries it on
    status_code: int | None = None
    try:
        if not inf.stream:
            status_code, body, est_wait = await until_disconnect(request.receive, gw.complete(call))
            return JSON(body, status_code=status_code, headers=_queue_wait(est_wait))
        first, events, stream = await until_disconnect(request.receive, gw.open_stream(call))
        streaming = True
        return EventStream(gw.sse(call, first, events), headers=_queue_wait(stream.est_wait),
                           on_disconnect=_gone(gw, call), on_close=_stream_closed(gw, principal, span))
    except ClientGone:
        _gone(gw, call)()
        status_code = 499
        return Response(status_code=499)  # nobody reads it; logged by the server as such
    except ApiError as err:
        status_code = err.status
        return _failed(gw, err)
    except Exception:
        log.exception("request %s failed in the gateway", call.request.id)
        status_code = 500
        return _failed(gw, ApiError(f"internal error in the gateway (request {call.request.id})", code="internal"))
    finally:
        if not streaming:
            gw.metrics.inflight.dec()
            tracing.end(span, {"http.status_code": status_code},
                        error=None if status_code == 200 else f"HTTP {status_code}")


def _queue_wait(est_wait: float | None) -> dict[str, str]:
    """The admitter's estimated wait of a request it queued, as a header (none: it was not queued)."""
    return {} if est_wait is None else {QUEUE_WAIT_HEADER: f"{est_wait:.3f}"}


def _stream_closed(gw: Gateway, principal: Principal, span: Any = None):
    def close() -> None:
        gw.metrics.inflight.dec()
        gw.give_slot(principal)
        tracing.end(span, {"http.status_code": 200})

    return close


def _gone(gw: Gateway, call: Any):
    def note() -> None:
        gw.metrics.cancelled.labels("disconnect").inc()
        log.info("request %s: client disconnected; cancelled", call.request.id)

    return note


def _failed(gw: Gateway, err: ApiError) -> JSON:
    gw.metrics.errors.labels(err.type, err.code or "").inc()
    return error_response(err)


async def completions(request: Request) -> Any:
    return await _inference(request, P.COMPLETION)


async def chat_completions(request: Request) -> Any:
    return await _inference(request, P.CHAT)


async def models(request: Request) -> Any:
    gw: Gateway = request.app.state.gateway
    try:
        _open_checks(request, gw, body=False)
        gw.keys.authenticate(request.headers.get("authorization"))
    except ApiError as err:
        return _failed(gw, err)
    return JSON(P.models_body(gw.models(), cards=gw.model_cards()))


async def job(request: Request) -> Any:
    """``GET /v1/natsched/jobs/{id}``: a degraded request's job, for the tenant of the caller's key only."""
    gw: Gateway = request.app.state.gateway
    try:
        _open_checks(request, gw, body=False)
        principal = gw.keys.authenticate(request.headers.get("authorization"))
        body = job_body(await gw.find_job(request.path_params["job_id"], principal.tenant))
    except ApiError as err:
        return _failed(gw, err)
    return JSON(body)


async def healthz(request: Request) -> Any:
    """200 while the bus connection is up (workers may come and go); 503 otherwise."""
    gw: Gateway = request.app.state.gateway
    connected = gw.client.bus.connected
    healthy = {m: ok for m, ok in gw.models().items() if ok}
    body = {"status": "ok" if connected else "unavailable", "bus": "connected" if connected else "disconnected",
            "models": sorted(healthy)}
    return JSON(body, status_code=200 if connected else 503)


def _status_allowed(request: Request, gw: Gateway) -> None:
    """``/status*`` shows every tenant's usage: on a keyed gateway only a key with ``"status":
    true`` may read it (401 without a key, 403 with another); open, the Host and Origin checks."""
    _open_checks(request, gw, body=False)
    if gw.keys.is_open:
        return
    try:
        principal = gw.keys.authenticate(status_credentials(request.headers.get("authorization")))
    except Unauthorized as err:  # a browser asks its user for the key (as the password)
        err.extra_headers = {"www-authenticate": 'Basic realm="natsched status", charset="UTF-8"'}
        raise
    if not principal.status:
        raise Forbidden("this API key may not read the status page (it shows every tenant's usage); "
                        'give a key "status": true in the keys file', code="status_not_allowed")


async def status_html(request: Request) -> Any:
    gw: Gateway = request.app.state.gateway
    try:
        _status_allowed(request, gw)
    except ApiError as err:
        return _failed(gw, err)
    view = await gw.status.snapshot()
    return HTMLResponse(render_html(view, gw.settings.status_refresh_s))


async def status_json(request: Request) -> Any:
    gw: Gateway = request.app.state.gateway
    try:
        _status_allowed(request, gw)
    except ApiError as err:
        return _failed(gw, err)
    return Response((await gw.status.snapshot()).to_json(), media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Any:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: ApiError = NotFound(f"no such endpoint: {request.method} {request.url.path}", code="unknown_url")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    else:
        err = ApiError(str(exc.detail), code=str(exc.status_code))
        err.status = exc.status_code
    return error_response(err)


async def _crash(request: Request, exc: Exception) -> Any:
    log.error("unhandled error on %s %s: %r", request.method, request.url.path, exc)
    return error_response(ApiError("internal error in the gateway", code="internal"))


def build_app(gateway: Gateway) -> Any:
    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/health", healthz, methods=["GET"]),  # vLLM's name for it: what its clients and probes ask
        Route(JOBS_PATH + "{job_id}", job, methods=["GET"]),
    ]
    if gateway.settings.status_page:
        routes += [Route("/status", status_html, methods=["GET"]), Route("/status.json", status_json, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _crash})
    app.state.gateway = gateway
    return RequestIdMiddleware(app, gateway)

