"""The admission benchmark's metrics, computed from a :class:`~natsched.sim.admission_sim.Ledger`.

All integrals run over the arrival window ``[0, duration_s)``; *usage* is in-flight runtime tokens.

- ``long_token_share``: of the runtime tokens admitted by decisions taken while long *and* short
  requests were both queued (checked just before each arrival's decision and each dequeue plan),
  the share that went to long requests. ``null`` when both kinds were never queued at once.
  ``long_budget_share`` is the same question asked of the in-flight budget: the long requests'
  share of usage integrated over the time both kinds were queued.
- ``long_completion_ratio`` / ``short_completion_ratio``: admitted (all admitted requests run to
  completion) / offered, by size class.
- ``tenants[name]``: ``share`` = the tenant's usage / all usage, integrated over the time the
  tenant had queued requests (over the whole window when that time is under 5 % of it);
  ``floor``; ``demand`` = its offered load / capacity (``rate_share × overload``);
  ``floor_ratio`` = share / floor when demand >= floor; a tenant that asks for less than its
  floor is entitled to all it asks for, so then ``floor_ratio`` = its served load / its offered
  load (load = Σ cost × hold); ``null`` for a zero floor. 1.0 = it got its entitlement.
  ``backlogged`` = share of the window it had queued requests.
- ``jain_backlogged``: Jain's index, (Σx)² / (n·Σx²), over the tenants backlogged at least half
  of the window, of x = share / entitlement, the entitlement being the floor plus the idle share
  (1 − their floors) split by weight among them. 1.0 = each got exactly its entitlement.
- ``queue_wait_p50_s`` / ``queue_wait_p99_s``: admission time − arrival over admitted requests
  (0 for those admitted on arrival).
- ``decision_latency_p50_ms`` / ``p99_ms``: wall time of each policy call: evaluate + apply for
  an arrival, plan + commit for a dequeue (dequeues of an empty queue are not counted).
- ``max_overadmit_tokens``: max over time of usage − total, never below 0.
"""

from __future__ import annotations

from typing import Any

from natsched.sim.admission_sim import Ledger
from natsched.sim.admission_workload import AdmissionWorkload
from natsched.sim.metrics import percentile

BACKLOGGED_FRACTION = 0.5  # a tenant counts as backlogged when it had queued work this share of the window
SHARE_MIN_FRACTION = 0.05  # below this, a tenant's share is taken over the whole window


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def tenant_metrics(ledger: Ledger, w: AdmissionWorkload) -> dict[str, dict[str, Any]]:
    out = {}
    for t in w.tenants:
        back = ledger.back_time[t.name] / w.duration_s
        if back >= SHARE_MIN_FRACTION:
            share = _ratio(ledger.back_tenant[t.name], ledger.back_used[t.name])
        else:
            share = _ratio(ledger.tenant_int[t.name], ledger.used_int)
        demand = t.rate_share * w.overload
        if t.floor <= 0 or share is None:
            ratio = None
        elif demand >= t.floor:
            ratio = share / t.floor
        else:
            ratio = _ratio(ledger.tenant_served_load[t.name], ledger.tenant_offered_load[t.name])
        out[t.name] = {
            "share": _round(share), "floor": t.floor, "demand": _round(demand), "floor_ratio": _round(ratio),
            "backlogged": _round(back),
            "completion_ratio": _round(_ratio(ledger.tenant_admitted[t.name], ledger.tenant_offered[t.name])),
        }
    return out


def jain_backlogged(tenants: dict[str, dict[str, Any]], w: AdmissionWorkload) -> float | None:
    names = [t for t in w.tenants if (tenants[t.name]["backlogged"] or 0) >= BACKLOGGED_FRACTION
             and tenants[t.name]["share"] is not None]
    if not names:
        return None
    idle = max(0.0, 1.0 - sum(t.floor for t in names))
    weights = sum(t.weight for t in names)
    xs = []
    for t in names:
        entitled = t.floor + (idle * t.weight / weights if weights > 0 else 0.0)
        if entitled > 0:
            xs.append(tenants[t.name]["share"] / entitled)
    if not xs or not any(xs):
        return None
    return round(sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)), 4)


def summarize(ledger: Ledger, w: AdmissionWorkload, wall_s: float) -> dict[str, Any]:
    tenants = tenant_metrics(ledger, w)
    long_share = _ratio(ledger.both_admit_long, ledger.both_admit_tokens)
    return {
        "long_token_share": _round(long_share),
        "long_budget_share": _round(_ratio(ledger.both_long, ledger.both_used)),
        "long_completion_ratio": _round(_ratio(ledger.admitted[True], ledger.offered[True])),
        "short_completion_ratio": _round(_ratio(ledger.admitted[False], ledger.offered[False])),
        "tenants": tenants,
        "jain_backlogged": jain_backlogged(tenants, w),
        "queue_wait_p50_s": _round(percentile(ledger.waits, 50), 3),
        "queue_wait_p99_s": _round(percentile(ledger.waits, 99), 3),
        "decision_latency_p50_ms": _round(percentile(ledger.latencies_ms, 50), 4),
        "decision_latency_p99_ms": _round(percentile(ledger.latencies_ms, 99), 4),
        "max_overadmit_tokens": max(0, ledger.max_overadmit),
        "utilization": _round(ledger.used_int / (w.total_runtime_tokens * w.duration_s)),
        "both_backlogged_s": _round(ledger.both_time, 2),
        "offered": sum(ledger.offered.values()),
        "admitted": sum(ledger.admitted.values()),
        "outcomes": dict(sorted(ledger.outcomes.items())),
        "decisions_timed": len(ledger.latencies_ms),
        "wall_s": round(wall_s, 2),
    }
