"""Replay: what a recorded window would have looked like under another routing policy.

The recorded requests of a window (REQUESTS), the routing decisions the live router made for them
(DECISIONS) and their completions (COMPLETIONS) are read back; the requests that were routed are
replayed in the discrete-event simulator (:mod:`natsched.sim.des`, the shipping ``RouterCore`` and the
``SimCore`` engine model) with their recorded arrival at the router, prompt (its prefix chain, as
the router hashes it) and actual output length. Each is run twice: under the policy the live
router used (the simulator's own baseline, so model error cancels out) and under the candidate
policy; the live figures sit beside both.

Times: TTFT and latency are measured from the routing decision (the live worker measures TTFT
from when it picked the request up, which is the same moment up to a dispatch hop). Live sim
workers run ``time_scale`` times the profile's step times; pass the same ``time_scale`` and the
replay is stretched and scaled back to match.

Errors (``natsched.sim.errors.SimError`` is the root)::

    SimError
    └── ReplayError             the window cannot be replayed
        └── WindowAgedOut       its messages are gone (the message names the retention)
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from natsched.wire import subjects as S
from natsched.audit.records import decode_all, percentile, when
from natsched.wire.blocks import estimate_prompt_tokens, request_block_hashes
from natsched.wire.schema import Completion, CompletionStatus, Decision, Request
from natsched.sim.des import SimResult, SimSettings, simulate
from natsched.sim.errors import SimError
from natsched.sim.trace import Trace, TraceRequest
from natsched.workers.profiles import DEFAULT_PROFILE

if TYPE_CHECKING:
    from natsched.bus.connection import Bus

SLACK_S = 600.0  # completions of the window's requests may land this long after it ends
METRICS = ("requests", "completed", "failed", "ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s",
           "hit_ratio", "workers_used", "load_cv")


class ReplayError(SimError):
    """The window cannot be replayed."""


class WindowAgedOut(ReplayError):
    """The window's messages are no longer stored."""


@dataclass
class Recorded:
    """One request as the live system ran it."""

    request: Request
    arrival: float  # the routing decision (else the request's storage time)
    policy: str | None = None
    worker: str | None = None
    completion: Completion | None = None


@dataclass
class Recording:
    since: float
    until: float | None
    submitted: int  # requests stored in the window (routed or not)
    routed: list[Recorded] = field(default_factory=list)


# ------------------------------------------------------------------ reading (I/O)

async def load_recording(bus: "Bus", since: float, until: float | None = None, tenant: str | None = None
                         ) -> Recording:
    """Everything needed to replay ``[since, until]``; :class:`WindowAgedOut` when it is gone."""
    stored = [m async for m in bus.stream(S.STREAM_REQUESTS).window(since, until,
                                                                    S.stored_requests_of(tenant) if tenant else None)]
    if not stored:
        await _check_aged_out(bus, since, until)
        return Recording(since, until, 0)
    horizon = (until if until is not None else stored[-1].ts) + SLACK_S
    requests = {r.id: (r, m.ts) for r, m in zip(decode_all(stored, Request), stored)}
    routing = [d for d in decode_all([m async for m in bus.stream(S.STREAM_DECISIONS).window(
        since, horizon, S.decision("routing", tenant) if tenant else None)], Decision)
        if d.stage == "routing"]
    completions = decode_all([m async for m in bus.stream(S.STREAM_COMPLETIONS).window(
        since, horizon, S.completions_of(tenant) if tenant else None)], Completion)
    return Recording(since, until, len(stored), match(requests, routing, completions))


async def _check_aged_out(bus: "Bus", since: float, until: float | None) -> None:
    kept = await bus.stream(S.STREAM_REQUESTS).retention()
    end = until if until is not None else math.inf
    if kept.lost_some and (kept.first_ts is None or since < kept.first_ts) and end < (kept.first_ts or math.inf):
        oldest = f"the oldest stored request is from {when(kept.first_ts)}" if kept.first_ts else \
            "no request is stored any more"
        raise WindowAgedOut(f"the window's requests have aged out: {kept.describe()}, and {oldest} "
                            f"(natsched retention set {S.STREAM_REQUESTS} --max-age ... keeps more)")


def _job_of(request_id: str, requests: dict) -> str | None:
    """The recorded request an id belongs to: itself, or the job whose retry attempt it is."""
    if request_id in requests:
        return request_id
    head, sep, tail = request_id.rpartition("-r")
    return head if sep and tail.isdigit() and head in requests else None


def match(requests: dict[str, tuple[Request, float]], routing: list[Decision], completions: list[Completion]
          ) -> list[Recorded]:
    """The routed requests, each with its last routing decision and its completion."""
    last: dict[str, Decision] = {}
    for d in sorted(routing, key=lambda d: d.ts):
        job = _job_of(d.request_id, requests)
        if job is not None and d.decision == "assign":
            last[job] = d
    done: dict[str, Completion] = {}
    for c in completions:
        job = _job_of(c.request_id, requests)
        if job is not None and job in last and (c.request_id == last[job].request_id):
            done[job] = c
    out = [Recorded(requests[j][0], d.ts, d.policy, d.worker, done.get(j)) for j, d in last.items()]
    return sorted(out, key=lambda r: r.arrival)


# ------------------------------------------------------------------ the replay (pure)

def build_trace(recording: Recording, block_size: int = 32) -> Trace:
    """The routed requests as a simulator trace (arrivals relative to the first)."""
    if not recording.routed:
        raise ReplayError("nothing to replay: no request of the window was routed")
    t0 = recording.routed[0].arrival
    reqs = []
    for i, r in enumerate(recording.routed):
        c = r.completion
        out = c.output_tokens if c is not None and c.status == CompletionStatus.OK and c.output_tokens else \
            (r.request.expected_output_tokens or r.request.max_tokens)
        reqs.append(TraceRequest(index=i, line=i + 1, base_arrival=r.arrival - t0, arrival=r.arrival - t0,
                                 input_length=estimate_prompt_tokens(r.request), output_length=max(1, out),
                                 hashes=request_block_hashes(r.request, block_size)))
    return Trace("recorded window", reqs, block_size)


def recorded_metrics(recording: Recording) -> dict[str, Any]:
    ok = [r for r in recording.routed if r.completion is not None and r.completion.status == CompletionStatus.OK]
    ttft = [r.completion.ttft for r in ok if r.completion.ttft is not None]
    latency = [r.completion.ts - r.arrival for r in ok]
    prompt = sum(r.completion.prompt_tokens for r in ok)
    workers = Counter(r.worker for r in recording.routed if r.worker)
    return _metrics(len(recording.routed), len(ok), ttft, latency,
                    sum(r.completion.cached_tokens for r in ok), prompt, workers)


def replayed_metrics(result: SimResult, time_scale: float = 1.0) -> dict[str, Any]:
    ok = [r for r in result.records if r.status == "ok"]
    ttft = [(r.first_token - r.arrival) * time_scale for r in ok if r.first_token is not None]
    latency = [(r.finish - r.arrival) * time_scale for r in ok]
    workers = Counter(r.worker for r in result.records if r.worker)
    return _metrics(len(result.records), len(ok), ttft, latency, sum(r.cached_tokens for r in ok),
                    sum(r.prompt_tokens for r in ok), workers)


def _metrics(n: int, ok: int, ttft: list[float], latency: list[float], cached: int, prompt: int,
             workers: Counter) -> dict[str, Any]:
    counts = list(workers.values())
    mean = sum(counts) / len(counts) if counts else 0.0
    cv = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts)) / mean if mean else 0.0
    return {"requests": n, "completed": ok, "failed": n - ok, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "latency_p50_s": percentile(latency, 50),
            "latency_p99_s": percentile(latency, 99), "hit_ratio": cached / prompt if prompt else None,
            "workers_used": len(workers), "load_cv": cv}


@dataclass
class ReplayReport:
    since: float
    until: float | None
    submitted: int
    workers: int
    policy: str
    baseline: str
    columns: dict[str, dict[str, Any]]  # "recorded", "replay <baseline>", "replay <policy>"

    def to_json(self) -> dict[str, Any]:
        return {"since": self.since, "until": self.until, "submitted": self.submitted, "workers": self.workers,
                "policy": self.policy, "baseline": self.baseline, "columns": self.columns}


def replay(recording: Recording, policy: str, workers: int | None = None, profile: str = DEFAULT_PROFILE,
           time_scale: float = 1.0, block_size: int = 32) -> ReplayReport:
    """Recorded figures beside the simulator's under the live policy and under ``policy``."""
    if not time_scale > 0:
        raise ReplayError(f"time scale must be > 0, got {time_scale}")
    trace = build_trace(recording, block_size).scaled(time_scale)  # arrivals / scale: the engine's clock
    seen = {r.worker for r in recording.routed if r.worker}
    n = workers or max(1, len(seen))
    baseline = Counter(r.policy for r in recording.routed if r.policy).most_common(1)
    base = baseline[0][0] if baseline else policy
    columns = {"recorded": recorded_metrics(recording)}
    for name in dict.fromkeys((base, policy)):
        result = simulate(trace, SimSettings(workers=n, policy=name, profile=profile))
        columns[f"replay {name}"] = replayed_metrics(result, time_scale)
    return ReplayReport(recording.since, recording.until, recording.submitted, n, policy, base, columns)


def format_report(report: ReplayReport) -> str:
    names = list(report.columns)
    rows = [("", *names)]
    for key in METRICS:
        rows.append((key, *(_cell(report.columns[n][key]) for n in names)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = (f"replay of {report.submitted} recorded requests ({report.columns['recorded']['requests']} routed) "
            f"on {report.workers} simulated workers: live policy {report.baseline} vs {report.policy}")
    foot = "times in seconds from the routing decision; hit = prompt tokens served from the prefix cache"
    return "\n".join([head, "", *lines, "", foot])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
