"""Judging a routing policy on more than one run: a sweep of speed-ups, means, and the targets.

Why: on the Mooncake trace a 1 % change of the speed-up moves a cache-aware policy's hit ratio
by 0.3-0.5 points and its TTFT p99 by up to 10 % (which long prompts happen to meet a busy
holder changes), more than the differences between the best policies. One run therefore says
little about which policy is better; the mean over a band of loads does, and how often a policy
wins point by point says how robust that is. ``natsched bench routing --sweep N`` runs every
policy at N speed-ups spread over ±``span`` around the chosen one (the chosen one included when
N is odd) and reports both.
"""

from __future__ import annotations

import statistics
from typing import Any

OURS = "natsched"
BASELINE = "least_loaded"  # the load-balance reference of the load-CV target
MEANED = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "tpot_p50_s", "hit_ratio",
          "throughput_tok_s", "load_cv", "migration_rate", "busy")


def sweep_speedups(center: float, points: int, span: float) -> list[float]:
    """``points`` speed-ups evenly spread over ``center`` x [1 - span, 1 + span]."""
    if points <= 1:
        return [center]
    return [center * (1 - span + 2 * span * i / (points - 1)) for i in range(points)]


def targets(policies: dict[str, dict[str, Any]], ours: str = OURS, baseline: str = BASELINE,
            cv_margin: float = 0.1) -> dict[str, Any]:
    """The routing targets of one result (or of means): ours against every other policy.

    ``ttft_p50`` / ``ttft_p99``: lower than every peer's; ``hit_ratio``: at least the best peer's;
    ``load_cv``: at most ``baseline``'s + ``cv_margin``. Empty when ``ours`` or no peer ran.
    """
    peers = {n: m for n, m in policies.items() if n != ours}
    if ours not in policies or not peers:
        return {}
    me = policies[ours]
    best_hit = max(peers, key=lambda n: peers[n]["hit_ratio"])
    out: dict[str, Any] = {
        "ttft_p50": all(me["ttft_p50_s"] < m["ttft_p50_s"] for m in peers.values()),
        "ttft_p99": all(me["ttft_p99_s"] < m["ttft_p99_s"] for m in peers.values()),
        "hit_ratio": me["hit_ratio"] >= peers[best_hit]["hit_ratio"],
        "best_peer_hit": best_hit,
        "hit_ratio_gap": me["hit_ratio"] - peers[best_hit]["hit_ratio"],
    }
    if baseline in peers:
        out["load_cv"] = me["load_cv"] <= peers[baseline]["load_cv"] + cv_margin
    return out


def summarize(runs: dict[float, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Means per policy over the sweep, the targets on the means, and point-by-point wins."""
    names = list(next(iter(runs.values())))
    mean = {n: {k: statistics.fmean(r[n][k] for r in runs.values()) for k in MEANED} for n in names}
    for n in names:
        mean[n]["hit_ratio_stdev"] = statistics.pstdev(r[n]["hit_ratio"] for r in runs.values())
    per_point = [targets(r) for r in runs.values()]
    wins = {k: sum(1 for t in per_point if t.get(k)) for k in ("ttft_p50", "ttft_p99", "hit_ratio", "load_cv")}
    return {
        "speedups": list(runs), "points": len(runs), "mean": mean, "targets_on_mean": targets(mean),
        "wins": wins, "paired": paired(runs, mean), "runs": {f"{s:.6g}": r for s, r in runs.items()},
    }


#: metric -> True when higher is better
PAIRED = {"ttft_p50_s": False, "ttft_p99_s": False, "hit_ratio": True}
#: a paired difference within this many standard errors of zero ranks neither policy
LEVEL_SE = 2.0


def verdict(mean_diff: float, se: float | None, higher_is_better: bool) -> str:
    """``ahead``, ``behind`` or ``level``: the sign of the difference only where it is beyond
    ``LEVEL_SE`` standard errors. Why: the targets compare means, and a mean ahead by less than its
    noise is a tie that a 0.01 % change of load can turn round. One load has no spread to measure
    (``se`` None), so it ranks nothing: ``level``."""
    if se is None or abs(mean_diff) <= LEVEL_SE * se:
        return "level"
    better = mean_diff > 0 if higher_is_better else mean_diff < 0
    return "ahead" if better else "behind"


def paired(runs: dict[float, dict[str, dict[str, Any]]], mean: dict[str, dict[str, float]],
           ours: str = OURS) -> dict[str, dict[str, Any]]:
    """Ours minus the closest peer (the best one on the means), load by load: the mean difference
    and its standard error. Every policy meets the same arrivals at each load, so the pairs cancel
    what the load itself does; a difference within about two standard errors is not a ranking."""
    peers = [n for n in mean if n != ours]
    if ours not in mean or not peers:
        return {}
    out = {}
    for key, higher in PAIRED.items():
        peer = (max if higher else min)(peers, key=lambda n: mean[n][key])
        diffs = [r[ours][key] - r[peer][key] for r in runs.values()]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
        diff = statistics.fmean(diffs)
        out[key] = {"peer": peer, "mean_diff": diff, "se": se, "verdict": verdict(diff, se, higher)}
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The means table and the verdicts, for the terminal."""
    head = ("policy", "ttft p50", "p99", "hit", "hit sd", "load cv")
    rows = [head] + [(n, f"{m['ttft_p50_s']:.3f}", f"{m['ttft_p99_s']:.3f}", f"{m['hit_ratio']:.2%}",
                      f"{m['hit_ratio_stdev']:.2%}", f"{m['load_cv']:.3f}") for n, m in summary["mean"].items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = summary["speedups"]
    title = f"sweep: means over {summary['points']} speed-ups x{min(s):.4g} .. x{max(s):.4g}"
    n, w = summary["points"], summary["wins"]
    verdict = [] if not summary["targets_on_mean"] else [
        format_targets(summary["targets_on_mean"], "on the means"),
        f"met point by point: ttft p50 {w['ttft_p50']}/{n}, ttft p99 {w['ttft_p99']}/{n}, hit ratio "
        f"{w['hit_ratio']}/{n}, load cv {w['load_cv']}/{n}",
    ]
    if summary.get("paired"):
        verdict.append(format_paired(summary["paired"], n))
    return "\n".join([title, "", *lines, "", *verdict])


def format_paired(pairs: dict[str, dict[str, Any]], n: int) -> str:
    """One line: ours minus the closest peer per metric, mean ± standard error, and the verdict."""
    def cell(key: str, label: str, pct: bool) -> str:
        p = pairs[key]
        scale, unit, digits = (100, " points", 2) if pct else (1, " s", 3)
        se = "" if p["se"] is None else f" ± {p['se'] * scale:.{digits}f}"
        return f"{label} {p['mean_diff'] * scale:+.{digits}f}{unit}{se} vs {p['peer']} ({p['verdict']})"
    return (f"{OURS} minus the closest peer, mean ± standard error over {n} loads (level: within "
            f"{LEVEL_SE:g} standard errors): "
            + ", ".join([cell("ttft_p50_s", "ttft p50", False), cell("ttft_p99_s", "ttft p99", False),
                         cell("hit_ratio", "hit ratio", True)]))


def format_targets(t: dict[str, Any], label: str) -> str:
    """One line: each target met or MISSED (``t`` from :func:`targets`, non-empty)."""
    return (f"targets {label}: ttft p50 {_ok(t['ttft_p50'])}, ttft p99 {_ok(t['ttft_p99'])}, hit ratio "
            f"{_ok(t['hit_ratio'])} ({t['hit_ratio_gap']:+.2%} vs {t['best_peer_hit']}), "
            f"load cv {_ok(t.get('load_cv'))}")


def _ok(value: bool | None) -> str:
    return "-" if value is None else ("met" if value else "MISSED")
