"""Prometheus metrics of one router replica (names and labels listed in the README).

Why these: the decision latency shows what routing costs per request; the decision counter
(by policy, so a canary is visible) and the expected cached tokens show what the policy
believes it saves; the worker-state gauge shows what the router may route to right now.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STATES = ("healthy", "backoff", "quiescing", "reregister", "stale", "half_open")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.decisions = Counter("natsched_routing_decisions", "Routing outcomes: assign, fail, retry (no worker yet)",
                                 ["policy", "decision", "reason"], registry=r)
        self.latency = Histogram("natsched_routing_decision_latency_seconds", "Policy time per routed request",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.wait = Histogram("natsched_routing_wait_seconds", "Admission to assignment (includes no-worker waits)",
                              buckets=WAIT_BUCKETS, registry=r)
        self.expected_cached = Counter("natsched_routing_expected_cached_tokens",
                                       "Prompt tokens the policy expected to find cached on its pick",
                                       ["policy"], registry=r)
        self.prompt_tokens = Counter("natsched_routing_prompt_tokens", "Estimated prompt tokens of routed requests",
                                     ["policy"], registry=r)
        self.workers = Gauge("natsched_routing_workers", "Workers known to this router, by state", ["state"],
                             registry=r)
        self.snapshot_requests = Counter("natsched_routing_snapshot_requests",
                                         "Cache snapshots asked of workers (sequence gaps, distrust)", registry=r)
        self.config_errors = Counter("natsched_routing_config_errors", "Router configs ignored as invalid",
                                     registry=r)
        self.assignments = Counter("natsched_routing_assignments", "Requests assigned, by policy and worker",
                                   ["policy", "worker"], registry=r)
        self.cached_tokens = Counter("natsched_routing_cached_tokens",
                                     "From completions: cached prompt tokens the router expected vs the worker had",
                                     ["worker", "kind"], registry=r)
        self.prefix_routes = Counter("natsched_routing_prefix_routes",
                                     "Routed requests whose first prefix block was routed before", registry=r)
        self.prefix_migrations = Counter("natsched_routing_prefix_migrations",
                                         "Of those, requests sent to another worker than last time "
                                         "(migration rate = migrations / prefix routes)", registry=r)
        self.claim_failures = Counter("natsched_routing_claim_failures",
                                      "Workers demoted because their cache claims kept failing", ["worker"],
                                      registry=r)
        self.finished_copies = Counter("natsched_routing_finished_copies",
                                       "Hand-offs not routed because their attempt's completion was seen already "
                                       "(a copy whose ack was lost, e.g. to a server restart)", registry=r)
        self.repeated_copies = Counter("natsched_routing_repeated_copies",
                                       "Hand-offs of an attempt this router had assigned already, sent again to "
                                       "the same worker unchanged (whose memory runs it once) instead of re-routed",
                                       registry=r)
        self.index_entries = Gauge("natsched_routing_index_entries", "Block hashes in the prefix index", registry=r)
        self.bad_reports = Counter("natsched_routing_bad_reports",
                                   "Heartbeats, cache events and shared cost statistics refused", ["kind"], registry=r)
        self.cost_refused = Counter("natsched_routing_cost_refused",
                                    "Completions the learned cost model refused (negative or non-finite times, "
                                    "impossible rates), by reason", ["reason"], registry=r)

    def set_worker_states(self, states: list[str]) -> None:
        for state in STATES:
            self.workers.labels(state).set(sum(1 for s in states if s == state))
