"""The routing benchmark: every chosen policy on identical arrivals, side by side.

One trace is loaded once; each policy replays it through :mod:`natsched.sim.des` (the shipped RouterCore
and SimCore objects) in its own process (``jobs`` at a time: two on a 2-core machine). With
``target_busy`` the speed-up is first calibrated under ``least_loaded`` on short runs, then on the
whole trace (:mod:`natsched.sim.calibrate`), then used for every policy. The result prints as a table and
serialises to the JSON documented in :meth:`RoutingReport.to_json`; :mod:`natsched.sim.plot` draws it.

``profile`` may name several engine profiles (``"h100-llama8b,h100-27b-int4"``): the workers take
them in turn, a mixed cluster. Every run also reports how well the router predicted time to first
token (:func:`prediction_errors`): the median relative error of the learned per-worker cost model
(:mod:`natsched.router.learned`) that routed, against the fixed model's prediction for the very
same requests, counted after each worker's first ``PREDICTION_WARMUP`` completions.

An admission hook factory (``admission``) can be plugged in: it is called once per run, in the
process that runs it, so every policy meets a fresh hook (see :mod:`natsched.sim.admission`).
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TextIO

from natsched.sim.admission import AdmissionHook
from natsched.sim.calibrate import Calibration, find_speedup
from natsched.sim.des import SimSettings, simulate
from natsched.sim.errors import SimConfigError
from natsched.sim.metrics import ceiling_hit_ratio, pooled_hit_ratio
from natsched.sim.pool import context, make_pool
from natsched.sim.progress import Progress
from natsched.sim.sweep import format_summary, format_targets, summarize, sweep_speedups, targets
from natsched.sim.trace import Trace, check_speedup, load_mooncake
from natsched.workers.profiles import DEFAULT_PROFILE, get_profile

log = logging.getLogger(__name__)

#: the per-policy keys of the JSON, in table order
METRIC_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "tpot_p50_s", "hit_ratio",
               "throughput_tok_s", "load_cv", "migration_rate", "busy", "completed", "rejected")
CALIBRATION_POLICY = "least_loaded"
REFINE_TOL = 0.005  # the whole trace's busy within this of the target (the prefix's: 0.01)
REFINE_ROUNDS = 8  # rounds on the whole trace, from the prefix's answer, before interpolating
PREDICTION_WARMUP = 500  # completions per worker before its prediction errors count (the target)
KEEP_PREDICTIONS = 1_000_000  # per worker: every completion of a benchmark run


def prediction_errors(predictions: dict[str, list], warmup: int = PREDICTION_WARMUP) -> dict[str, Any]:
    """Median |predicted - observed| / observed TTFT of the learned and the fixed model, over the
    completions after each worker's first ``warmup`` (all of a worker's, if it never got there:
    ``warm`` says how many workers did)."""
    learned, fixed, warm = [], [], 0
    for rows in predictions.values():
        later = [r for r in rows if r[0] > warmup]
        warm += bool(later)
        for _, obs, pred, fix in (later or rows):
            if obs > 0:
                learned.append(abs(pred - obs) / obs)
                fixed.append(abs(fix - obs) / obs)
    med = (lambda v: sorted(v)[len(v) // 2] if v else None)
    return {"ttft_pred_err_learned": med(learned), "ttft_pred_err_fixed": med(fixed),
            "ttft_pred_samples": len(learned), "ttft_pred_warm_workers": warm}


def available_policies() -> list[str]:
    """The routing policies that exist now (natsched.router.policies.POLICIES, in its order)."""
    from natsched.router.policies import POLICIES

    return list(POLICIES)


def resolve_policies(spec: str | Sequence[str] | None) -> list[str]:
    """``all`` / None -> every policy; else a comma-separated list (or a sequence), validated."""
    known = available_policies()
    if spec is None or spec == "all" or (not isinstance(spec, str) and list(spec) == ["all"]):
        return known
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    if not names:
        raise SimConfigError("no policy named; use a comma-separated list or 'all'")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SimConfigError(f"unknown routing polic{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                             f"known: {', '.join(known)} (or 'all')")
    return list(dict.fromkeys(names))


@dataclass
class RoutingBenchSettings:
    trace: str
    workers: int = 8
    policies: list[str] | str | None = None  # None / "all": every policy in natsched.router.policies.POLICIES
    speedup: float | None = None  # fixed speed-up; default 1.0 unless target_busy is set
    target_busy: float | None = None  # calibrate the speed-up to this busy fraction under least_loaded
    limit: int | None = None  # keep the first N requests of the trace
    profile: str = DEFAULT_PROFILE
    kv_blocks: int | None = None  # KV cache blocks per worker; default: the profile's capacity / block size
    jobs: int = 2  # policies simulated at once (processes); 1 runs everything in this process
    calib_limit: int = 1000  # requests per run of the first, coarse calibration
    hb_interval: float = 1.0
    net_delay_s: float = 0.0
    progress: bool = True
    quiet_logs: bool = True  # keep router/worker log lines out of the output (they are counted)
    admission: Callable[[], AdmissionHook] | None = None  # factory, called once per run
    sim: dict[str, Any] = field(default_factory=dict)  # extra SimSettings fields
    sweep: int = 1  # > 1: also run every policy at this many speed-ups around the chosen one (natsched.sim.sweep)
    sweep_span: float = 0.05  # ... spread over speed-up x [1 - span, 1 + span]

    def __post_init__(self) -> None:
        if self.speedup is not None and self.target_busy is not None:
            raise SimConfigError("give either a speed-up or a target busy fraction, not both")
        if self.speedup is not None:
            check_speedup(self.speedup)
        if self.target_busy is not None and not (0.0 < self.target_busy < 1.0):
            raise SimConfigError(f"target busy must be strictly between 0 and 1, got {self.target_busy}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise SimConfigError(f"workers must be >= 1, got {self.workers!r}")
        if self.limit is not None and self.limit < 1:
            raise SimConfigError(f"limit must be >= 1, got {self.limit}")
        if self.jobs < 1 or self.calib_limit < 1:
            raise SimConfigError("jobs and calib_limit must be >= 1")
        if self.kv_blocks is not None and (not isinstance(self.kv_blocks, int) or self.kv_blocks < 1):
            raise SimConfigError(f"kv_blocks must be an integer >= 1, got {self.kv_blocks!r}")
        try:
            for name in self.profiles:
                get_profile(name)
        except ValueError as exc:
            raise SimConfigError(str(exc)) from None

    @property
    def profiles(self) -> list[str]:
        """The engine profiles, one per worker in turn (one name: a uniform cluster)."""
        names = [p.strip() for p in self.profile.split(",") if p.strip()]
        if not names:
            raise SimConfigError("no engine profile named")
        return names

    def sim_settings(self, policy: str) -> SimSettings:
        extra = {**self.sim, "kv_blocks": self.kv_blocks} if self.kv_blocks is not None else dict(self.sim)
        extra["router"] = {"keep_predictions": KEEP_PREDICTIONS, **extra.get("router", {})}
        profiles = self.profiles
        if len(profiles) > 1:
            extra.setdefault("worker_profiles", profiles)
        return SimSettings(workers=self.workers, policy=policy, profile=profiles[0], hb_interval=self.hb_interval,
                           net_delay_s=self.net_delay_s, **extra)

    def kv_blocks_for(self, block_size: int) -> int:
        """The KV blocks each simulated worker has: what :meth:`sim_settings` gives every run, else
        the profile's (``SimCore``'s default)."""
        chosen = self.sim_settings(CALIBRATION_POLICY).kv_blocks
        return chosen if chosen is not None else min(get_profile(p).kv_blocks(block_size) for p in self.profiles)


@dataclass
class RoutingReport:
    trace: str
    requests: int
    workers: int
    profile: str
    speedup: float
    ceiling_hit_ratio: float
    policies: dict[str, dict[str, Any]]
    ttfts: dict[str, list[float]]  # per policy, for the CDF plot (not in the JSON)
    calibration: Calibration | None = None
    wall_s: float = 0.0
    block_size: int = 512
    sweep: dict[str, Any] | None = None  # natsched.sim.sweep.summarize of the sweep, when one ran
    kv_blocks: int = 0  # KV cache blocks per worker in every run
    pooled_hit_ratio: float = 0.0  # one LRU of all workers' KV together (natsched.sim.metrics)

    def to_json(self) -> dict[str, Any]:
        """``{"trace", "requests", "workers", "profile", "speedup", "ceiling_hit_ratio",
        "policies": {NAME: {<METRIC_KEYS>, plus "wall_s", "steps", "preemptions",
        "backoff_changes", "router_warnings", "half_open_changes", "ttft_pred_err_learned",
        "ttft_pred_err_fixed", "ttft_pred_samples", "ttft_pred_warm_workers"}}}``, plus ``"block_size"``, ``"kv_blocks"`` (per worker),
        ``"pooled_hit_ratio"``, ``"wall_s"`` and, when calibrated, ``"calibration"``."""
        out: dict[str, Any] = {
            "trace": self.trace, "requests": self.requests, "workers": self.workers, "profile": self.profile,
            "speedup": self.speedup, "ceiling_hit_ratio": self.ceiling_hit_ratio, "policies": self.policies,
            "block_size": self.block_size, "kv_blocks": self.kv_blocks, "pooled_hit_ratio": self.pooled_hit_ratio,
            "wall_s": self.wall_s,
        }
        if self.calibration is not None:
            out["calibration"] = self.calibration.to_json()
        out["targets"] = targets(self.policies)
        if self.sweep is not None:
            out["sweep"] = self.sweep
        return out

    def table(self) -> str:
        return format_table(self)


# ------------------------------------------------------------------ jobs (run in pool processes)

_STATE: dict[str, Any] = {}
QUIET = ("natsched.router", "natsched.workers")  # the services whose warnings a run counts


class _CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.examples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.examples) < 3:
            try:
                self.examples.append(f"{record.name}: {record.getMessage()}")
            except Exception:  # a broken log call must not break the benchmark
                pass


@contextmanager
def _captured_logs(quiet: bool) -> Iterator[_CountingHandler]:
    """Count router/worker warnings of one run; when ``quiet``, keep their lines off the console."""
    handler = _CountingHandler()
    saved = []
    for name in QUIET:
        lg = logging.getLogger(name)
        saved.append((lg, lg.propagate))
        lg.addHandler(handler)
        if quiet:
            lg.propagate = False
    try:
        yield handler
    finally:
        for lg, propagate in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate


def _init_worker(trace: Trace, progress_q: Any, settings: RoutingBenchSettings) -> None:
    _STATE.update(trace=trace, queue=progress_q, settings=settings)


def _report(label: str) -> Callable[[int, int], None] | None:
    q = _STATE.get("queue")
    if q is None:
        return None
    cb = _STATE.get("callback")
    if cb is not None:  # in-process: straight to the progress line
        return lambda done, total: cb(label, done, total)
    return lambda done, total: q.put((label, done, total))


def _run_job(kind: str, policy: str, speedup: float, limit: int | None, label: str) -> dict[str, Any]:
    trace: Trace = _STATE["trace"]
    settings: RoutingBenchSettings = _STATE["settings"]
    if limit is not None and limit < len(trace):
        trace = trace.head(limit)
    trace = trace.scaled(speedup)
    admission = settings.admission() if settings.admission is not None else None
    with _captured_logs(settings.quiet_logs) as logs:
        result = simulate(trace, settings.sim_settings(policy), admission=admission, progress=_report(label))
    metrics = result.metrics()
    if kind == "calibrate":
        return {"busy": metrics["busy"], "speedup": speedup}
    ttft = sorted(r.first_token - r.arrival for r in result.records if r.status == "ok")
    metrics.update(wall_s=round(result.wall_s, 3), steps=result.steps, preemptions=result.preemptions,
                   backoff_changes=result.backoff_changes, router_warnings=logs.count,
                   half_open_changes=len(result.health_changes), **prediction_errors(result.predictions))
    if logs.examples:
        metrics["router_warning_examples"] = logs.examples
    return {"policy": policy, "metrics": metrics, "ttft": ttft}


class _Runner:
    """Runs jobs in a process pool (or in this process when jobs == 1), feeding one progress line."""

    def __init__(self, trace: Trace, settings: RoutingBenchSettings, stream: TextIO) -> None:
        self.settings = settings
        self.stream = stream
        self.pool = None
        self.queue = None
        if settings.jobs > 1:
            ctx = context()
            self.queue = ctx.Queue()
            self.pool = make_pool(settings.jobs, _init_worker, (trace, self.queue, settings), ctx=ctx,
                                  loggers=QUIET)
        else:
            _init_worker(trace, True, settings)

    def run(self, title: str, jobs: list[tuple[str, str, float, int | None, str]]) -> list[dict[str, Any]]:
        progress = Progress(title, [j[4] for j in jobs], self.stream, enabled=self.settings.progress)
        if self.pool is None:
            _STATE["callback"] = progress.update
            try:
                return [_run_job(*job) for job in jobs]
            finally:
                _STATE.pop("callback", None)
                progress.close()
        pending = [self.pool.apply_async(_run_job, job) for job in jobs]
        try:
            while not all(p.ready() for p in pending):
                self._drain(progress, timeout=0.2)
            self._drain(progress, timeout=0.0)
            return [p.get() for p in pending]
        finally:
            progress.close()

    def _drain(self, progress: Progress, timeout: float) -> None:
        try:
            item = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
            while True:
                progress.update(*item)
                item = self.queue.get_nowait()
        except queue_mod.Empty:
            pass

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()

    def terminate(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def calibrate(runner: _Runner, settings: RoutingBenchSettings, n_requests: int) -> Calibration:
    """The speed-up of ``settings.target_busy`` for the whole trace: first on the first
    ``calib_limit`` requests (cheap, from 1.0), then, when the trace is longer, on all of it from
    that answer — the prefix's busy is not the whole run's (see :mod:`natsched.sim.calibrate`)."""
    limit = min(settings.calib_limit, n_requests)

    def evaluate_on(n: int):
        def evaluate(speedups: Sequence[float]) -> list[float]:
            jobs = [("calibrate", CALIBRATION_POLICY, s, n, f"x{s:.4g}") for s in speedups]
            out = runner.run(f"calibrating busy={settings.target_busy:.2f} ({n} requests, {CALIBRATION_POLICY})",
                             jobs)
            return [r["busy"] for r in out]
        return evaluate

    coarse = find_speedup(settings.target_busy, evaluate_on(limit), parallel=settings.jobs)
    coarse.requests = limit
    if limit >= n_requests:
        return coarse
    fine = find_speedup(settings.target_busy, evaluate_on(n_requests), parallel=settings.jobs, tol=REFINE_TOL,
                        max_rounds=REFINE_ROUNDS, guess=coarse.speedup)
    fine.requests, fine.coarse = n_requests, coarse
    return fine


def run_routing_benchmark(settings: RoutingBenchSettings, trace: Trace | None = None,
                          stream: TextIO | None = None) -> RoutingReport:
    """Load the trace, pick the speed-up, run every policy and collect the report."""
    started = time.perf_counter()
    stream = stream if stream is not None else sys.stderr
    policies = resolve_policies(settings.policies)
    if trace is None:
        trace = load_mooncake(settings.trace, limit=settings.limit)
    elif settings.limit is not None:
        trace = trace.head(settings.limit)
    trace = trace.scaled(1.0)
    ceiling = ceiling_hit_ratio(trace.requests, trace.block_size)
    kv_blocks = settings.kv_blocks_for(trace.block_size)
    runner = _Runner(trace, settings, stream)
    try:
        calibration = None
        if settings.target_busy is not None:
            calibration = calibrate(runner, settings, len(trace))
            speedup = calibration.speedup
            measured = f"busy {calibration.busy:.3f}" if calibration.busy is not None else "interpolated"
            measured += f" on {calibration.requests} requests"
            if calibration.coarse is not None:
                measured += f"; x{calibration.coarse.speedup:.4g} on the first {calibration.coarse.requests}"
            if settings.progress:
                print(f"calibrated: speed-up {speedup:.4g} ({measured})", file=stream, flush=True)
        else:
            speedup = float(settings.speedup or 1.0)
        speedups = sweep_speedups(speedup, settings.sweep, settings.sweep_span)
        if speedup not in speedups:
            speedups.append(speedup)  # the single-run table is always the chosen speed-up's
        jobs = [("policy", p, s, None, p if len(speedups) == 1 else f"{p}@x{s:.3g}") for s in speedups for p in policies]
        everything = runner.run(f"routing x{speedup:.3g}" + (f" and {len(speedups) - 1} more" if len(speedups) > 1
                                                              else ""), jobs)
        runner.close()
        by_speedup: dict[float, dict[str, dict[str, Any]]] = {}
        for (_, _, s, _, _), r in zip(jobs, everything):
            by_speedup.setdefault(s, {})[r["policy"]] = r["metrics"]
        results = [r for (_, _, s, _, _), r in zip(jobs, everything) if s == speedup]
        swept = {s: by_speedup[s] for s in sweep_speedups(speedup, settings.sweep, settings.sweep_span)}
    except BaseException:
        runner.terminate()
        raise
    return RoutingReport(
        trace=trace.source, requests=len(trace), workers=settings.workers, profile=settings.profile,
        speedup=speedup, ceiling_hit_ratio=ceiling,
        policies={r["policy"]: r["metrics"] for r in results}, ttfts={r["policy"]: r["ttft"] for r in results},
        calibration=calibration, wall_s=round(time.perf_counter() - started, 2), block_size=trace.block_size,
        sweep=summarize(swept) if settings.sweep > 1 else None, kv_blocks=kv_blocks,
        pooled_hit_ratio=pooled_hit_ratio(trace.requests, trace.block_size, kv_blocks * settings.workers),
    )


# ------------------------------------------------------------------ output

def _s(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 10:
        return f"{v:.3f}"
    return f"{v:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def format_predictions(report: RoutingReport) -> str:
    """How well each run's router predicted TTFT: the learned cost model against the fixed one."""
    rows = [("policy", "learned err", "fixed err", "completions", "half-open changes")]
    for name, m in report.policies.items():
        rows.append((name, _pct(m.get("ttft_pred_err_learned")), _pct(m.get("ttft_pred_err_fixed")),
                     str(m.get("ttft_pred_samples", 0)), str(m.get("half_open_changes", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    warm = min((m.get("ttft_pred_warm_workers", 0) for m in report.policies.values()), default=0)
    return "\n".join([f"TTFT prediction error, median |predicted - observed| / observed, after each worker's first "
                      f"{PREDICTION_WARMUP} completions ({warm} of {report.workers} workers got there in every run; "
                      f"the others count whole): the learned per-worker model that routed, and the fixed model on "
                      f"the same requests", *lines])


def format_table(report: RoutingReport) -> str:
    head = ("policy", "ttft p50", "p90", "p99", "e2e p50", "p99", "tpot p50", "hit", "thr tok/s", "load cv",
            "migr", "busy", "done", "rej")
    rows = [head]
    for name, m in report.policies.items():
        rows.append((
            name, _s(m["ttft_p50_s"]), _s(m["ttft_p90_s"]), _s(m["ttft_p99_s"]), _s(m["e2e_p50_s"]),
            _s(m["e2e_p99_s"]), _s(m["tpot_p50_s"]), f"{m['hit_ratio']:.1%}", f"{m['throughput_tok_s']:,.0f}",
            f"{m['load_cv']:.3f}", f"{m['migration_rate']:.1%}", f"{m['busy']:.1%}", str(m["completed"]),
            str(m["rejected"]),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    title = (f"routing benchmark: {os.path.basename(report.trace)}, {report.requests} requests, {report.workers} "
             f"workers, profile {report.profile}, speed-up {report.speedup:.4g}, block {report.block_size} tokens, "
             f"KV {report.kv_blocks:,} blocks ({report.kv_blocks * report.block_size:,} tokens) per worker")
    foot = (f"times in seconds; hit = prompt tokens served from cache; reuse ceiling (one infinite cache) "
            f"{report.ceiling_hit_ratio:.1%}; one LRU as large as all workers' KV {report.pooled_hit_ratio:.1%}; "
            f"wall {report.wall_s:.1f} s")
    t = targets(report.policies)
    verdict = [format_targets(t, "(this run)")] if t else []
    verdict += ["", format_predictions(report)]
    sweep = ["", format_summary(report.sweep)] if report.sweep is not None else []
    return "\n".join([title, "", *lines, "", foot, *verdict, *sweep])
