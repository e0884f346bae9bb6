"""The audit: a request's story and a window's numbers, from what JetStream kept.

REQUESTS, DECISIONS and COMPLETIONS are limits streams (kept for days, see ``subjects.md``), so
a request's whole story can be rebuilt from them. The reading is the transport's
(:mod:`natsched.bus.streams`: by time window, by sequence, filtered by subject); here is the pure
assembly on top of it: :func:`timeline` orders one request's records into events, and
:func:`summarize` condenses a time window (counts by decision and reason, TTFT percentiles, the
prefix-cache hit ratio). The command line formats both (``natsched audit``).

Errors::

    NatschedError (natsched.errors)
    └── AuditError              the audit cannot be answered
        └── AuditNotFound       no record of that request id in the searched window

(A stream that cannot be read raises :class:`natsched.bus.errors.ReadError`.)
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from natsched.bus.streams import Stored
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire.ids import unscoped
from natsched.errors import NatschedError
from natsched.wire import subjects as S
from natsched.stats import percentile  # re-exported: sim.replay reads it here
from natsched.wire.errors import MessageError
from natsched.wire.schema import Completion, CompletionStatus, Decision, JobRecord, Request

if TYPE_CHECKING:
    from natsched.bus.connection import Bus

log = logging.getLogger(__name__)


class AuditError(NatschedError):
    """An audit question that cannot be answered (bad window, stream missing)."""


class AuditNotFound(AuditError):
    """No record of the request id in the searched streams and window."""


def matches(msg_id: str, ids: Iterable[str]) -> bool:
    """A record of one of ``ids``: its ``Nats-Msg-Id`` is the id or ``<id>:<stage>``, the id as
    given or in a tenant's scope (``natsched.wire.ids.scoped``: the id its producer chose then
    finds it, of whichever tenant; the scoped id finds one tenant's)."""
    rid = M.request_of(msg_id)
    return rid in ids or unscoped(rid) in ids


# ------------------------------------------------------------------ pure assembly

@dataclass
class Event:
    ts: float
    stage: str  # submitted | admission | queue | offline | routing | completion | job
    what: str  # the decision / status
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"ts": self.ts, "stage": self.stage, "what": self.what, **self.detail}


def _decision_event(d: Decision) -> Event:
    keep = ("request_id", "reason", "retry_after", "runtime_tokens", "budget", "queue_wait", "worker", "policy",
            "scores", "expected_cached_tokens", "by", "latency_ms")
    detail = {k: getattr(d, k) for k in keep if getattr(d, k) is not None}
    stage = d.stage if not (d.stage == "admission" and d.decision == "queue") else "queue"
    return Event(d.ts, stage, d.decision, detail)


def _completion_event(c: Completion) -> Event:
    keep = ("request_id", "worker", "reason", "finish_reason", "prompt_tokens", "cached_tokens", "output_tokens",
            "ttft", "tpot", "e2e", "expected_cached_tokens", "runtime_tokens")
    return Event(c.ts, "completion", c.status, {k: getattr(c, k) for k in keep if getattr(c, k) is not None})


def timeline(request: Request | None, submitted: Stored | None, decisions: list[Decision],
             completions: list[Completion], job: JobRecord | None = None) -> dict[str, Any]:
    """One request's story, oldest event first, plus the figures an operator asks for first."""
    events = []
    if submitted is not None:
        detail = {"subject": submitted.subject}
        if request is not None:
            detail.update(cls=request.cls, model=request.model, max_tokens=request.max_tokens,
                          prompt_tokens=_prompt_tokens(request))
        events.append(Event(submitted.ts, "submitted", "stored", detail))
    events += [_decision_event(d) for d in decisions] + [_completion_event(c) for c in completions]
    events.sort(key=lambda e: e.ts)
    final = next((c for c in reversed(sorted(completions, key=lambda c: c.ts))), None)
    admission = [d for d in decisions if d.stage == "admission"]
    routing = [d for d in decisions if d.stage == "routing"]
    out: dict[str, Any] = {
        "id": request.id if request else (job.id if job else None),
        "tenant": request.tenant if request else (job.tenant if job else None),
        "class": request.cls if request else None,
        "events": [e.to_json() for e in events],
        "admission": admission[-1].decision if admission else None,
        "queue_wait": next((d.queue_wait for d in reversed(decisions) if d.queue_wait), None),
        "worker": final.worker if final else (routing[-1].worker if routing else None),
        "cached_tokens": final.cached_tokens if final else None,
        "ttft": final.ttft if final else None,
        "outcome": _outcome(final, admission, job),
    }
    if job is not None:
        out["job"] = {"status": job.status, "attempts": job.attempts, "batch": job.batch, "reason": job.reason,
                      "path": job.path, "output_tokens": job.output_tokens, "updated": job.updated}
    return out


def _prompt_tokens(request: Request) -> int:
    from natsched.wire.blocks import estimate_prompt_tokens

    return estimate_prompt_tokens(request)


def _outcome(final: Completion | None, admission: list[Decision], job: JobRecord | None) -> str:
    if job is not None and job.status.final:
        return job.status + (f" ({job.reason})" if job.reason else "")
    if final is not None:
        return "completed" if final.status == CompletionStatus.OK else f"failed ({final.reason})"
    if admission and admission[-1].decision == "reject":
        return f"rejected ({admission[-1].reason})"
    if job is not None:
        return job.status
    return "in flight (no completion recorded yet)"


def summarize(requests: int, decisions: list[Decision], completions: list[Completion]) -> dict[str, Any]:
    """A window in numbers; every count is 0 and every figure None when the window is empty."""
    by_decision: dict[str, dict[str, int]] = {}
    for d in decisions:
        key = f"{d.stage}.{d.decision}"
        reasons = by_decision.setdefault(key, {})
        reasons[d.reason or "-"] = reasons.get(d.reason or "-", 0) + 1
    ok = [c for c in completions if c.status == CompletionStatus.OK]
    failed: dict[str, int] = {}
    for c in completions:
        if c.status != CompletionStatus.OK:
            failed[c.reason or "error"] = failed.get(c.reason or "error", 0) + 1
    prompt = sum(c.prompt_tokens for c in ok)
    waits = [d.queue_wait for d in decisions if d.stage == "admission" and d.queue_wait]
    offline_waits = [d.queue_wait for d in decisions if d.stage == S.STAGE_OFFLINE and d.decision == "allow"
                     and d.queue_wait is not None]
    workers: dict[str, int] = {}
    for c in ok:
        workers[c.worker or "?"] = workers.get(c.worker or "?", 0) + 1
    return {
        "requests": requests,
        "decisions": {k: dict(sorted(v.items())) for k, v in sorted(by_decision.items())},
        "completed": len(ok),
        "failed": dict(sorted(failed.items())),
        "ttft_p50_s": percentile([c.ttft for c in ok], 50),
        "ttft_p99_s": percentile([c.ttft for c in ok], 99),
        "queue_wait_p50_s": percentile(waits, 50),
        "queue_wait_p99_s": percentile(waits, 99),
        "offline_wait_p50_s": percentile(offline_waits, 50),
        "offline_wait_p99_s": percentile(offline_waits, 99),
        "hit_ratio": (sum(c.cached_tokens for c in ok) / prompt) if prompt else None,
        "workers": dict(sorted(workers.items())),
    }


def decode_all(records: Iterable[Stored], schema: type) -> list:
    """Decode what can be decoded; a record that cannot is logged and left out of the audit."""
    out = []
    for r in records:
        try:
            out.append(schema.decode(r.data))
        except MessageError as exc:
            log.warning("audit: %s seq %d is not a %s: %s", r.subject, r.seq, schema.__name__, exc)
    return out


def unfold(decisions: Iterable[Decision]) -> list[Decision]:
    """Every decision record, also those stored inside another (an inline router's routing record
    carries its admission record: :meth:`~natsched.wire.schema.Decision.unfolded`)."""
    return [record for d in decisions for record in d.unfolded()]


def decode_completions(records: Iterable[Stored], fence_key: str | None) -> list[Completion]:
    """The completions a worker published for an attempt assigned to it (:mod:`natsched.wire.fence`):
    a forged or stale one is stored too (the server cannot tell), but it is no part of a
    request's story, exactly as it released nothing."""
    out = []
    for r in records:
        for c in decode_all([r], Completion):
            if fence.fenced(fence_key, c, r.subject):
                out.append(c)
            else:
                log.warning("audit: %s seq %d is not from the worker its attempt was assigned to; left out",
                            r.subject, r.seq)
    return out


def accepted(completions: Iterable[Completion], decisions: Iterable[Decision] = ()) -> list[Completion]:
    """Of fenced ``completions`` (in stored order), the one per request id the admitters accepted:
    the first of its current attempt. A request has exactly one accepted completion; any other
    (a run of an attempt since rescued, or a second run of the same attempt on another worker,
    e.g. a hand-off repeated after a server restart) is stale: it released nothing, so it is no
    part of the request's story or of a window's counts either.

    Why this is the admitters' choice: a completion frees the reservation only if the record's
    attempt is its own (:meth:`natsched.admitter.shared.SharedState.take`), and a rescue moves the
    attempt on only while the record exists (compare-and-swap on both sides). So an attempt
    above another was started only after the other's completion was refused, and within one
    attempt the first stored takes the record. The current attempt is the highest one a
    completion or a ``rescue`` decision (one per attempt) names: a request rescued and still
    running has no accepted completion yet, only stale ones."""
    completions = list(completions)
    current: dict[str, int] = {}
    for d in decisions:
        if d.stage == "admission" and d.decision == "rescue":
            current[d.request_id] = current.get(d.request_id, 0) + 1
    for c in completions:
        current[c.request_id] = max(current.get(c.request_id, 0), c.attempt)
    out, done = [], set()
    for c in completions:
        if c.request_id in done or c.attempt != current[c.request_id]:
            log.info("audit: a stale completion of %s (attempt %d, worker %s) left out: another one was accepted",
                     c.request_id, c.attempt, c.worker)
            continue
        done.add(c.request_id)
        out.append(c)
    return out


# ------------------------------------------------------------------ the two questions

async def _find(bus: "Bus", stream: str, ids: set[str], since: float | None, until: float | None,
                subject: str | tuple[str, ...] | None) -> list[Stored]:
    return await bus.stream(stream).find(lambda msg_id: matches(msg_id, ids), since, until, subject)


async def audit_request(bus: "Bus", request_id: str, since: float | None = None, until: float | None = None,
                        job: JobRecord | None = None) -> dict[str, Any]:
    """One request's timeline from REQUESTS, DECISIONS and COMPLETIONS (and its job record, whose
    attempts run under their own ids). Raises :class:`AuditNotFound` when nothing names it."""
    S.token(request_id, "request id")
    ids = {request_id} | set(job_attempt_ids(job))
    tenant = job.tenant if job is not None else None
    start = since if since is not None else (job.created - 5.0 if job is not None and job.created else None)
    found = await _find(bus, S.STREAM_REQUESTS, {request_id}, start, until,
                        S.stored_requests_of(tenant) if tenant else None)
    requests = decode_all(found, Request)
    request = requests[0] if requests else (job.request if job is not None else None)
    if request is not None:
        tenant = request.tenant
    t0 = found[0].ts - 1.0 if found else start
    decisions = unfold(decode_all(await _find(bus, S.STREAM_DECISIONS, ids, t0, until,
                                              S.decisions_of(tenant) if tenant else None), Decision))
    completions = decode_completions(await _find(bus, S.STREAM_COMPLETIONS, ids, t0, until,
                                                 S.completions_of(tenant) if tenant else None), bus.fence_key)
    if not found and not decisions and not completions and job is None:
        kept = await bus.stream(S.STREAM_REQUESTS).retention()
        oldest = f"; the oldest stored request is from {when(kept.first_ts)}" if kept.first_ts else ""
        raise AuditNotFound(f"request {request_id} not found in REQUESTS, DECISIONS or COMPLETIONS "
                            f"({kept.describe()}{oldest})")
    return timeline(request, found[0] if found else None, decisions, accepted(completions, decisions), job)


def job_attempt_ids(job: JobRecord | None) -> list[str]:
    """The ids a job's attempts ran under (the first is the job id itself)."""
    if job is None:
        return []
    from natsched.wire.ids import attempt_id

    return [attempt_id(job.id, n) for n in range(1, max(1, job.attempts) + 1)]


async def audit_window(bus: "Bus", since: float, until: float | None = None, tenant: str | None = None
                       ) -> dict[str, Any]:
    """A window of one tenant (or all): counts, percentiles and the hit ratio; never raises for an
    empty window (every count is 0), and notes when part of it has aged out."""
    if until is not None and until < since:
        raise AuditError(f"--until ({when(until)}) is before --since ({when(since)})")
    requests = 0
    async for _ in bus.stream(S.STREAM_REQUESTS).window(since, until, S.stored_requests_of(tenant) if tenant else None,
                                                        headers_only=True):
        requests += 1
    decisions = unfold(decode_all([m async for m in bus.stream(S.STREAM_DECISIONS).window(
        since, until, S.decisions_of(tenant) if tenant else None)], Decision))
    completions = decode_completions([m async for m in bus.stream(S.STREAM_COMPLETIONS).window(
        since, until, S.completions_of(tenant) if tenant else None)], bus.fence_key)
    out = {"tenant": tenant, "since": since, "until": until,
           **summarize(requests, decisions, accepted(completions, decisions))}
    kept = await bus.stream(S.STREAM_REQUESTS).retention()
    if kept.lost_some and kept.first_ts is not None and since < kept.first_ts - 1.0:
        out["note"] = f"data before {when(kept.first_ts)} has aged out: {kept.describe()}"
    return out


def when(ts: float | None) -> str:
    """A local ISO time to the second (``-`` for none), as audit and replay messages name times."""
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


#: completions of requests routed up to ``--until`` are read this long past it (a request's
#: completion comes after its routing decision, by its end-to-end time)
COMPLETION_GRACE_S = 600.0


async def audit_by_policy(bus: "Bus", since: float, until: float | None = None, tenant: str | None = None,
                          baseline: str | None = None) -> dict[str, Any]:
    """The window's requests by routing policy (:mod:`natsched.audit.compare`): a request belongs
    to the window when its routing decision does; its completion may come up to
    :data:`COMPLETION_GRACE_S` after ``until``. The baseline is ``baseline``, else the live
    policy of the routing config in force (the config bucket), else the busiest policy."""
    import orjson

    from natsched.audit.compare import compare, group

    if until is not None and until < since:
        raise AuditError(f"--until ({when(until)}) is before --since ({when(since)})")
    decisions = decode_all([m async for m in bus.stream(S.STREAM_DECISIONS).window(
        since, until, S.decisions_of(tenant) if tenant else None)], Decision)
    done_until = None if until is None else until + COMPLETION_GRACE_S
    completions = decode_completions([m async for m in bus.stream(S.STREAM_COMPLETIONS).window(
        since, done_until, S.completions_of(tenant) if tenant else None)], bus.fence_key)
    from natsched.bus.errors import StreamNotFound

    config, revision = None, None
    try:
        current = await bus.kv(S.BUCKET_CONFIG).get(S.KEY_ROUTER_CONFIG)
    except StreamNotFound:
        current = None
    if current is not None:
        try:
            config, revision = orjson.loads(current[0]), current[1]
        except orjson.JSONDecodeError:
            log.warning("audit: the routing config is not JSON; no live policy to compare against")
    if not isinstance(config, dict):
        config = None
    chosen = baseline or (config or {}).get("policy")
    out = {"tenant": tenant, "since": since, "until": until, **compare(group(decisions, completions), chosen)}
    if baseline is not None and out["baseline"] != baseline:
        out["note"] = f"--baseline {baseline} routed nothing in the window; compared with {out['baseline']}"
    out["config"] = None if config is None else {
        "revision": revision, "policy": config.get("policy"), "canary": config.get("canary"),
        "canary_share": config.get("canary_share")}
    return out
