"""Memory of the system under test during ``natsched bench pipeline``: samples, and a verdict per process.

A soak (issue #8) must show that nothing grows with the number of requests served: every
process's resident memory levels off after warm-up, and the stored state grows only where
retention says it should (the audit streams keep every request for days; the work queues and
the in-flight bucket must not). So two things are sampled, separately: the RSS of each process
(``VmRSS`` from ``/proc/<pid>/status``; psutil is not a dependency and this line is all it would
read) and the messages / bytes of every JetStream stream (KV buckets are streams too).

The verdict is pure (:func:`memory_verdict`, :func:`least_squares_slope`): warm-up is excluded
(interpreter imports, pymalloc arenas, connection buffers and caches filling up are not a leak),
then growth from the end of warm-up to the end, and the trend of the last half, must both stay
within an allowance (:class:`FlatRule`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from natsched.bus.connection import Bus

log = logging.getLogger(__name__)

KIB_PER_MIB = 1024
#: The verdict ignores the first third of the run, at most 4 minutes: nats-server holds state that
#: is bounded by time, not by requests - every stream's 2-minute duplicate window of message ids,
#: a minute of released-reservation markers, block caches - and fills it for the first ~3 minutes
#: of load (a 500/s soak: 160 MiB at 1 min, ~320 MiB from 3.5 min on, no trend after). A leak
#: keeps growing after that and is still caught over the remaining two thirds.
WARMUP_SHARE = 1 / 3
WARMUP_MAX_S = 240.0


def warmup_seconds(duration_s: float) -> float:
    """Seconds at the start of the load that the verdict ignores."""
    return min(WARMUP_SHARE * duration_s, WARMUP_MAX_S)


@dataclass(frozen=True)
class FlatRule:
    """When a process's memory counts as flat after warm-up.

    The allowance is ``max(min_allowance_mib, relative_allowance × RSS at the end of warm-up)``.
    A Python service here holds 40-80 MiB and moves by a few MiB without any leak (pymalloc
    arenas are returned in steps, the GC's generations fill and empty, socket buffers follow the
    load): 10 MiB covers those steps, while a leak of only 100 bytes per request already adds
    ~29 MiB during a 10-minute soak at 500/s. 5 % scales the allowance for a larger process
    (nats-server's caches follow what it stores). Growth still under way at the end is a leak
    that has not had time to add up: the slope of the last half of the samples, extended over
    the whole measured window, must stay within the allowance too (≈ 1.1 MiB/min for a 10-minute
    soak with 10 MiB allowed).
    """

    min_allowance_mib: float = 10.0
    relative_allowance: float = 0.05
    min_samples: int = 3  # after warm-up; fewer cannot show a trend

    def allowance_mib(self, start_mib: float) -> float:
        return max(self.min_allowance_mib, self.relative_allowance * start_mib)


@dataclass
class MemoryVerdict:
    """One process: RSS at the end of warm-up and at the end, and whether that is flat.

    ``flat`` is None when there are too few samples after warm-up to tell.
    """

    start_mib: float
    end_mib: float
    growth_mib: float
    slope_mib_per_min: float  # least squares over every post-warm-up sample
    last_half_slope_mib_per_min: float
    allowance_mib: float
    samples: int
    flat: bool | None
    note: str = ""


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    """Slope of the least-squares line through ``(t seconds, value)``, per minute; 0 for < 2 distinct times."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t == 0:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var_t * 60.0


def memory_verdict(series: list[tuple[float, float | None]], warmup_s: float,
                   rule: FlatRule = FlatRule()) -> MemoryVerdict:
    """The verdict on one process's ``(t seconds since the load started, RSS MiB or None if gone)``.

    A process that disappeared after warm-up is not flat, whatever its memory did before.
    """
    post = [(t, v) for t, v in series if t >= warmup_s]
    known = [(t, v) for t, v in post if v is not None]
    if not known:
        nan = float("nan")
        return MemoryVerdict(nan, nan, nan, nan, nan, nan, 0, None if not post else False,
                             "no samples after warm-up" if not post else "not running")
    start, end = known[0][1], known[-1][1]
    allowance = rule.allowance_mib(start)
    slope = least_squares_slope(known)
    last_half = known[len(known) // 2:] if len(known) >= 4 else known
    last_slope = least_squares_slope(last_half)
    verdict = MemoryVerdict(start, end, end - start, slope, last_slope, allowance, len(known), None)
    if len(known) < len(post):
        verdict.flat, verdict.note = False, "exited during the run"
    elif len(known) < rule.min_samples:
        verdict.note = f"too few samples after warm-up ({len(known)} < {rule.min_samples})"
    else:
        span_min = (known[-1][0] - known[0][0]) / 60.0
        # the fitted line, not the two end samples: a garbage-collected heap saws up and down by
        # tens of MiB (nats-server: +-35 MiB around a level), which says nothing about a trend
        grew = slope * span_min > allowance
        trending = last_slope * span_min > allowance
        verdict.flat = not grew and not trending
        verdict.note = ("grew beyond the allowance" if grew else "") or ("still growing at the end" if trending else "")
    return verdict


@dataclass
class StreamSummary:
    """One stream: stored messages and bytes at the end of warm-up and at the end."""

    start_messages: int
    end_messages: int
    start_bytes: int
    end_bytes: int
    messages_per_min: float


def stream_summaries(samples: list[dict], warmup_s: float) -> dict[str, StreamSummary]:
    """Per stream, from samples shaped like :meth:`MemorySampler.samples` (``t``, ``streams``)."""
    post = [s for s in samples if s["t"] >= warmup_s and s.get("streams")]
    if not post:
        return {}
    out = {}
    for name in sorted({n for s in post for n in s["streams"]}):
        have = [(s["t"], s["streams"][name]) for s in post if name in s["streams"]]
        first, last = have[0][1], have[-1][1]
        out[name] = StreamSummary(first["messages"], last["messages"], first["bytes"], last["bytes"],
                                  least_squares_slope([(t, v["messages"]) for t, v in have]))
    return out


def process_series(samples: list[dict], name: str) -> list[tuple[float, float | None]]:
    """``(t, RSS MiB or None)`` of one process across samples shaped like :meth:`MemorySampler.samples`."""
    out = []
    for s in samples:
        kib = s["rss_kib"].get(name)
        out.append((s["t"], None if kib is None else kib / KIB_PER_MIB))
    return out


def memory_report(samples: list[dict], duration_s: float, sample_every_s: float,
                  rule: FlatRule = FlatRule()) -> dict[str, Any]:
    """What ``bench pipeline`` puts under ``"memory"`` in its JSON: the rule, verdicts and every sample."""
    warmup = warmup_seconds(duration_s)
    names = list(dict.fromkeys(n for s in samples for n in s["rss_kib"]))
    return {
        "sample_every_s": sample_every_s, "warmup_s": warmup, "rule": asdict(rule),
        "processes": {n: asdict(memory_verdict(process_series(samples, n), warmup, rule)) for n in names},
        "streams": {n: asdict(v) for n, v in stream_summaries(samples, warmup).items()},
        "samples": samples,
    }


# --- sampling (I/O) ------------------------------------------------------------------------------


def read_rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB; None when it is gone (a zombie has no VmRSS line either)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:  # gone, or not ours to read
        return None
    return None


def read_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a process has used (``/proc/<pid>/stat``); None when it is gone.

    The pipeline benchmark divides the difference over a run by the requests served: CPU per
    request is what decides the rate a machine sustains, and unlike latency it barely moves when
    something else shares the cores."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)




@dataclass
class MemorySampler:
    """Samples the processes' RSS and the streams' sizes every ``every_s`` from ``t0`` (monotonic).

    Runs as a task on the load generator's event loop: reading ``/proc`` takes microseconds and
    one ``streams_info`` per sample is negligible next to the load.
    """

    pids: dict[str, int]
    bus: Bus
    every_s: float
    t0: float
    samples: list[dict] = field(default_factory=list)

    async def sample(self) -> None:
        t = time.monotonic() - self.t0
        rss = {name: read_rss_kib(pid) for name, pid in self.pids.items()}
        try:
            streams = await asyncio.wait_for(self.bus.stream_sizes(), timeout=max(1.0, self.every_s))
        except Exception as exc:  # a slow or failed stream listing is a gap, not the end of the run
            log.warning("stream sizes not sampled at t=%.1fs: %s", t, exc)
            streams = {}
        self.samples.append({"t": round(t, 3), "rss_kib": rss, "streams": streams})

    async def run(self) -> None:
        """Sample at t = 0, every_s, 2 × every_s, ... until cancelled."""
        k = 0
        while True:
            await self.sample()
            k += 1
            while (delay := self.t0 + k * self.every_s - time.monotonic()) > 0:
                await asyncio.sleep(delay)


# --- output ----------------------------------------------------------------------------------------


def _fmt(value: float, spec: str) -> str:
    return "-" if value != value else format(value, spec)


def print_memory(report: dict[str, Any]) -> None:
    """The memory table (one row per process), then the streams' stored messages."""
    rule = report["rule"]
    print(f"memory after warm-up (first {report['warmup_s']:.1f} s excluded; flat = growth and the last half's "
          f"trend within max({rule['min_allowance_mib']:.0f} MiB, {rule['relative_allowance']:.0%}))")
    print(f"{'process':<16} {'start MiB':>10} {'end MiB':>9} {'slope MiB/min':>14} {'flat?':>6}  note")
    for name, v in report["processes"].items():
        flat = "?" if v["flat"] is None else ("yes" if v["flat"] else "NO")
        print(f"{name:<16} {_fmt(v['start_mib'], '10.1f')} {_fmt(v['end_mib'], '9.1f')} "
              f"{_fmt(v['slope_mib_per_min'], '14.2f')} {flat:>6}  {v['note']}".rstrip())
    if report["streams"]:
        print(f"{'stream':<16} {'msgs start':>10} {'msgs end':>9} {'msgs/min':>9} {'MiB end':>8}")
        for name, s in report["streams"].items():
            print(f"{name:<16} {s['start_messages']:>10} {s['end_messages']:>9} {s['messages_per_min']:>9.0f} "
                  f"{s['end_bytes'] / (1 << 20):>8.1f}")


def soak_summary(report: dict[str, Any], lost: int) -> str:
    """One line for the end of a soak: nothing lost and every process flat, or what was not."""
    procs = report["processes"]
    bad = [f"{n} ({v['note'] or 'not flat'})" for n, v in procs.items() if v["flat"] is False]
    unknown = [n for n, v in procs.items() if v["flat"] is None]
    memory = (f"memory NOT flat: {', '.join(bad)}" if bad else
              f"memory flat in {len(procs) - len(unknown)} of {len(procs)} processes"
              + (f" ({', '.join(unknown)}: too few samples)" if unknown else ""))
    return f"soak: {'nothing' if lost == 0 else lost} lost; {memory}"
