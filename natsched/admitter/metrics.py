"""Prometheus metrics of one admitter replica (names listed in the README)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
HANDOFF_BUCKETS = LATENCY_BUCKETS + (0.25, 0.5, 1, 2.5)  # a busy bus takes seconds
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class AdmitterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.decisions = Counter("natsched_admission_decisions", "Admission decisions",
                                 ["tenant", "class", "decision", "reason"], registry=r)
        self.inflight = Gauge("natsched_admission_inflight_runtime_tokens", "Reserved runtime tokens by tenant",
                              ["tenant"], registry=r)
        self.total = Gauge("natsched_admission_total_runtime_tokens", "Cluster total admitted against", registry=r)
        self.queue_depth = Gauge("natsched_admission_queue_depth", "Requests held in this replica's queue",
                                 ["class"], registry=r)
        self.queue_wait = Histogram("natsched_admission_queue_wait_seconds", "Time queued before a decision",
                                    ["class"], buckets=WAIT_BUCKETS, registry=r)
        self.latency = Histogram("natsched_admission_decision_latency_seconds",
                                 "Policy time plus the shared-state commit", buckets=LATENCY_BUCKETS, registry=r)
        # where a request's time goes under load: how many are decided together, and how long
        # each batch then waits for the bus to store its reservations and hand-offs
        self.batch = Histogram("natsched_admission_batch_requests", "Pulled requests decided together",
                               buckets=BATCH_BUCKETS, registry=r)
        self.handoff = Histogram("natsched_admission_handoff_seconds",
                                 "One batch's wait for its reservations and hand-offs to be stored",
                                 buckets=HANDOFF_BUCKETS, registry=r)
        self.repairs = Counter("natsched_admission_reconciliation_repairs", "Drift repaired by reconciliation",
                               ["kind"], registry=r)
        self.cas_conflicts = Counter("natsched_admission_cas_conflicts", "Shared-usage writes that lost a race",
                                     registry=r)
        self.credit_allows = Counter("natsched_admission_credit_allows",
                                     "Allows paid from this replica's credit (no shared write)", registry=r)
        self.credit_unspent = Gauge("natsched_admission_credit_unspent_runtime_tokens",
                                    "Runtime tokens this replica holds in credit, unspent", registry=r)
        # scaling signals (natsched.admitter.scaling): scale on queue wait, not GPU utilisation
        self.queue_wait_p95 = Gauge("natsched_admission_queue_wait_p95_seconds",
                                    "p95 of queue waits over the scaling window (queued requests' ages included)",
                                    registry=r)
        self.scale_signals = Counter("natsched_admission_scale_signals", "Scaling signals published",
                                     ["kind"], registry=r)
        self.scale_advice = Gauge("natsched_admission_scale_advice",
                                  "Holding advice: kind=out workers to add, kind=in 1 while a drain is advised",
                                  ["kind"], registry=r)
        self.lease_expiries = Counter("natsched_admission_lease_expiries",
                                      "Worker leases expired (missed heartbeats): their reservations reclaimed",
                                      registry=r)
        self.refused_values = Counter("natsched_admission_refused_kv_values",
                                      "Values of bucket inflight refused as not written by an admitter "
                                      "(a usage or a reservation record; the usage is rebuilt)", registry=r)
        self.refused_completions = Counter("natsched_admission_refused_completions",
                                           "Completions that released nothing: not from the worker the request's "
                                           "attempt was assigned to (wrong_source, bad_fence) or of an attempt "
                                           "since rescued (stale)", ["reason"], registry=r)
        self.grown = Counter("natsched_admission_grown_runtime_tokens",
                             "Runtime tokens added to reservations their requests ran past", registry=r)
        # class limits and loans (natsched.admitter.classes)
        self.class_tokens = Gauge("natsched_admission_class_tokens",
                                  "Runtime tokens by class: kind=used (held, borrowed part included), limit "
                                  "(-1: none), borrowed (of lower classes' limits), lent (to higher classes)",
                                  ["class", "kind"], registry=r)
        self.borrowed = Counter("natsched_admission_borrowed_runtime_tokens",
                                "Runtime tokens admissions of a class borrowed of a lower class's limit",
                                ["borrower", "lender"], registry=r)
        self.bad_quota_entries = Counter("natsched_admission_bad_quota_entries", "Corrupted quota entries ignored",
                                         registry=r)
