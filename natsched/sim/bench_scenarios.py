"""``natsched bench scenarios``: every contender through every scenario, on identical arrivals.

For each scenario (:mod:`natsched.sim.scenario`) the requests are built once per load — from the
trace at each ``target_busy`` (the speed-up calibrated under ``least_loaded``, as ``bench routing``
does) or from the generator at the sweep's loads around its base rate (calibrated the same way
when the file gives ``target_busy``) — and every contender (:mod:`natsched.sim.contenders`)
replays them with the same worker events, in a process pool. Each run is summarised by
:func:`run_metrics`; each scenario by its headline metric per contender (mean over the loads),
natsched ÷ the best peer, and the paired verdict of :mod:`natsched.sim.sweep` (natsched minus
that peer, load by load: ``ahead`` / ``behind`` beyond two standard errors, else ``level``).

Runs are bit-for-bit reproducible: same files, same flags, same numbers (wall times aside).
"""

from __future__ import annotations

import dataclasses
import math
import queue as queue_mod
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from natsched.sim.contenders import CONTENDERS, MIGRATIONS, RESCUE_S, make_gate
from natsched.sim.des import ClientRetry, SimSettings, WorkerEvent, WorkerSpec, simulate
from natsched.sim.errors import ScenarioError
from natsched.sim.ideal import fastest_per_model, ideal_cached, ideal_ttfts
from natsched.sim.metrics import percentile, summarize
from natsched.sim.pool import context, make_pool
from natsched.sim.progress import Progress
from natsched.sim.scenario import Scenario
from natsched.sim.sweep import verdict
from natsched.sim.tails import ALL as WHOLE_TAIL, merge_tails, tail_split
from natsched.sim.trace import MOONCAKE_TRACE, Trace, load_mooncake
from natsched.sim.traffic import generate, session_rate_for

OURS = "natsched"
CALIB_TOL = 0.015  # busy within this of the target
CALIB_ROUNDS = 5
# --quick, within 3 minutes on two shared cores: every time x the file's quick.scale, the first
# requests of a trace, the two outer loads of the sweep (a paired verdict needs two), and not the
# variants of natsched itself that are shown but never judged (unless --contenders names them)
QUICK_TRACE_LIMIT = 750
QUICK_POINTS = 2
QUICK_SKIP = ("natsched-noadmit",)


#: the router of the load yardstick and the capacity probe (least_loaded): a rule natsched's router
#: adds later must not move the loads every contender is measured at (natsched's panic threshold)
YARDSTICK_ROUTER = {"panic_threshold": 0.0}


@dataclass
class SuiteSettings:
    jobs: int = 2
    quick: bool = False
    sweep: int | None = None  # points per scenario (None: the file's)
    only: list[str] | None = None
    progress: bool = True
    contenders: list[str] | None = None
    #: traffic draws per load of a generated scenario (seed, seed + 1, ...): the verdict is paired
    #: over loads x seeds. A tail percentile of a few hundred requests is set by two or three of
    #: them, so one draw per load can rank two policies by which of them met an unlucky session;
    #: a trace's arrivals are the data and are not redrawn (one replicate)
    seeds: int = 1


# ------------------------------------------------------------------ building a scenario's runs


def worker_specs(sc: Scenario) -> tuple[WorkerSpec, ...]:
    return tuple(WorkerSpec(sc.profile(g.profile), g.model, g.kv_blocks, g.max_num_seqs)
                 for g in sc.workers for _ in range(g.count))


def worker_events(sc: Scenario) -> tuple[WorkerEvent, ...]:
    out = []
    for e in sc.events:
        if e.kind == "add":
            out += [WorkerEvent(e.at_s, "add", spec=WorkerSpec(sc.profile(e.profile), e.model))] * e.count
        else:
            out.append(WorkerEvent(e.at_s, e.kind, e.worker, factor=e.factor, duration_s=e.duration_s))
    return tuple(out)


def sim_settings(sc: Scenario, policy: str, rescue: bool, events: bool = True,
                 router: dict | None = None) -> SimSettings:
    """``router``: RouterSettings fields of the contender (:meth:`natsched.sim.contenders.Contender.router_settings`)."""
    return SimSettings(policy=policy, worker_specs=worker_specs(sc), events=worker_events(sc) if events else (),
                       client_retry=ClientRetry(), rescue_s=RESCUE_S if rescue else None,
                       migrate=MIGRATIONS if rescue else 0, seed=sc.seed,
                       router=dict(router or {}))


def yardstick_settings(sc: Scenario) -> SimSettings:
    """The load yardstick's and the capacity probe's run: least_loaded, no rescue, no events."""
    return sim_settings(sc, "least_loaded", False, events=False, router=YARDSTICK_ROUTER)


def drawn(sc: Scenario, seed: int | None) -> Scenario:
    """``sc`` as the draw ``seed`` (--seeds; None: the file's own)."""
    return sc if seed is None or seed == sc.seed else dataclasses.replace(sc, seed=seed)


def _busy(trace: Trace, sc: Scenario) -> float:
    """A trace's load yardstick: the mean busy share of the workers under least_loaded, no admission,
    no events (the routing benchmark's)."""
    return simulate(trace, yardstick_settings(sc)).metrics()["busy"]


def _secant(target: float, measure, x0: float, known: dict[float, float] | None = None) -> float:
    """The x (> 0) at which ``measure(x)`` (rising) is ``target``: a secant in log space.

    ``known`` (x -> measure(x)) is shared between the targets of one trace: a point measured for
    one target is not measured again, and the secant starts from the two known points nearest to
    the new target (the 80 % load starts between the 70 % load's points): half the runs."""
    known = {} if known is None else known

    def at(x: float) -> float:
        if x not in known:
            known[x] = measure(x)
        return known[x]

    if len(known) >= 2:
        near = sorted(known.items(), key=lambda p: abs(p[1] - target))[:2]
        pts = sorted(near, key=lambda p: p[1])
        if abs(pts[0][1] - target) <= CALIB_TOL:
            return pts[0][0]
    else:
        pts = [(x0, at(x0))]
        x1 = x0 * target / max(pts[0][1], 1e-3)
        pts.append((x1, at(x1)))
    for _ in range(CALIB_ROUNDS):
        best = min(pts, key=lambda p: abs(p[1] - target))
        if abs(best[1] - target) <= CALIB_TOL:
            return best[0]
        (xa, ya), (xb, yb) = pts[-2], pts[-1]
        if yb == ya:
            x = xb * target / max(yb, 1e-3)
        else:
            lx = math.log(xa) + (target - ya) * (math.log(xb) - math.log(xa)) / (yb - ya)
            x = math.exp(max(math.log(xb) - 1.0, min(math.log(xb) + 1.0, lx)))
        pts.append((x, at(x)))
    return min(pts, key=lambda p: abs(p[1] - target))[0]


@dataclass
class Load:
    label: str
    trace: Trace
    speed: float  # speed-up (trace) or start rate (generator)
    seed: int | None = None  # the draw's seed when it is not the scenario's (--seeds)


def time_scaled(sc: Scenario, f: float) -> Scenario:
    """``sc`` with every time in it (duration, bursts, events, phases) times ``f``: a shorter run
    with the same story (--quick)."""
    t = sc.traffic
    traffic = dataclasses.replace(t, duration_s=t.duration_s * f, bursts=[
        dataclasses.replace(b, at_s=b.at_s * f, duration_s=b.duration_s * f) for b in t.bursts])
    events = [dataclasses.replace(e, at_s=e.at_s * f, duration_s=None if e.duration_s is None else e.duration_s * f)
              for e in sc.events]
    return dataclasses.replace(sc, traffic=traffic, events=events, phases=[p * f for p in sc.phases])


def build_loads(sc: Scenario, s: SuiteSettings) -> list[Load]:
    """The requests of every load of ``sc`` (calibrated where the file asks for a busy share);
    ``sc`` is already time-scaled for --quick."""
    points = s.sweep or sc.sweep_points
    t = sc.traffic
    targets = list(t.target_busy)
    if s.quick and s.sweep is None:
        points = min(points, QUICK_POINTS)
        if len(targets) > QUICK_POINTS:
            targets = [targets[0], targets[-1]]
    spread = [1.0] if points <= 1 else [1 - sc.sweep_span + 2 * sc.sweep_span * i / (points - 1)
                                        for i in range(points)]
    if t.trace is not None:
        path = MOONCAKE_TRACE if t.trace == "mooncake" else Path(t.trace)
        if not path.is_absolute() and t.trace != "mooncake":
            path = Path(sc.source).parent / path
        limit = t.limit
        if s.quick:
            limit = min(limit or QUICK_TRACE_LIMIT, QUICK_TRACE_LIMIT)
        base = load_mooncake(str(path), limit=limit)
        sc.block_size = base.block_size
        loads, known = [], {}
        for busy in targets:
            speed = _secant(busy, lambda x: _busy(base.scaled(x), sc), 1.0, known)
            loads += [Load(f"busy{busy:g}" + (f"x{f:.3g}" if points > 1 else ""), base.scaled(speed * f), speed * f)
                      for f in spread]
        return loads
    rate = t.rate_rps if t.rate_rps is not None else capacity_rate(sc, t.load)
    # the rate is calibrated once (on the file's seed): every draw offers the same load
    draws = [sc.seed + k for k in range(max(1, s.seeds))]
    return [Load(f"load{f:.3g}" + (f"-s{seed}" if len(draws) > 1 else ""), generate(drawn(sc, seed), f, rate),
                 rate * f, None if seed == sc.seed else seed)
            for f in spread for seed in draws]


PROBE_S = 120.0  # the capacity probe's arrival window (at most)


def capacity_rate(sc: Scenario, load: float) -> float:
    """The session start rate whose requests offer ``load`` x the cluster's capacity.

    Capacity is measured, not guessed: the traffic (no bursts, no events) is offered well beyond
    what the cluster serves, under least_loaded with no admission, and the requests completed
    per second inside the arrival window are the service rate. The start rate then scales to
    ``load`` x that rate in offered requests per second. One run (two when the first was not
    overloaded)."""
    t = sc.traffic
    calm = dataclasses.replace(sc, traffic=dataclasses.replace(t, bursts=[], duration_s=min(t.duration_s, PROBE_S)),
                               events=[])
    rate = 3.0 * session_rate_for(sc)
    for _ in range(4):
        trace = generate(calm, 1.0, rate)
        offered = len(trace) / calm.traffic.duration_s
        res = simulate(trace, yardstick_settings(calm))
        t0 = res.records[0].arrival - trace.requests[0].arrival if res.records else 0.0
        end = t0 + calm.traffic.duration_s
        served = sum(1 for r in res.records if r.status == "ok" and r.finish <= end) / calm.traffic.duration_s
        if offered >= 1.5 * served and served > 0:
            return rate * load * served / offered
        rate *= 3.0
    raise ScenarioError(sc.source, "traffic.load", f"could not overload the cluster to measure its capacity "
                        f"(offered {offered:.2f}/s, served {served:.2f}/s)")


# ------------------------------------------------------------------ one run


def run_metrics(sc: Scenario, result, trace: Trace) -> dict[str, Any]:
    """The scenario metrics of one run (see docs/scenarios.md for each definition)."""
    recs = result.records
    m = summarize(recs, result.busy_time, result.busy_window, result.window)
    t0 = recs[0].arrival - trace.requests[0].arrival if recs else 0.0
    ok = [r for r in recs if r.status == "ok"]
    online = [r for r in ok if r.cls == "online"]
    slo = sc.slo_ttft_s.get("online")
    window = max(result.window, 1e-9)
    out: dict[str, Any] = {k: m[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_ratio", "busy",
                                             "completed", "rejected", "failed", "throughput_tok_s")}
    out["requests"] = len(recs)
    out["online_ttft_p99_s"] = percentile([r.first_token - r.arrival for r in online], 99)
    # ... of what was served on the online path (degraded work is completed later, on purpose)
    out["online_ttft_p99_served_s"] = percentile([r.first_token - r.arrival for r in online if not r.degraded], 99)
    out["refusals"] = sum(r.refused for r in recs)
    out["refusals_retry_after"] = sum(r.refused_retry_after for r in recs)
    out["retries"] = sum(r.attempts - 1 for r in recs)
    out["degraded_completed"] = sum(1 for r in ok if r.degraded)
    out["rescued"] = sum(r.rescued for r in recs)
    out["migrated"] = sum(r.migrated for r in recs)
    out["lost"] = m["failed"]
    out["batch_completed"] = sum(1 for r in ok if r.cls == "batch")
    out["offline_completed"] = sum(1 for r in ok if r.cls == "offline")
    if slo is not None:
        good = [r for r in online if r.first_token - r.arrival <= slo]
        out["online_goodput_all"] = len(good) / window
        out["online_slo_share"] = len(good) / max(1, sum(1 for r in recs if r.cls == "online"))
        out.update(_burst_goodput(sc, good, t0))
        out.update(_goodput_ceiling(sc, recs, t0, slo, window))
        out["online_goodput"] = out.get("goodput_bursts_and_after", out["online_goodput_all"])
        out["goodput_series"] = _series(good, t0, window)
        out["floor_ratios"] = _floor_ratios(sc, good, recs)
    if sc.phases:
        out["phases"] = _phases(sc, ok, t0)
        vals = [p["ttft_p99_s"] for p in out["phases"] if p["ttft_p99_s"] is not None]
        out["phase_ttft_p99_s"] = max(vals) if vals else None
        for i, ph in enumerate(out["phases"]):
            out[phase_key(i)] = ph["ttft_p99_s"]  # judged one by one: "ahead in every phase"
    if any(e.kind == "add" for e in sc.events):
        out["fair_share_s"] = _fair_share_time(sc, recs, t0, sc.n_workers)
    cached = ideal_cached(trace.requests, trace.block_size)
    floors = ideal_floors(sc, trace, cached)
    out.update(ideal_metrics(sc, trace, floors))
    out["tail"] = tail_split(recs, {r.index: r.model or "default" for r in trace.requests}, floors, cached,
                             result.profiles)
    return out


def ideal_floors(sc: Scenario, trace: Trace, cached: dict[int, int] | None = None) -> dict[int, float]:
    """Request index -> its ideal TTFT on the scenario's cluster (sim/ideal.py; every worker it ever
    has counts, added ones included); ``cached``: the trace's :func:`ideal_cached`, if at hand."""
    specs = [*worker_specs(sc), *(e.spec for e in worker_events(sc) if e.kind == "add")]
    fastest = fastest_per_model((s.model, s.engine_profile()) for s in specs)
    return ideal_ttfts(trace.requests, trace.block_size, fastest, cached=cached)


def ideal_metrics(sc: Scenario, trace: Trace, floors: dict[int, float]) -> dict[str, float | None]:
    """``ideal_<metric>``: each TTFT metric of the run computed on the requests' ideal TTFTs
    (``floors``) instead of their TTFTs: a floor under every contender's value, the same for all
    of a cell (it depends on the arrivals and the cluster's profiles alone)."""
    vals = list(floors.values())
    out: dict[str, float | None] = {"ideal_ttft_p50_s": percentile(vals, 50), "ideal_ttft_p99_s": percentile(vals, 99)}
    if sc.phases:
        per = [percentile([floors[r.index] for r in trace.requests if a <= r.arrival < b], 99)
               for a, b in _phase_spans(sc)]
        for i, v in enumerate(per):
            out["ideal_" + phase_key(i)] = v
        known = [v for v in per if v is not None]
        out["ideal_phase_ttft_p99_s"] = max(known) if known else None
    return out


def phase_key(i: int) -> str:
    """The metric name of phase ``i``'s TTFT p99 (0-based; phases by arrival time)."""
    return f"phase{i + 1}_ttft_p99_s"


def _burst_windows(sc: Scenario, t0: float) -> list[tuple[float, float, float]]:
    """``(start, end, duration)`` of each burst in simulator time; the window "after" it is
    ``[end, end + duration)``."""
    return [(t0 + b.at_s, t0 + b.at_s + b.duration_s, b.duration_s) for b in sc.traffic.bursts]


def _burst_goodput(sc: Scenario, good, t0: float) -> dict[str, float]:
    """Online goodput over the burst windows, and over as long again right after each."""
    windows = _burst_windows(sc, t0)
    if not windows:
        return {}
    during = after = 0.0
    n_during = n_after = 0
    for a, e, d in windows:
        n_during += sum(1 for r in good if a <= r.arrival < e)
        n_after += sum(1 for r in good if e <= r.arrival < e + d)
        during += d
        after += d
    return {"goodput_during_bursts": n_during / during, "goodput_after_bursts": n_after / after,
            "goodput_bursts_and_after": (n_during + n_after) / (during + after)}


def _goodput_ceiling(sc: Scenario, recs, t0: float, slo: float, window: float) -> dict[str, float]:
    """What became of the online requests offered in the goodput windows, per second of window.

    ``online_offered`` is the goodput's ceiling — every offered online request served within the SLO
    — and it is the same for every contender of a cell (same arrivals), so ``ceiling / best peer``
    is the most any ``natsched ÷ best peer`` can be: a 2x target is out of reach wherever the best
    peer already serves over half of what is offered. The rest splits the shortfall: ``late``
    (served on the online path past the SLO), ``degraded`` (moved to the offline path by the
    admission) and ``unserved`` (refused for good, or lost)."""
    # as _burst_goodput counts: each burst and as long again after it, else every arrival
    windows = _burst_windows(sc, t0)
    spans = [span for a, e, d in windows for span in ((a, e), (e, e + d))]
    length = 2 * sum(d for _, _, d in windows) if windows else window
    n = {"offered": 0, "good": 0, "late": 0, "degraded": 0, "unserved": 0}
    for r in recs:
        if r.cls != "online" or spans and not any(a <= r.arrival < e for a, e in spans):
            continue
        n["offered"] += 1
        if r.status != "ok":
            n["unserved"] += 1
        elif r.first_token - r.arrival <= slo:
            n["good"] += 1  # as online_goodput counts it, degraded or not
        elif r.degraded:
            n["degraded"] += 1
        else:
            n["late"] += 1
    return {f"online_{k}": v / length for k, v in n.items()}


def _series(good, t0: float, window: float, step: float = 10.0) -> list[float]:
    n = max(1, int(math.ceil(window / step)))
    bins = [0] * n
    for r in good:
        i = int((r.arrival - t0) // step)
        if 0 <= i < n:
            bins[i] += 1
    return [b / step for b in bins]


def _floor_ratios(sc: Scenario, good, recs) -> dict[str, float]:
    """Per tenant with a floor: its share of the online goodput over its share of online demand,
    capped by the floor — 1.0 means it got what it asked for up to its floor."""
    out = {}
    demand = {}
    for r in recs:
        if r.cls == "online":
            demand[r.tenant] = demand.get(r.tenant, 0) + 1
    total_good, total_demand = max(1, len(good)), max(1, sum(demand.values()))
    for t in sc.traffic.tenants:
        if t.floor <= 0:
            continue
        got = sum(1 for r in good if r.tenant == t.name) / total_good
        want = min(t.floor, demand.get(t.name, 0) / total_demand)
        out[t.name] = got / want if want > 0 else 1.0
    return out


def _phase_spans(sc: Scenario) -> list[tuple[float, float]]:
    """``[from, to)`` of each phase in seconds after the first arrival (the last one open)."""
    edges = [0.0, *sc.phases, math.inf]
    return list(zip(edges, edges[1:]))


def _phases(sc: Scenario, ok, t0: float) -> list[dict[str, Any]]:
    out = []
    for a, b in _phase_spans(sc):
        xs = [r.first_token - r.arrival for r in ok if a <= r.arrival - t0 < b]
        out.append({"from_s": a, "to_s": None if b == math.inf else b, "requests": len(xs),
                    "ttft_p99_s": percentile(xs, 99)})
    return out


def _fair_share_time(sc: Scenario, recs, t0: float, n0: int) -> float | None:
    """Seconds from the first ``add`` until the added workers each get at least half the mean
    per-worker share of routed requests over a 10 s window (None: never)."""
    add_at = min(e.at_s for e in sc.events if e.kind == "add")
    new = {f"w{i}" for i in range(n0, n0 + sum(e.count for e in sc.events if e.kind == "add"))}
    width = len(str(n0 + len(new) - 1))
    new = {f"w{int(w[1:]):0{width}d}" for w in new}
    routed = sorted((r.routed - t0, r.worker) for r in recs if r.routed is not None and r.worker)
    step, win = 2.0, 10.0
    t = add_at
    end = routed[-1][0] if routed else add_at
    while t + win <= end:
        inside = [w for at, w in routed if t <= at < t + win]
        workers = {w for w in inside} | new
        mean = len(inside) / max(1, len(workers))
        if mean > 0 and all(sum(1 for w in inside if w == n) >= 0.5 * mean for n in new):
            return t + win - add_at
        t += step
    return None


# ------------------------------------------------------------------ the process pool

_STATE: dict[str, Any] = {}


def _run_job(si: int, li: int, contender: str, label: str) -> dict[str, Any]:
    sc: Scenario = _STATE["scenarios"][si]
    load: Load = _STATE["loads"][si][li]
    c = CONTENDERS[contender]
    tenants = {t.name: (t.floor, t.weight) for t in sc.traffic.tenants}
    q = _STATE.get("queue")
    progress = (lambda d, n: q.put((label, d, n))) if q is not None else _STATE.get("callback") and (
        lambda d, n: _STATE["callback"](label, d, n))
    settings = sim_settings(drawn(sc, load.seed), c.policy, c.rescue, router=c.router_settings())  # jitter too
    result = simulate(load.trace, settings, admission=make_gate(c, tenants, sc.slo_ttft_s), progress=progress or None)
    m = run_metrics(sc, result, load.trace)
    m["wall_s"] = round(result.wall_s, 3)
    ttft = sorted(r.first_token - r.arrival for r in result.records if r.status == "ok")
    return {"scenario": sc.name, "load": load.label, "contender": contender, "metrics": m, "ttft": ttft}


QUIET = ("natsched.router", "natsched.workers", "natsched.sim", "natsched.admitter")


def run_suite(scenarios: list[Scenario], s: SuiteSettings, stream: TextIO | None = None) -> dict[str, Any]:
    """Build every scenario's loads, run every contender on each, and judge natsched against the best peer.

    The services' per-request log lines stay out of the output (thousands per run)."""
    import logging

    saved = [(lg, lg.level) for lg in map(logging.getLogger, QUIET)]
    for lg, _ in saved:
        lg.setLevel(logging.ERROR)
    try:
        return _run_suite(scenarios, s, stream if stream is not None else sys.stderr)
    finally:
        for lg, level in saved:
            lg.setLevel(level)


def _run_suite(scenarios: list[Scenario], s: SuiteSettings, stream: TextIO) -> dict[str, Any]:
    started = time.perf_counter()
    if s.only:
        names = {sc.name for sc in scenarios}
        missing = [n for n in s.only if n not in names]
        if missing:
            raise ScenarioError("--only", "", f"no scenario named {', '.join(missing)}; have: {', '.join(sorted(names))}")
        scenarios = [sc for sc in scenarios if sc.name in s.only]
    if s.quick:
        scenarios = [time_scaled(sc, sc.quick_scale) for sc in scenarios]
    if s.progress:
        print(f"preparing {', '.join(sc.name for sc in scenarios)} ...", file=stream, flush=True)
    loads = _prepare(scenarios, s)
    jobs = []
    for si, sc in enumerate(scenarios):
        who = [c for c in (s.contenders or sc.contenders or list(CONTENDERS)) if c in CONTENDERS
               and (s.contenders or not s.quick or c not in QUICK_SKIP)]
        for li, load in enumerate(loads[si]):
            for c in who:
                jobs.append((si, li, c, f"{sc.name}/{load.label}/{c}"))
    results = _run_jobs(jobs, {"scenarios": scenarios, "loads": loads}, s, stream)
    report = {"scenarios": {}, "quick": s.quick, "wall_s": 0.0}
    for si, sc in enumerate(scenarios):
        mine = [r for r in results if r["scenario"] == sc.name]
        report["scenarios"][sc.name] = judge(sc, loads[si], mine)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def _prep_job(si: int) -> list[Load]:
    return build_loads(_STATE["prep"][si], _STATE["settings"])


def _init_child(state: dict[str, Any]) -> None:
    _STATE.update(state)


def _prepare(scenarios: list[Scenario], s: SuiteSettings) -> list[list[Load]]:
    """Every scenario's loads (calibration runs included), the scenarios side by side in the pool."""
    if s.jobs <= 1 or len(scenarios) <= 1:
        return [build_loads(sc, s) for sc in scenarios]
    state = {"prep": scenarios, "settings": s}
    with make_pool(min(s.jobs, len(scenarios)), _init_child, (state,), loggers=QUIET) as pool:
        # the slowest (a trace's calibration) first, so it does not finish last alone
        order = sorted(range(len(scenarios)), key=lambda i: scenarios[i].traffic.trace is None)
        done = dict(zip(order, pool.map(_prep_job, order, chunksize=1)))
    out = [done[i] for i in range(len(scenarios))]
    for sc, ld in zip(scenarios, out):  # the block size a trace brought with it (set in the child)
        if ld and sc.traffic.trace is not None:
            sc.block_size = ld[0].trace.block_size
    return out


def _run_jobs(jobs, state: dict[str, Any], s: SuiteSettings, stream: TextIO) -> list[dict[str, Any]]:
    """Every job with ``state`` (the scenarios and their loads) at hand: here, or in the pool."""
    progress = Progress(f"scenarios: {len(jobs)} runs", [j[3] for j in jobs], stream, enabled=s.progress)
    if s.jobs <= 1:
        _STATE.update(state, callback=progress.update)
        try:
            return [_run_job(*j) for j in jobs]
        finally:
            for k in (*state, "callback"):
                _STATE.pop(k, None)
            progress.close()
    ctx = context()
    q = ctx.Queue()
    pool = make_pool(s.jobs, _init_child, ({**state, "queue": q},), ctx=ctx, loggers=QUIET)
    try:
        pending = [pool.apply_async(_run_job, j) for j in jobs]
        while not all(p.ready() for p in pending):
            _drain(q, progress, timeout=0.2)
        _drain(q, progress, timeout=0.0)
        out = [p.get() for p in pending]
        pool.close()
        pool.join()
        return out
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    finally:
        progress.close()


def _drain(q, progress: Progress, timeout: float) -> None:
    """Every progress report waiting on ``q`` onto the line (waiting up to ``timeout`` for the first)."""
    try:
        item = q.get(timeout=timeout) if timeout else q.get_nowait()
        while True:
            progress.update(*item)
            item = q.get_nowait()
    except queue_mod.Empty:
        pass


# ------------------------------------------------------------------ verdicts


def judge(sc: Scenario, loads: list[Load], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Means per contender over the loads, natsched ÷ the best peer and the paired verdict."""
    key, higher = sc.headline, sc.higher_is_better
    by: dict[str, dict[str, dict[str, Any]]] = {}
    ttfts: dict[str, list[float]] = {}
    for r in results:
        by.setdefault(r["contender"], {})[r["load"]] = r["metrics"]
        if r["load"] == loads[len(loads) // 2].label:
            ttfts[r["contender"]] = r["ttft"]
    labels = [ld.label for ld in loads]
    phases = [phase_key(i) for i in range(len(sc.phases) + 1)] if sc.phases else []
    metrics = [key, *sc.also, *phases, "ttft_p50_s", "ttft_p99_s", "hit_ratio"]
    mean = {c: {m: _mean(by[c][lb].get(m) for lb in labels) for m in dict.fromkeys(metrics)} for c in by}
    for c in by:
        for m in ("completed", "rejected", "lost", "refusals", "refusals_retry_after", "retries", "degraded_completed",
                  "rescued", "migrated", "requests"):
            mean[c][m] = sum(by[c][lb].get(m, 0) for lb in labels)
    verdicts = {}
    for m in dict.fromkeys([key, *sc.also, *phases]):
        verdicts[m] = paired_verdict(by, labels, m, _higher(m))
    head = verdicts[key]
    return {"headline": key, "higher_is_better": higher, "loads": labels, "mean": mean, "runs": by,
            "best_peer": head.get("peer"), "ratio": head.get("ratio"), "verdict": head.get("verdict"),
            "paired": verdicts, "ttfts": ttfts, "description": sc.description,
            "workers": sc.n_workers, "ceiling": goodput_ceiling(key, by, labels, head.get("peer")),
            "ideal": ideal_bounds(by, labels, verdicts),
            "tails": {c: merge_tails(by[c][lb].get("tail") for lb in labels) for c in by},
            "phases": [{"from_s": a, "to_s": b, "metric": k} for a, b, k in
                       zip([0.0, *sc.phases], [*sc.phases, None], phases)]}


CEILING_PARTS = ("offered", "good", "late", "degraded", "unserved")


def goodput_ceiling(key: str, by, labels, peer: str | None) -> dict[str, Any] | None:
    """For an ``online_goodput`` headline: the offered online rate of its windows (the ceiling),
    what each contender made of it (means over the cells, req/s) and ``max_ratio`` = ceiling ÷ the
    best peer's goodput, the most ``natsched ÷ best peer`` can be on these arrivals."""
    if key != "online_goodput" or peer is None:
        return None
    parts = {c: {k: _mean(by[c][lb].get(f"online_{k}") for lb in labels) for k in CEILING_PARTS} for c in by}
    offered, theirs = parts[peer]["offered"], _mean(by[peer][lb].get(key) for lb in labels)
    if not offered:
        return None
    return {"offered": offered, "max_ratio": offered / theirs if theirs else None, "by_contender": parts}


def ideal_bounds(by, labels, verdicts: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """For each judged TTFT metric: the ideal cluster's value (``ideal``, the mean over the cells of
    :func:`ideal_metrics`) and ``min_ratio`` = ideal ÷ the best peer's value, the least
    ``natsched ÷ best peer`` can be on these arrivals (a "level" verdict near 1.0 with a
    ``min_ratio`` near 1.0 has nothing left to win; far below it, the room is real)."""
    if not by:
        return {}
    src = by[OURS] if OURS in by else next(iter(by.values()))
    out = {}
    for m, v in verdicts.items():
        ideal = _mean(src[lb].get("ideal_" + m) for lb in labels)
        if ideal is None or not v.get("theirs"):
            continue
        out[m] = {"ideal": ideal, "min_ratio": ideal / v["theirs"]}
    return out


def _higher(metric: str) -> bool:
    from natsched.sim.scenario import HEADLINES

    return HEADLINES.get(metric, False)


def _mean(xs) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def paired_verdict(by, labels, metric: str, higher: bool) -> dict[str, Any]:
    """natsched minus the best peer (best on the mean; natsched's own variants are not peers), load by
    load (sim/sweep.py's rule)."""
    if OURS not in by:
        return {}
    # peers are the other projects: natsched's own variants (no admission) are shown, not judged against
    peers = {c: _mean(by[c][lb].get(metric) for lb in labels) for c in by if not c.startswith(OURS)}
    peers = {c: v for c, v in peers.items() if v is not None}
    if not peers:  # natsched alone (--contenders natsched): its value, nothing to judge it against
        return {"ours": _mean(by[OURS][lb].get(metric) for lb in labels)}
    peer = (max if higher else min)(peers, key=lambda c: peers[c])
    diffs = [by[OURS][lb][metric] - by[peer][lb][metric] for lb in labels
             if by[OURS][lb].get(metric) is not None and by[peer][lb].get(metric) is not None]
    if not diffs:
        return {"peer": peer}
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
    diff = statistics.fmean(diffs)
    ours = _mean(by[OURS][lb].get(metric) for lb in labels)
    ratio = ours / peers[peer] if peers[peer] else None
    return {"peer": peer, "ours": ours, "theirs": peers[peer], "ratio": ratio, "mean_diff": diff, "se": se,
            "verdict": verdict(diff, se, higher), "loads": len(diffs)}


# ------------------------------------------------------------------ output


def _fmt(v: Any, metric: str = "") -> str:
    if v is None:
        return "-"
    if metric == "hit_ratio" or metric.endswith("share"):
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def scenario_table(name: str, j: dict[str, Any]) -> str:
    """One row per contender: the headline and the supporting metrics, means over the loads."""
    key = j["headline"]
    extra = [m for m in j["mean"][next(iter(j["mean"]))] if m not in (key, "ttft_p50_s", "ttft_p99_s", "hit_ratio")
             and not isinstance(j["mean"][next(iter(j["mean"]))][m], int)]
    head = ("contender", key, *extra, "ttft p50", "ttft p99", "hit", "done", "refused", "ra", "lost", "rescued",
            "migrated", "degraded")
    rows = [head]
    for c, m in j["mean"].items():
        rows.append((c, _fmt(m[key], key), *[_fmt(m[x], x) for x in extra], _fmt(m["ttft_p50_s"]),
                     _fmt(m["ttft_p99_s"]), _fmt(m["hit_ratio"], "hit_ratio"), str(m["completed"]),
                     str(m["refusals"]), str(m["refusals_retry_after"]), str(m["lost"]), str(m["rescued"]),
                     str(m.get("migrated", 0)), str(m["degraded_completed"])))
    title = (f"scenario {name}: {j['description']} ({j['workers']} workers; means over {len(j['loads'])} loads: "
             f"{', '.join(j['loads'])})")
    foot = ("refused = refusals met (each retried by the client or final), ra = of which with retry_after; "
            "lost = ended unfinished without a final answer; rescued = re-run by the scheduler before any output; "
            "migrated = streams continued after their output on another worker; counts are totals over the loads")
    return "\n".join([title, "", *_grid(rows), "", foot])


def tail_table(name: str, j: dict[str, Any]) -> str:
    """Where each contender's slowest requests waited (sim/tails.py): one row per contender, model and
    class, with the whole tail's row first where it has several."""
    rows = [("contender", "model", "class", "tail n", "ttft s", "door s", "queue s", "prefill s", "floor s",
             "missed cache", "attempts", "degraded")]
    for c, tail in j.get("tails", {}).items():
        parts = [t for t in tail if t["model"] != WHOLE_TAIL]
        for t in [t for t in tail if t["model"] == WHOLE_TAIL and len(parts) > 1] + parts:
            rows.append((c, "all" if t["model"] == WHOLE_TAIL else t["model"],
                         "all" if t["cls"] == WHOLE_TAIL else t["cls"], str(t["n"]),
                         *(f"{t[k]:.3f}" for k in ("ttft_s", "door_s", "queue_s", "prefill_s", "floor_s")),
                         f"{t['missed_cache']:.1%}", f"{t['attempts']:.2f}", f"{t['degraded']:.0%}"))
    title = (f"where the tail waits ({name}): the served requests at or past each run's TTFT p99, pooled over "
             f"the {len(j['loads'])} cells")
    if len(rows) == 1:
        return f"{title}: none served"
    foot = ("door = arrival to the worker that gave the first token (the admission's queue, refusals and the client's "
            "backoff, the router's waits, an attempt lost with a worker); then queue + prefill = the engine's part "
            "(prefill = its own prefill alone on that engine with the cache it found; queue = the rest); floor = the ideal cluster's TTFT of the same requests; missed cache = prompt share the ideal "
            "cluster had cached and the run computed; degraded = share moved to the offline path")
    return "\n".join([title, "", *_grid(rows), "", foot])


def summary_table(report: dict[str, Any]) -> str:
    """One row per scenario: headline, natsched, best peer, the ratio and the paired verdict."""
    rows = [("scenario", "headline", "natsched", "best peer", "peer value", "natsched/peer", "verdict", "loads")]
    for name, j in report["scenarios"].items():
        p = j["paired"][j["headline"]]
        rows.append((name, j["headline"] + (" (higher is better)" if j["higher_is_better"] else ""),
                     _fmt(p.get("ours")), p.get("peer") or "-", _fmt(p.get("theirs")),
                     "-" if p.get("ratio") is None else f"{p['ratio']:.2f}", p.get("verdict") or "-",
                     str(p.get("loads", 0))))
    notes = [ceiling_line(n, j) for n, j in report["scenarios"].items() if j.get("ceiling")]
    notes += [ideal_line(n, j) for n, j in report["scenarios"].items() if (j.get("ideal") or {}).get(j["headline"])]
    notes += [phase_line(n, j) for n, j in report["scenarios"].items() if j.get("phases")]
    return "\n".join(_grid(rows) + notes)


def phase_line(name: str, j: dict[str, Any]) -> str:
    """Each phase's TTFT p99 against that phase's best peer, with its own paired verdict."""
    parts = []
    for ph in j["phases"]:
        p = j["paired"].get(ph["metric"]) or {}
        span = f"{ph['from_s']:g}-{'end' if ph['to_s'] is None else format(ph['to_s'], 'g')} s"
        ideal = (j.get("ideal") or {}).get(ph["metric"])
        parts.append(f"{span} {_fmt(p.get('ours'))} / {p.get('peer') or '-'} {_fmt(p.get('theirs'))} "
                     f"{p.get('verdict') or '-'}"  # a phase nobody arrived in: "-"
                     + (f" (ideal {_fmt(ideal['ideal'])})" if ideal else ""))
    return f"{name} per phase (TTFT p99 s, {OURS} / best peer of the phase): " + "; ".join(parts)


def ideal_line(name: str, j: dict[str, Any]) -> str:
    """One sentence on how low a TTFT headline could go on its arrivals (sim/ideal.py)."""
    key, p = j["headline"], j["paired"][j["headline"]]
    b = j["ideal"][key]
    return (f"{name}: {key} of the ideal cluster (each request alone on an idle engine of the fastest profile, "
            f"every earlier prompt cached) {_fmt(b['ideal'])} s; {OURS} {_fmt(p.get('ours'))}, "
            f"{p.get('peer')} {_fmt(p.get('theirs'))} -> {OURS}/peer can be no lower than {b['min_ratio']:.2f}")


def ceiling_line(name: str, j: dict[str, Any]) -> str:
    """One sentence on how far an online-goodput headline could go on its arrivals."""
    c, peer = j["ceiling"], j["best_peer"]
    ours, theirs = c["by_contender"].get(OURS, {}), c["by_contender"][peer]

    def share(part: dict[str, Any]) -> str:
        return f"{(part.get('good') or 0.0) / c['offered']:.0%}"

    bound = "-" if c["max_ratio"] is None else f"{c['max_ratio']:.2f}"
    return (f"{name}: {c['offered']:.3g} online req/s offered in the goodput windows (the ceiling); served within "
            f"the SLO: {OURS} {share(ours)}, {peer} {share(theirs)} -> {OURS}/peer can be at most {bound}")


def to_json(report: dict[str, Any]) -> dict[str, Any]:
    """The report without the per-request TTFT lists (those are for the plots)."""
    out = {"quick": report["quick"], "wall_s": report["wall_s"], "scenarios": {}}
    for name, j in report["scenarios"].items():
        out["scenarios"][name] = {k: v for k, v in j.items() if k != "ttfts"}
    return out


def plot_suite(report: dict[str, Any], directory: Path) -> list[Path]:
    """One PNG per scenario: the TTFT CDF of every contender (middle load), and for scenarios with an
    online SLO the online goodput over time."""
    from natsched.sim.plot import require_matplotlib

    plt = require_matplotlib()
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, j in report["scenarios"].items():
        mid = j["loads"][len(j["loads"]) // 2]
        series = {c: runs[mid].get("goodput_series") for c, runs in j["runs"].items()}
        two = any(v for v in series.values())
        fig, axes = plt.subplots(1, 2 if two else 1, figsize=(13 if two else 8, 5))
        axes = list(axes) if two else [axes]
        try:
            for c, xs in j["ttfts"].items():
                xs = [x for x in xs if x > 0]
                if xs:
                    axes[0].step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=c)
            axes[0].set_xscale("log")
            axes[0].set_xlabel("time to first token (s, log scale)")
            axes[0].set_ylabel("share of completed requests")
            axes[0].set_title(f"TTFT CDF ({mid})")
            axes[0].grid(True, which="both", alpha=0.3)
            axes[0].legend(fontsize="small", loc="lower right")
            if two:
                for c, ys in series.items():
                    if ys:
                        axes[1].plot([10 * i for i in range(len(ys))], ys, label=c)
                axes[1].set_xlabel("arrival time (s)")
                axes[1].set_ylabel("online requests within the SLO per second")
                axes[1].set_title("online goodput over time")
                axes[1].grid(True, alpha=0.3)
                axes[1].legend(fontsize="small")
            fig.suptitle(f"scenario {name}")
            fig.tight_layout()
            path = directory / f"{name}.png"
            fig.savefig(path, dpi=100)
            paths.append(path)
        finally:
            plt.close(fig)
    return paths


# ------------------------------------------------------------------ the command line
