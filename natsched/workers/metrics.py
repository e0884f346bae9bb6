"""Prometheus metrics of one worker agent (names and labels listed in the README).

Latency is measured where it happens: TTFT and TPOT on the worker are the engine's own
figures, free of gateway and bus time; the dispatch wait is how long an assignment sat in the
WORK stream before the engine took it (a worker queue the admitter cannot see). Token counters
give the cache hit ratio as ``rate(cached) / rate(prompt)``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STATES = ("healthy", "backoff", "quiescing", "reregister")


class WorkerMetrics:
    def __init__(self, worker: str, model: str, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        Info("natsched_worker", "This worker's id and model", registry=r).info({"worker": worker, "model": model})
        self.ttft = Histogram("natsched_worker_ttft_seconds", "Time to first token, from the engine's start",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("natsched_worker_tpot_seconds", "Time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("natsched_worker_e2e_seconds", "Request creation to completion",
                             buckets=E2E_BUCKETS, registry=r)
        self.dispatch_wait = Histogram("natsched_worker_dispatch_wait_seconds",
                                       "Routed to started on this worker (time in the WORK stream)",
                                       buckets=WAIT_BUCKETS, registry=r)
        self.requests = Counter("natsched_worker_requests", "Finished requests by status and reason",
                                ["status", "reason"], registry=r)
        self.prompt_tokens = Counter("natsched_worker_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.cached_tokens = Counter("natsched_worker_cached_tokens", "Prompt tokens served from the KV cache",
                                     registry=r)
        self.output_tokens = Counter("natsched_worker_output_tokens", "Generated tokens", registry=r)
        self.cancelled = Counter("natsched_worker_cancelled", "Requests cancelled by their producer", registry=r)
        self.misrouted = Counter("natsched_worker_misrouted_assignments",
                                 "Assignments naming another worker, refused (dead-lettered, not run)", registry=r)
        self.timeouts = Counter("natsched_worker_timeouts", "Runs stopped by their own time limit, by reason "
                                "(ttft_timeout, idle_timeout, deadline_exceeded)", ["reason"], registry=r)
        self.cancels_refused = Counter("natsched_worker_cancels_refused",
                                       "Cancels naming a running request of another tenant (refused)", registry=r)
        self.duplicate_runs = Counter("natsched_worker_duplicate_runs",
                                      "Requests whose completion another run had already stored", registry=r)
        self.running = Gauge("natsched_worker_running", "Requests running in the engine", registry=r)
        self.waiting = Gauge("natsched_worker_waiting", "Requests waiting in the engine", registry=r)
        self.kv_used = Gauge("natsched_worker_kv_used_blocks", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("natsched_worker_kv_total_blocks", "KV cache blocks in all", registry=r)
        self.runtime_tokens = Gauge("natsched_worker_runtime_tokens", "Runtime tokens in use", registry=r)
        self.capacity_tokens = Gauge("natsched_worker_capacity_tokens", "Runtime-token capacity announced",
                                     registry=r)
        # the engine's own cumulative counters (a gauge each: they start again when the engine does)
        self.engine_preemptions = Gauge("natsched_worker_engine_preemptions",
                                        "Sequences the engine preempted since it started", registry=r)
        self.engine_prefix_queries = Gauge("natsched_worker_engine_prefix_cache_queries",
                                           "Prompt tokens the engine looked up in its prefix cache since it "
                                           "started (engine servers that count them)", registry=r)
        self.engine_prefix_hits = Gauge("natsched_worker_engine_prefix_cache_hits",
                                        "... of them, found there", registry=r)
        self.state = Gauge("natsched_worker_state", "1 for the state the worker announces", ["state"], registry=r)

    def set_engine_counters(self, preemptions: int, prefix_queries: int | None, prefix_hits: int | None) -> None:
        """Copy the engine's own counters (prefix-cache ones only where it reports them)."""
        self.engine_preemptions.set(preemptions)
        if prefix_queries is not None:
            self.engine_prefix_queries.set(prefix_queries)
        if prefix_hits is not None:
            self.engine_prefix_hits.set(prefix_hits)

    def set_state(self, current: str) -> None:
        for state in STATES:
            self.state.labels(state).set(1 if state == current else 0)
