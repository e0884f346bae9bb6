"""The canary comparison: a window's requests grouped by the routing policy that placed them.

A live routing policy and its canary (``natsched route set --canary P --canary-share S``) split
the requests by a hash of their id (:func:`natsched.router.core.in_canary`), so the two groups
are disjoint random samples of the same traffic: what differs between them beyond noise is
what the policies did. Every routing decision names its policy (``Decision.policy``); a
request's completion and its admission decision are joined to it by request id.

For each policy: requests routed, routing failures and completion errors, TTFT p50/p99, TPOT
p50, end-to-end p50/p99, queue wait p50/p99 and the prefix-cache hit ratio (cached / prompt
tokens of the completed requests). Against a baseline (the live policy): the difference and
its standard error, ``sqrt(se_a**2 + se_b**2)`` since the groups are independent; a
difference beyond :data:`CLEAR_SE` standard errors says which side is better, one within it
is ``level`` (no difference the window can show).

The standard errors are the usual large-sample ones, no resampling (the same window gives the
same answer): a percentile's from its distribution-free order-statistic interval (the ranks
``n q -/+ z sqrt(n q (1 - q))``, Conover, *Practical Nonparametric Statistics*, 3.2); the hit
ratio's from the ratio estimator's linearisation (Cochran, *Sampling Techniques*, 6.3); a
share's is binomial. Pure functions: decisions and completions in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from natsched.stats import percentile
from natsched.wire.schema import Completion, CompletionStatus, Decision

#: a difference within this many standard errors of zero ranks neither policy
CLEAR_SE = 2.0
#: the normal quantile of a 95 % interval: a percentile's standard error is its interval / (2 z)
Z95 = 1.959964
#: a request with no routing policy on record (a router older than the field)
UNKNOWN_POLICY = "?"


@dataclass
class PolicyGroup:
    """One policy's requests in the window: what was decided and how each ended."""

    policy: str
    routed: set[str] = field(default_factory=set)
    routing_failed: dict[str, int] = field(default_factory=dict)  # reason -> requests
    errors: dict[str, int] = field(default_factory=dict)  # completion error reason -> requests
    ok: list[Completion] = field(default_factory=list)
    queue_wait: list[float] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.routed) + sum(self.routing_failed.values())


def group(decisions: Iterable[Decision], completions: Iterable[Completion]) -> dict[str, PolicyGroup]:
    """Requests by the policy of their latest routing decision; each request's last completion
    (a rescued request's earlier attempt is not counted twice) and its admission queue wait."""
    decisions = sorted(decisions, key=lambda d: d.ts)
    policy_of: dict[str, str] = {}
    failed: dict[str, tuple[str, str]] = {}
    for d in decisions:
        if d.stage != "routing":
            continue
        name = d.policy or UNKNOWN_POLICY
        if d.decision == "assign":
            policy_of[d.request_id] = name
            failed.pop(d.request_id, None)
        elif d.decision == "fail":
            policy_of.pop(d.request_id, None)
            failed[d.request_id] = (name, d.reason or "error")
    groups: dict[str, PolicyGroup] = {}
    for rid, name in policy_of.items():
        groups.setdefault(name, PolicyGroup(name)).routed.add(rid)
    for name, reason in failed.values():
        g = groups.setdefault(name, PolicyGroup(name))
        g.routing_failed[reason] = g.routing_failed.get(reason, 0) + 1
    last: dict[str, Completion] = {}
    for c in sorted(completions, key=lambda c: c.ts):
        if c.request_id in policy_of:
            last[c.request_id] = c
    for rid, c in last.items():
        g = groups[policy_of[rid]]
        if c.status == CompletionStatus.OK:
            g.ok.append(c)
        else:
            g.errors[c.reason or "error"] = g.errors.get(c.reason or "error", 0) + 1
    waits: dict[str, float] = {}
    for d in decisions:
        if d.stage == "admission" and d.decision == "allow" and d.request_id in policy_of:
            waits[d.request_id] = d.queue_wait or 0.0
    for rid, wait in waits.items():
        groups[policy_of[rid]].queue_wait.append(wait)
    return dict(sorted(groups.items()))


# ------------------------------------------------------------------ estimates and their errors

def percentile_se(values: list[float], q: float) -> float | None:
    """The standard error of the ``q`` percentile (0..100): its 95 % order-statistic interval,
    read at the ranks ``n p -/+ z sqrt(n p (1 - p))``, over ``2 z``. None below two values."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    n = len(xs)
    if n < 2:
        return None
    p = q / 100.0
    half = Z95 * math.sqrt(n * p * (1.0 - p))
    lo = max(0, math.floor(n * p - half) - 1)  # 1-based rank -> index
    hi = min(n - 1, math.ceil(n * p + half) - 1)
    return (xs[hi] - xs[lo]) / (2.0 * Z95)


def ratio_se(num: list[float], den: list[float]) -> float | None:
    """The standard error of ``sum(num) / sum(den)`` over paired per-request values (the ratio
    estimator's linearisation). None below two requests or with no denominator."""
    n = len(den)
    total = sum(den)
    if n < 2 or total <= 0:
        return None
    r = sum(num) / total
    var = sum((a - r * b) ** 2 for a, b in zip(num, den)) / (n * (n - 1))
    return math.sqrt(var) / (total / n)


def share_se(k: int, n: int) -> float | None:
    """The binomial standard error of ``k / n``; None for no trials."""
    if n <= 0:
        return None
    p = k / n
    return math.sqrt(p * (1.0 - p) / n)


@dataclass(frozen=True)
class Metric:
    """One row of the comparison: how to read it off a group, and which direction is better."""

    key: str
    label: str
    read: Callable[[PolicyGroup], tuple[float | None, float | None]]  # (value, standard error)
    higher_is_better: bool = False
    unit: str = "s"  # s | ratio | count


def _pct(attr: str, q: float) -> Callable[[PolicyGroup], tuple[float | None, float | None]]:
    def read(g: PolicyGroup) -> tuple[float | None, float | None]:
        values = list(_values(g, attr))
        return percentile(values, q), percentile_se(values, q)
    return read


def _values(g: PolicyGroup, attr: str) -> Iterable[float]:
    if attr == "queue_wait":
        return g.queue_wait
    return (getattr(c, attr) for c in g.ok if getattr(c, attr) is not None)


def _hit(g: PolicyGroup) -> tuple[float | None, float | None]:
    cached = [float(c.cached_tokens) for c in g.ok]
    prompt = [float(c.prompt_tokens) for c in g.ok]
    total = sum(prompt)
    return (sum(cached) / total if total else None), ratio_se(cached, prompt)


def _failed(g: PolicyGroup) -> tuple[float | None, float | None]:
    bad = sum(g.routing_failed.values()) + sum(g.errors.values())
    ended = bad + len(g.ok)
    return (bad / ended if ended else None), share_se(bad, ended)


METRICS: tuple[Metric, ...] = (
    Metric("ttft_p50_s", "TTFT p50", _pct("ttft", 50)),
    Metric("ttft_p99_s", "TTFT p99", _pct("ttft", 99)),
    Metric("tpot_p50_s", "TPOT p50", _pct("tpot", 50)),
    Metric("e2e_p50_s", "e2e p50", _pct("e2e", 50)),
    Metric("e2e_p99_s", "e2e p99", _pct("e2e", 99)),
    Metric("queue_wait_p50_s", "queue wait p50", _pct("queue_wait", 50)),
    Metric("queue_wait_p99_s", "queue wait p99", _pct("queue_wait", 99)),
    Metric("hit_ratio", "hit ratio", _hit, higher_is_better=True, unit="ratio"),
    Metric("failed_share", "failed share", _failed, unit="ratio"),
)


def verdict(diff: float | None, se: float | None, higher_is_better: bool) -> str:
    """``better`` / ``worse`` (the compared policy against the baseline) only beyond
    :data:`CLEAR_SE` standard errors; else ``level``. No error to judge by: ``level``."""
    if diff is None or se is None or abs(diff) <= CLEAR_SE * se:
        return "level"
    return "better" if (diff > 0) == higher_is_better else "worse"


def describe(g: PolicyGroup) -> dict[str, Any]:
    """A policy's counts and every metric with its standard error."""
    out: dict[str, Any] = {
        "policy": g.policy, "requests": g.requests, "routed": len(g.routed), "completed": len(g.ok),
        "routing_failed": dict(sorted(g.routing_failed.items())), "errors": dict(sorted(g.errors.items())),
        "in_flight": len(g.routed) - len(g.ok) - sum(g.errors.values()),
    }
    for m in METRICS:
        value, se = m.read(g)
        out[m.key] = value
        out[m.key + "_se"] = se
    return out


def compare(groups: dict[str, PolicyGroup], baseline: str | None = None) -> dict[str, Any]:
    """Every policy's numbers and, for each other policy, its difference from the baseline.

    The baseline is ``baseline`` when it routed anything in the window, else the policy with
    the most requests (ties: by name)."""
    rows = {name: describe(g) for name, g in groups.items()}
    if baseline not in rows:
        baseline = max(rows, key=lambda n: (rows[n]["requests"], n), default=None) if rows else None
    diffs: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        if name == baseline:
            continue
        base = rows[baseline]
        per: dict[str, Any] = {}
        for m in METRICS:
            a, b = row[m.key], base[m.key]
            sa, sb = row[m.key + "_se"], base[m.key + "_se"]
            diff = a - b if a is not None and b is not None else None
            se = math.hypot(sa, sb) if sa is not None and sb is not None else None
            per[m.key] = {"diff": diff, "se": se, "verdict": verdict(diff, se, m.higher_is_better)}
        diffs[name] = per
    return {"baseline": baseline, "policies": rows, "vs_baseline": diffs}


# ------------------------------------------------------------------ the table

def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ratio":
        return f"{value:.1%}"
    return f"{value * 1000:.1f}ms" if abs(value) < 1.0 else f"{value:.3f}s"


def _pm(value: float | None, se: float | None, unit: str, signed: bool = False) -> str:
    if value is None:
        return "-"
    text = _num(value, unit)
    if signed and value >= 0:
        text = "+" + text
    return text if se is None else f"{text} ±{_num(se, unit)}"


def format_table(report: dict[str, Any], when: Callable[[float | None], str]) -> str:
    """The comparison for the terminal: one column per policy (the baseline first, each value
    with its standard error), then each other policy's difference from it and the verdict."""
    rows, base, diffs = report["policies"], report["baseline"], report["vs_baseline"]
    window = f"{when(report['since'])} .. {when(report['until']) if report['until'] else 'now'}"
    lines = [f"window {window}, tenant {report['tenant'] or 'all'}: requests by routing policy"]
    cfg = report.get("config")
    if cfg:
        canary = (f", canary {cfg['canary']} on {float(cfg.get('canary_share') or 0):.0%}" if cfg.get("canary")
                  else ", no canary")
        lines.append(f"routing config in force (revision {cfg['revision']}): live {cfg['policy']}{canary}")
    if report.get("note"):
        lines.append(f"note: {report['note']}")
    if not rows:
        lines.append("no routing decision in the window")
        return "\n".join(lines)
    order = [base] + [n for n in rows if n != base]
    head = ["", *(f"{n} (baseline)" if n == base else n for n in order), *(f"{n} - {base}" for n in order[1:])]
    table = [head]
    for key, label in (("requests", "requests"), ("completed", "completed"), ("in_flight", "in flight")):
        table.append([label, *(str(rows[n][key]) for n in order), *("" for _ in order[1:])])
    table.append(["failed", *(_failures(rows[n]) for n in order), *("" for _ in order[1:])])
    for m in METRICS:
        cells = [m.label, *(_pm(rows[n][m.key], rows[n][m.key + "_se"], m.unit) for n in order)]
        for n in order[1:]:
            d = diffs[n][m.key]
            cells.append("-" if d["diff"] is None else f"{_pm(d['diff'], d['se'], m.unit, True)} {d['verdict']}")
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
           for r in table]
    out.insert(1, "  ".join("-" * w for w in widths))
    lines += out
    lines.append(f"± one standard error; a difference beyond {CLEAR_SE:g} of them is better/worse, else level")
    return "\n".join(lines)


def _failures(row: dict[str, Any]) -> str:
    why = {**row["routing_failed"]}
    for reason, n in row["errors"].items():
        why[reason] = why.get(reason, 0) + n
    total = sum(why.values())
    return str(total) + (" (" + ", ".join(f"{r} {n}" for r, n in sorted(why.items())) + ")" if why else "")
