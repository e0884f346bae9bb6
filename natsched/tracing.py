"""OpenTelemetry traces of a request's path, off by default; natsched runs without the package.

One trace per request: ``natsched.gateway`` (the HTTP call) -> ``natsched.admission`` (each
decision: allow, queue, reject, degrade) -> ``natsched.routing`` (the worker and the policy's
terms) -> ``natsched.worker`` (the run) with ``natsched.worker.first_token`` (run start to first
token) and ``natsched.worker.done`` (first token to the end). Every span has the request id.

The context crosses the bus as a W3C ``traceparent`` message header: a service asks for the
headers of its span (:func:`carry`) and hands them to the :class:`~natsched.bus.connection.Bus`
with the message; the next service starts its span from the delivered headers (:func:`start`).
Nothing here touches NATS.

Token-level timing (every token's offset from the run's start, ``natsched.tokens.offsets_ms``)
is kept for a sampled share of runs, and for every run that ended in error or took longer than
the worker's running p99: the tail and the failures are what one looks at (seed 003), and
keeping every token of every request would cost more than the request.

Why this shape: spans are started and ended explicitly, with the parent passed in, because the
services decide in batches (one task, many requests); an ambient "current span" would join
unrelated requests. Configured once at a service's entry point (:func:`configure_from_env`:
``OTEL_EXPORTER_OTLP_ENDPOINT`` set means OTLP export over HTTP); tests pass an in-memory exporter.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import random
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from natsched.errors import NatschedError

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_TOKEN_SHARE = "NATSCHED_TRACE_TOKEN_SHARE"


class TracingError(NatschedError):
    """Tracing was asked for and cannot be set up: a bad setting, or the package is missing."""


@dataclass(frozen=True)
class TraceSettings:
    service: str = "natsched"
    endpoint: str | None = None  # OTLP/HTTP collector, e.g. http://127.0.0.1:4318
    token_share: float = 0.01  # share of runs whose token-level timing is kept (plus p99 and errors)

    def __post_init__(self) -> None:
        share = self.token_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise TracingError(f"the token-timing share must be a number in [0, 1], got {share!r}")


class _State:
    tracer: Any = None  # an opentelemetry Tracer while tracing is on
    provider: Any = None
    settings: TraceSettings = TraceSettings()
    rng = random.Random()


_state = _State()
#: the span a producer's publish continues (the gateway sets it in each HTTP request's task)
current: ContextVar[Any] = ContextVar("natsched_trace_span", default=None)


def enabled() -> bool:
    return _state.tracer is not None


def configure(settings: TraceSettings, exporter: Any = None) -> None:
    """Turn tracing on: spans go to ``exporter`` (tests) or, by default, OTLP over HTTP."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise TracingError("tracing needs the opentelemetry packages: pip install 'natsched[tracing]'") from None
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = (settings.endpoint or "").rstrip("/")
        if not endpoint.startswith(("http://", "https://")):
            raise TracingError(f"the OTLP endpoint must be an http(s) URL, got {settings.endpoint!r}")
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint + "/v1/traces")))
    shutdown()
    _state.provider, _state.settings = provider, settings
    _state.tracer = provider.get_tracer("natsched")


def configure_from_env(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """At a service's start: on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (else nothing is
    imported). A bad value raises :class:`TracingError` before the service starts."""
    endpoint = env.get(ENV_ENDPOINT)
    if not endpoint:
        return False
    raw = env.get(ENV_TOKEN_SHARE, "0.01")
    try:
        share = float(raw)
    except ValueError:
        raise TracingError(f"{ENV_TOKEN_SHARE} must be a number in [0, 1], got {raw!r}") from None
    configure(TraceSettings(service=service, endpoint=endpoint, token_share=share))
    log.info("traces of %s go to %s (token timing for %.1f%% of runs, the p99 tail and errors)", service,
             endpoint, share * 100)
    return True


def shutdown() -> None:
    if _state.provider is not None:
        _state.provider.shutdown()
    _state.tracer = _state.provider = None


def start(name: str, parent: Mapping[str, str] | None, request_id: str, attributes: dict | None = None,
          kind: str = "internal") -> Any:
    """A started span, child of the context in ``parent`` (message or HTTP headers), or None when
    tracing is off. End it with :func:`end`."""
    if _state.tracer is None:
        return None
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract(dict(parent)) if parent else None
    attrs = {"natsched.request_id": request_id, **_clean(attributes or {})}
    return _state.tracer.start_span(name, context=ctx, attributes=attrs,
                                    kind=SpanKind.SERVER if kind == "server" else SpanKind.INTERNAL)


def child(name: str, parent_span: Any, request_id: str, attributes: dict | None = None,
          start_time_ns: int | None = None) -> Any:
    if parent_span is None:
        return None
    from opentelemetry import trace

    ctx = trace.set_span_in_context(parent_span)
    return _state.tracer.start_span(name, context=ctx, start_time=start_time_ns,
                                    attributes={"natsched.request_id": request_id, **_clean(attributes or {})})


def end(span: Any, attributes: dict | None = None, error: str | None = None, end_time_ns: int | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_time_ns)


def carry(span: Any, headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` plus the ``traceparent`` of ``span`` (unchanged when there is no span)."""
    if span is None:
        return headers
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    out = dict(headers or {})
    TraceContextTextMapPropagator().inject(out, context=trace.set_span_in_context(span))
    return out


def _clean(attributes: dict) -> dict:
    """OpenTelemetry takes str, bool, int, float and lists of one of them; None is left out."""
    out = {}
    for k, v in attributes.items():
        if v is None:
            continue
        out[k] = v if isinstance(v, (str, bool, int, float, list, tuple)) else str(v)
    return out


class TailTracker:
    """A running p99 of run durations over the last ``window`` runs (recomputed every ``every``):
    cheap enough to ask for every run. Pure apart from its own state."""

    def __init__(self, window: int = 1000, every: int = 50, warmup: int = 100) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.every, self.warmup = every, warmup
        self.p99 = math.inf
        self._since = 0

    def observe(self, seconds: float) -> bool:
        """Note one run; True if it is above the p99 so far (none is, before ``warmup`` runs)."""
        above = seconds > self.p99
        self.recent.append(seconds)
        self._since += 1
        if len(self.recent) >= self.warmup and self._since >= self.every:
            ordered = sorted(self.recent)
            self.p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
            self._since = 0
        return above


def keep_token_timing(tail: TailTracker, seconds: float, failed: bool) -> str | None:
    """Why a run's token-level timing is kept (``sampled``, ``p99``, ``error``), or None."""
    above = tail.observe(seconds)
    if failed:
        return "error"
    if above:
        return "p99"
    if _state.rng.random() < _state.settings.token_share:
        return "sampled"
    return None


def token_offsets_ms(started: float, times: Iterator[float]) -> list[float]:
    return [round((t - started) * 1000, 3) for t in times]
