"""The audit reader: what JetStream kept about requests, read back by time.

REQUESTS, DECISIONS and COMPLETIONS are limits streams (kept for days, see ``subjects.md``), so
a request's whole story can be rebuilt from them: :func:`read_window` walks a stream from a
start time (an ephemeral pull consumer with ``DeliverPolicy.BY_START_TIME``, optionally headers
only, which makes scanning for one id cheap: bodies are fetched only for the matches).
:func:`read_filtered` (and :func:`kv_snapshot` on it) reads the way a role confined to some
subjects may: its batch producer's own requests and job records (``natsched.ops.auth``).

On top of it, pure assembly: :func:`timeline` orders one request's records into events, and
:func:`summarize` condenses a time window (counts by decision and reason, TTFT percentiles, the
prefix-cache hit ratio). The command line formats both (``natsched audit``).

Errors::

    NatschedError (natsched.errors)
    └── AuditError              the audit cannot be answered
        └── AuditNotFound       no record of that request id in the searched window
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable

from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import NotFoundError

from natsched.wire import fence
from natsched.wire import subjects as S
from natsched.wire import msgids as M
from natsched.errors import NatschedError
from natsched.wire.errors import MessageError
from natsched.wire.schema import Completion, CompletionStatus, Decision, JobRecord, Request
from natsched.bus.snapshot import KV_DELETE, KV_OPERATION, KV_PURGE

log = logging.getLogger(__name__)


class AuditError(NatschedError):
    """An audit question that cannot be answered (bad window, stream missing)."""


class AuditNotFound(AuditError):
    """No record of the request id in the searched streams and window."""


@dataclass
class Stored:
    """One stored message: subject, body (empty when read headers-only), headers, position, time."""

    subject: str
    data: bytes
    headers: dict[str, str]
    seq: int
    ts: float

    @property
    def msg_id(self) -> str:
        return self.headers.get(S.HDR_MSG_ID, "")


@dataclass
class Retention:
    """A stream's limits and what it holds now (for "aged out" messages)."""

    stream: str
    max_age_s: float
    max_bytes: int
    messages: int
    first_ts: float | None  # oldest stored message, None when empty
    first_seq: int = 0  # > 1: older messages were removed (limits, purge)

    @property
    def lost_some(self) -> bool:
        return self.first_seq > 1

    def describe(self) -> str:
        return f"{self.stream} keeps messages for {fmt_age(self.max_age_s)} and at most {fmt_size(self.max_bytes)}"


def fmt_age(seconds: float) -> str:
    if not seconds:
        return "ever"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def fmt_size(n: int) -> str:
    if n is None or n < 0:
        return "unlimited bytes"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


async def retention(js: Any, stream: str) -> Retention:
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        raise AuditError(f"stream {stream} does not exist (has natsched ever run on this server?)") from None
    state = info.state
    first = await fetch(js, stream, state.first_seq) if state.messages else None
    return Retention(stream, info.config.max_age or 0.0, info.config.max_bytes, state.messages,
                     first.ts if first else None, state.first_seq)


def _iso_ts(value: Any) -> float | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


async def read_window(
    js: Any,
    stream: str,
    since: float | None = None,
    until: float | None = None,
    subject: str | None = None,
    headers_only: bool = False,
    batch: int = 512,
) -> AsyncIterator[Stored]:
    """Every message of ``stream`` stored in ``[since, until]`` (unix seconds; None = open end),
    oldest first, optionally only ``subject`` (wildcards allowed). Ends at the newest message."""
    config = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.BY_START_TIME if since else api.DeliverPolicy.ALL,
        opt_start_time=dt.datetime.fromtimestamp(since, dt.timezone.utc) if since else None,
        headers_only=headers_only or None,
        inactive_threshold=60.0,
        filter_subject=subject,
        mem_storage=True,
    )
    try:
        last = (await js.stream_info(stream)).state.last_seq  # a busy stream is read up to here, not chased
        psub = await js.pull_subscribe(subject or "", durable=None, stream=stream, config=config)
    except NotFoundError:
        raise AuditError(f"stream {stream} does not exist (has natsched ever run on this server?)") from None
    info = await psub.consumer_info()
    try:
        pending = info.num_pending
        while pending > 0:
            try:
                msgs = await psub.fetch(min(batch, pending), timeout=2.0)
            except (NatsTimeout, asyncio.TimeoutError):
                break  # the stream shrank under us (limits): what is left is newer than we need
            for msg in msgs:
                meta = msg.metadata
                ts = meta.timestamp.timestamp()
                if (until is not None and ts > until) or meta.sequence.stream > last:
                    return
                yield Stored(msg.subject, msg.data or b"", dict(msg.headers or {}), meta.sequence.stream, ts)
                pending = meta.num_pending
    finally:
        try:
            await psub.unsubscribe()
            await js.delete_consumer(stream, info.name)
        except Exception:  # it expires by itself anyway (inactive_threshold)
            pass


async def fetch(js: Any, stream: str, seq: int) -> Stored | None:
    """One message by stream sequence (its body, after a headers-only scan), None if gone."""
    try:
        raw = await js.get_msg(stream, seq)
    except NotFoundError:
        return None
    return Stored(raw.subject, raw.data or b"", dict(raw.headers or {}), raw.seq, _raw_ts(raw))


def _raw_ts(raw: Any) -> float:
    value = getattr(raw, "time", None)
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return _iso_ts(value) or 0.0


def matches(msg_id: str, ids: Iterable[str]) -> bool:
    """A record of one of ``ids``: its ``Nats-Msg-Id`` is the id or ``<id>:<stage>``."""
    return M.request_of(msg_id) in ids


async def find_records(js: Any, stream: str, ids: set[str], since: float | None, until: float | None = None,
                       subject: str | None = None) -> list[Stored]:
    """Bodies of the messages whose ``Nats-Msg-Id`` names one of ``ids`` (headers-only scan)."""
    out = []
    async for head in read_window(js, stream, since, until, subject, headers_only=True):
        if matches(head.msg_id, ids):
            full = await fetch(js, stream, head.seq)
            if full is not None:
                out.append(full)
    return out


#: status of a JetStream control message (flow control request, idle heartbeat)
_CONTROL_STATUS = "100"


async def read_filtered(js: Any, stream: str, subject: str, since: float | None = None, last_per_subject: bool = False,
                        headers_only: bool = False, timeout: float = 10.0) -> AsyncIterator[Stored]:
    """The messages of ``stream`` on ``subject`` (wildcards allowed) stored from ``since`` (None: all;
    ``last_per_subject``: only the newest of each subject, as a KV snapshot), oldest first; ends
    once the consumer has nothing more pending.

    Why not :func:`read_window`: a pull consumer is read through ``CONSUMER.MSG.NEXT.<stream>.<name>``,
    a subject that names no filter, so a role allowed it could pull from any consumer of the stream
    (the admitter's, full of other tenants' prompts). Here the ephemeral consumer has a name, so its
    create subject carries the filter (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``, which
    the server checks against the request body), and it pushes to this connection's own inbox: a
    permission on that one create subject confines a role to what it may read (``natsched.ops.auth``).
    Nor does it ask for consumer info or delete the consumer (both name no filter either): the
    consumer goes by itself once nobody listens on its inbox (``inactive_threshold``).
    """
    nc = js._nc
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    config = api.ConsumerConfig(
        name=uuid.uuid4().hex,
        filter_subject=subject,
        deliver_subject=inbox,
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=(api.DeliverPolicy.LAST_PER_SUBJECT if last_per_subject
                        else api.DeliverPolicy.BY_START_TIME if since else api.DeliverPolicy.ALL),
        opt_start_time=dt.datetime.fromtimestamp(since, dt.timezone.utc) if since and not last_per_subject else None,
        headers_only=headers_only or None,
        flow_control=True,  # the server waits for our answer instead of overrunning the inbox
        idle_heartbeat=min(5.0, timeout / 2),
        inactive_threshold=max(5.0, timeout),
        mem_storage=True,
        num_replicas=1,
    )
    try:
        try:
            pending = (await js.add_consumer(stream, config)).num_pending
        except NotFoundError:
            raise AuditError(f"stream {stream} does not exist (has natsched ever run on this server?)") from None
        except (NatsTimeout, asyncio.TimeoutError):
            raise AuditError(f"no answer to reading {subject} from {stream}: the server is busy, or these "
                             "credentials may not read it") from None
        while pending:
            try:
                msg = await sub.next_msg(timeout)
            except (NatsTimeout, asyncio.TimeoutError):
                raise AuditError(f"reading {subject} from {stream} stalled: nothing for {timeout:g}s with "
                                 f"{pending} message(s) pending") from None
            headers = dict(msg.headers or {})
            if headers.get("Status") == _CONTROL_STATUS:
                answer = msg.reply or headers.get(api.Header.CONSUMER_STALLED.value)
                if answer:  # a flow-control request (or a stalled heartbeat): we have read all before it
                    await nc.publish(answer, b"")
                continue
            meta = msg.metadata
            pending = meta.num_pending
            yield Stored(msg.subject, msg.data or b"", headers, meta.sequence.stream, meta.timestamp.timestamp())
    finally:
        await sub.unsubscribe()




async def kv_snapshot(js: Any, bucket: str, pattern: str = ">", timeout: float = 10.0
                      ) -> AsyncIterator[tuple[str, bytes]]:
    """The current (key, value) of every live key of ``bucket`` matching ``pattern``, then the end.

    Read through :func:`read_filtered`, not a KV watch: a watch's consumer is created without a
    name, so its filter is not in the create subject and no permission can confine it; this way a
    tenant's batch role reads ``job.<tenant>.*.*`` and nothing else (``natsched.ops.auth``).
    """
    prefix = S.kv_subject(bucket, "")
    async for msg in read_filtered(js, S.kv_stream(bucket), prefix + pattern, last_per_subject=True, timeout=timeout):
        if msg.headers.get(KV_OPERATION) not in (KV_DELETE, KV_PURGE):
            yield msg.subject[len(prefix):], msg.data


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


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None when there is nothing."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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


# ------------------------------------------------------------------ the two questions

async def audit_request(js: Any, request_id: str, since: float | None = None, until: float | None = None,
                        job: JobRecord | None = None, fence_key: str | None = None) -> dict[str, Any]:
    """One request's timeline from REQUESTS, DECISIONS and COMPLETIONS (and its job record, whose
    attempts run under their own ids). Raises :class:`AuditNotFound` when nothing names it."""
    S.token(request_id, "request id")
    ids = {request_id} | set(job_attempt_ids(job))
    tenant = job.tenant if job is not None else None
    start = since if since is not None else (job.created - 5.0 if job is not None and job.created else None)
    found = await find_records(js, S.STREAM_REQUESTS, {request_id}, start, until,
                               S.requests_of(tenant) if tenant else None)
    requests = decode_all(found, Request)
    request = requests[0] if requests else (job.request if job is not None else None)
    if request is not None:
        tenant = request.tenant
    t0 = found[0].ts - 1.0 if found else start
    decisions = decode_all(await find_records(js, S.STREAM_DECISIONS, ids, t0, until,
                                              S.decisions_of(tenant) if tenant else None), Decision)
    completions = decode_completions(await find_records(js, S.STREAM_COMPLETIONS, ids, t0, until,
                                                        S.completions_of(tenant) if tenant else None), fence_key)
    if not found and not decisions and not completions and job is None:
        kept = await retention(js, S.STREAM_REQUESTS)
        oldest = f"; the oldest stored request is from {_when(kept.first_ts)}" if kept.first_ts else ""
        raise AuditNotFound(f"request {request_id} not found in REQUESTS, DECISIONS or COMPLETIONS "
                            f"({kept.describe()}{oldest})")
    return timeline(request, found[0] if found else None, decisions, completions, job)


def job_attempt_ids(job: JobRecord | None) -> list[str]:
    """The ids a job's attempts ran under (the first is the job id itself)."""
    if job is None:
        return []
    from natsched.client.batch import attempt_id

    return [attempt_id(job.id, n) for n in range(1, max(1, job.attempts) + 1)]


async def audit_window(js: Any, since: float, until: float | None = None, tenant: str | None = None,
                       fence_key: str | None = None) -> dict[str, Any]:
    """A window of one tenant (or all): counts, percentiles and the hit ratio; never raises for an
    empty window (every count is 0), and notes when part of it has aged out."""
    if until is not None and until < since:
        raise AuditError(f"--until ({_when(until)}) is before --since ({_when(since)})")
    requests = 0
    async for _ in read_window(js, S.STREAM_REQUESTS, since, until, S.requests_of(tenant) if tenant else None,
                               headers_only=True):
        requests += 1
    decisions = decode_all([m async for m in read_window(js, S.STREAM_DECISIONS, since, until,
                                                         S.decisions_of(tenant) if tenant else None)], Decision)
    completions = decode_completions([m async for m in read_window(js, S.STREAM_COMPLETIONS, since, until,
                                                                   S.completions_of(tenant) if tenant else None)],
                                     fence_key)
    out = {"tenant": tenant, "since": since, "until": until, **summarize(requests, decisions, completions)}
    kept = await retention(js, S.STREAM_REQUESTS)
    if kept.lost_some and kept.first_ts is not None and since < kept.first_ts - 1.0:
        out["note"] = f"data before {_when(kept.first_ts)} has aged out: {kept.describe()}"
    return out


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")
