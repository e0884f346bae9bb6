"""The admission benchmark: natsched's admission policy and a count-based FIFO, side by side.

``natsched bench admission [--workload FILE] [--json OUT]`` (:mod:`natsched.cli.bench`) generates an overload
(:mod:`natsched.sim.admission_workload`; built-in default when no file), replays the *same* arrivals through
each policy (:mod:`natsched.sim.admission_policies`) in the discrete-event run of :mod:`natsched.sim.admission_sim`,
prints a table and optionally writes JSON::

    {"workload": {...the parsed workload...}, "requests": N, "count_fifo_per_tick": K,
     "policies": {"natsched": {METRICS}, "count_fifo": {METRICS}}, "targets": {...}}

The metrics are defined in :mod:`natsched.sim.admission_metrics`. Targets (from the admission issue):
natsched's ``long_token_share`` >= reserve - 0.03 while count_fifo's is below half the reserve;
every backlogged tenant's ``floor_ratio`` >= 0.95; ``max_overadmit_tokens`` = 0; decision latency
p99 <= 5 ms. The policies run one after the other in this process, so latencies do not compete.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, TextIO

from natsched.sim.admission_metrics import BACKLOGGED_FRACTION, summarize
from natsched.sim.admission_policies import CountFifo, NatschedAdmission
from natsched.sim.admission_sim import run_policy
from natsched.sim.admission_workload import AdmissionWorkload, SimRequest, generate

log = logging.getLogger(__name__)

POLICIES = ("natsched", "count_fifo")
LATENCY_TARGET_MS = 5.0
FLOOR_TARGET = 0.95
LONG_SHARE_SLACK = 0.03


def count_fifo_per_tick(w: AdmissionWorkload, requests: list[SimRequest]) -> int:
    """count_fifo's fixed number per tick: twice the completions per tick the cluster manages at
    full load (total / mean(cost × hold) per second), so the count itself never starves it."""
    if not requests:
        return 1
    mean_load = sum(r.cost * r.hold_s for r in requests) / len(requests)
    per_second = w.total_runtime_tokens / mean_load
    return max(1, math.ceil(2 * per_second * w.tick_s))


@dataclass
class AdmissionReport:
    workload: AdmissionWorkload
    requests: int
    per_tick: int
    policies: dict[str, dict[str, Any]]

    def targets(self) -> dict[str, Any]:
        """Each target with the measured value and whether it is met."""
        r = self.workload.reserve_long_share
        nat, fifo = self.policies.get("natsched", {}), self.policies.get("count_fifo", {})
        ratios = {n: t["floor_ratio"] for n, t in nat.get("tenants", {}).items()
                  if (t["backlogged"] or 0) >= BACKLOGGED_FRACTION and t["floor_ratio"] is not None}
        long_nat, long_fifo = nat.get("long_token_share"), fifo.get("long_token_share")
        return {  # ok None: not applicable (e.g. long and short never queued at once)
            "natsched_long_token_share": {"want": f">= {r - LONG_SHARE_SLACK:.2f}", "got": long_nat,
                                          "ok": None if long_nat is None else long_nat >= r - LONG_SHARE_SLACK},
            "count_fifo_long_token_share": {"want": f"< {r / 2:.2f}", "got": long_fifo,
                                            "ok": None if long_fifo is None else long_fifo < r / 2},
            "natsched_backlogged_floor_ratio": {"want": f">= {FLOOR_TARGET}", "got": ratios,
                                                "ok": all(v >= FLOOR_TARGET for v in ratios.values())},
            "natsched_max_overadmit_tokens": {"want": "0", "got": nat.get("max_overadmit_tokens"),
                                              "ok": nat.get("max_overadmit_tokens") == 0},
            "natsched_decision_latency_p99_ms": {"want": f"<= {LATENCY_TARGET_MS:g}",
                                                 "got": nat.get("decision_latency_p99_ms"),
                                                 "ok": (nat.get("decision_latency_p99_ms") or 0) <= LATENCY_TARGET_MS},
        }

    def to_json(self) -> dict[str, Any]:
        w = dataclasses.asdict(self.workload)
        return {"workload": w, "requests": self.requests, "count_fifo_per_tick": self.per_tick,
                "policies": self.policies, "targets": self.targets()}

    def table(self) -> str:
        return format_table(self)


def _make_policy(name: str, w: AdmissionWorkload, per_tick: int):
    if name == "natsched":
        return NatschedAdmission(w)
    return CountFifo(w, per_tick)


def run_admission_benchmark(w: AdmissionWorkload, stream: TextIO | None = None,
                            policies: tuple[str, ...] = POLICIES) -> AdmissionReport:
    """Generate the arrivals once and run every policy on them."""
    requests = generate(w)
    per_tick = count_fifo_per_tick(w, requests)
    results = {}
    for name in policies:
        started = time.perf_counter()
        ledger = run_policy(_make_policy(name, w, per_tick), w, requests)
        results[name] = summarize(ledger, w, time.perf_counter() - started)
        if stream is not None:
            print(f"  {name}: {len(requests)} requests in {results[name]['wall_s']:.1f}s", file=stream, flush=True)
    return AdmissionReport(w, len(requests), per_tick, results)


# ---------------------------------------------------------------------- table

def _f(v: Any, pattern: str = "{:.3f}") -> str:
    return "-" if v is None else pattern.format(v)


def _rows(report: AdmissionReport) -> list[tuple[str, ...]]:
    names = list(report.policies)
    pol = [report.policies[n] for n in names]
    rows: list[tuple[str, ...]] = [("metric", *names)]
    spec = [("long token share", "long_token_share", "{:.3f}"), ("long budget share", "long_budget_share", "{:.3f}"),
            ("long completion ratio", "long_completion_ratio", "{:.3f}"),
            ("short completion ratio", "short_completion_ratio", "{:.3f}"),
            ("jain (backlogged tenants)", "jain_backlogged", "{:.3f}"),
            ("queue wait p50 s", "queue_wait_p50_s", "{:.2f}"), ("queue wait p99 s", "queue_wait_p99_s", "{:.2f}"),
            ("decision latency p50 ms", "decision_latency_p50_ms", "{:.3f}"),
            ("decision latency p99 ms", "decision_latency_p99_ms", "{:.3f}"),
            ("max over-admit tokens", "max_overadmit_tokens", "{:,}"), ("utilization", "utilization", "{:.1%}"),
            ("admitted / offered", None, None)]
    for label, key, pattern in spec:
        if key is None:
            rows.append((label, *(f"{p['admitted']:,} / {p['offered']:,}" for p in pol)))
        else:
            rows.append((label, *(_f(p[key], pattern) for p in pol)))
    for t in report.workload.tenants:
        cells = []
        for p in pol:
            m = p["tenants"][t.name]
            ratio, backlog = _f(m["floor_ratio"], "{:.2f}"), _f(m["backlogged"], "{:.0%}")
            cells.append(f"{_f(m['share'])} ({ratio}x, backlog {backlog})")
        rows.append((f"tenant {t.name} share (floor {t.floor:g})", *cells))
    return rows


def format_table(report: AdmissionReport) -> str:
    w = report.workload
    rows = _rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(x) for c, x in zip(r[1:], widths[1:])]))
        if k == 0:
            lines.append("  ".join("-" * x for x in widths))
    title = (f"admission benchmark: {w.source}; {report.requests:,} requests over {w.duration_s:g}s, overload "
             f"{w.overload:g}x of {w.total_runtime_tokens:,} runtime tokens; long >= {w.long_threshold_tokens} tokens "
             f"({w.long_fraction:.0%} of the load), reserve {w.reserve_long_share:.0%}; count_fifo releases "
             f"{report.per_tick} per {w.tick_s:g}s tick")
    marks = {True: "ok", False: "MISSED", None: "n/a"}
    targets = [f"  [{marks[t['ok']]}] {name}: want {t['want']}, got {t['got']}"
               for name, t in report.targets().items()]
    foot = ("tenant cells: share of usage while backlogged (floor ratio, share of the window backlogged); "
            "definitions in sim/admission_metrics.py")
    return "\n".join([title, "", *lines, "", foot, "targets:", *targets])
