"""The slow-worker benchmark: how fast latency-tied health takes a slowed worker out of online work.

One worker of a simulated cluster runs at ``speed`` (a third: a noisy neighbour, a throttled GPU)
from ``slow_at`` for ``slow_for`` seconds, through :mod:`natsched.sim.des`'s ``speed_events`` (the
SimCore's runtime speed factor). The shipped router decides as it would live; the report says

- ``detect_s``: from the slowdown to the worker going half-open (the issue's target: <= 10 s);
- ``recover_s``: from the worker's recovery to it being healthy again (target: <= 30 s);
- the share of online requests routed to it before, while half-open, and after (a half-open
  worker keeps only short requests and a probe share);
- the cluster's TTFT percentiles with and without the health rule (``HealthSettings.enabled``),
  on the same arrivals.

Bounded by the worker's completion rate: the router judges completions (and requests overdue
past ``slow_factor`` x their prediction), so a worker that gets one request every few seconds is
judged after a few seconds more. ``natsched bench health`` prints the table and writes the JSON.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from natsched.router.health import HALF_OPEN, HEALTHY, HealthSettings
from natsched.sim.des import SimSettings, Simulator
from natsched.sim.errors import SimConfigError
from natsched.sim.trace import Trace

log = logging.getLogger(__name__)


@dataclass
class HealthBenchSettings:
    workers: int = 8
    speedup: float = 0.8  # the trace's arrival speed-up (0.8: ~45 % busy on 8 default workers)
    worker: int = 3  # index of the worker slowed down
    speed: float = 1 / 3
    slow_at: float = 400.0  # seconds after the first arrival
    slow_for: float = 60.0
    policy: str = "natsched"
    limit: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.worker < self.workers or not 0 < self.speed <= 1 or self.slow_for <= 0 or self.slow_at < 0:
            raise SimConfigError("health bench: 0 <= worker < workers, 0 < speed <= 1, slow_for > 0, slow_at >= 0")


def _run(trace: Trace, s: HealthBenchSettings, health: bool) -> tuple[Simulator, Any]:
    events = [(s.slow_at, s.worker, s.speed), (s.slow_at + s.slow_for, s.worker, 1.0)]
    settings = SimSettings(workers=s.workers, policy=s.policy, speed_events=events,
                           router={"health": HealthSettings(enabled=health)})
    sim = Simulator(trace, settings)
    return sim, sim.run()


def _share(records, wid: str, t0: float, lo: float, hi: float) -> float | None:
    routed = [r for r in records if r.routed is not None and lo <= r.routed - t0 < hi]
    return sum(r.worker == wid for r in routed) / len(routed) if routed else None


def run_health_benchmark(trace: Trace, s: HealthBenchSettings) -> dict[str, Any]:
    """Run the slowdown with and without the health rule; the report described in the module docstring."""
    if s.limit is not None:
        trace = trace.head(s.limit)
    trace = trace.scaled(s.speedup)
    if trace.duration < s.slow_at + s.slow_for:
        raise SimConfigError(f"the trace lasts {trace.duration:.0f} s at x{s.speedup:g}: too short for a slowdown "
                             f"at {s.slow_at:g} s for {s.slow_for:g} s")
    sim, res = _run(trace, s, health=True)
    _, base = _run(trace, s, health=False)
    wid = list(sim.workers)[s.worker]
    t0, end = sim.t0, s.slow_at + s.slow_for
    changes = [(t - t0, st) for t, w, st in res.health_changes if w == wid]
    opened = next((t for t, st in changes if st == HALF_OPEN and t >= s.slow_at), None)
    healed = next((t for t, st in changes if st == HEALTHY and t >= end), None)
    others = sum(1 for _, w, _ in res.health_changes if w != wid)
    m, mb = res.metrics(), base.metrics()
    return {
        "settings": asdict(s), "worker": wid,
        "detect_s": None if opened is None else round(opened - s.slow_at, 2),
        "recover_s": None if healed is None else round(healed - end, 2),
        "changes": [(round(t, 2), st) for t, st in changes], "other_workers_changes": others,
        "share_before": _share(res.records, wid, t0, s.slow_at - 60, s.slow_at),
        "share_half_open": _share(res.records, wid, t0, opened, end) if opened is not None else None,
        "share_after": _share(res.records, wid, t0, healed, healed + 60) if healed is not None else None,
        "ttft_p50_s": m["ttft_p50_s"], "ttft_p99_s": m["ttft_p99_s"],
        "ttft_p50_s_without": mb["ttft_p50_s"], "ttft_p99_s_without": mb["ttft_p99_s"],
    }


def format_health(r: dict[str, Any]) -> str:
    s = r["settings"]
    pct = (lambda v: "-" if v is None else f"{v:.1%}")
    sec = (lambda v: "never" if v is None else f"{v:.1f} s")
    return "\n".join([
        f"slow worker: {r['worker']} at {s['speed']:.3g}x speed from t={s['slow_at']:g} s for {s['slow_for']:g} s "
        f"({s['workers']} workers, policy {s['policy']}, speed-up {s['speedup']:g})",
        f"  half-open after  {sec(r['detect_s'])}   (target <= 10 s)",
        f"  healthy again    {sec(r['recover_s'])} after it recovered   (target <= 30 s)",
        f"  its share of routed requests: {pct(r['share_before'])} before, {pct(r['share_half_open'])} while "
        f"half-open, {pct(r['share_after'])} in the minute after",
        f"  other workers' health changes: {r['other_workers_changes']}",
        f"  TTFT p50 / p99: {r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f} s with the health rule, "
        f"{r['ttft_p50_s_without']:.3f} / {r['ttft_p99_s_without']:.3f} s without",
    ])
