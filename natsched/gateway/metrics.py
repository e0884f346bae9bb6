"""Prometheus metrics of one gateway (names and labels listed in the README).

Measured at the HTTP edge, so they include the bus and the queue: TTFT here is what a client
sees (request received -> first token sent), the request duration covers the whole answer,
and ``cancelled`` counts clients that left before their answer was complete.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("natsched_gateway_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.errors = Counter("natsched_gateway_errors", "Error answers by OpenAI error type and code",
                              ["type", "code"], registry=r)
        self.duration = Histogram("natsched_gateway_request_duration_seconds", "Request received to answer complete",
                                  ["endpoint", "stream"], buckets=DURATION_BUCKETS, registry=r)
        self.ttft = Histogram("natsched_gateway_ttft_seconds", "Request received to first token sent",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("natsched_gateway_tpot_seconds", "Time per output token, as the worker measured it",
                              ["endpoint"], buckets=TPOT_BUCKETS, registry=r)
        self.tokens = Counter("natsched_gateway_tokens", "Tokens of completed requests by tenant and kind "
                              "(prompt, cached, output)", ["tenant", "kind"], registry=r)
        self.inflight = Gauge("natsched_gateway_inflight_requests", "Inference requests being answered", registry=r)
        self.shed = Counter("natsched_gateway_shed", "Connections and requests refused before any bus work, by "
                            "why (connections, header_timeout, body_timeout, header_too_large, per_key, "
                            "client_abort)", ["reason"], registry=r)
        self.cancelled = Counter("natsched_gateway_cancelled", "Requests given up before their end, by why "
                                 "(disconnect, timeout, ttft_timeout, idle_timeout)", ["reason"], registry=r)
        self.keepalives = Counter("natsched_gateway_sse_keepalives", "SSE comment lines sent on quiet streams",
                                  registry=r)
        self.migrations = Counter("natsched_gateway_stream_migrations", "Streams that went on from another worker "
                                  "after theirs died mid-stream (natsched.client.producer.Migration)", ["tenant"],
                                  registry=r)
