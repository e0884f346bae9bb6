"""Batch producers and the job store: submit a JSONL file once, read its results any time later.

A batch is a file of JSON lines, each ``{"prompt" | "messages" | "prompt_token_ids", "max_tokens",
...}`` (an OpenAI batch line's ``body`` works too). Ids are deterministic so a batch is submitted
once however often it is run:

- batch id ``b<24 hex>`` = digest of (tenant, class, file bytes); request id ``<batch>-<line>`` in
  the tenant's scope (``_<tag>_<batch>-<line>``, :func:`natsched.wire.ids.scoped`), published with a
  message id keyed by the tenant's reply key (:func:`natsched.wire.msgids.submission`), as the
  client does: a tenant that knows another's file can compute neither the id the admitter would
  take from it (another tenant's tag is refused) nor its dedup slot;
- JetStream's dedup window (2 min) catches a re-run soon after; for later re-runs (``--resume``
  after an interruption) the manifest (``batch.<batch>`` in bucket ``jobs``) and the REQUESTS
  stream itself say which lines are already there, and only the others are published;
- every request carries its own reply subject ``outcome.<tenant>.<batch>.<id>``, which the OUTCOMES
  stream keeps, so results are collected (by the offline runner) even after the producer left;
- each line also gets a job record (``job.<tenant>.<batch>.<id>``) holding the request: a failed
  attempt can be retried without the producer, and ``status``/``results`` read the records.

A malformed line is reported with its line number and skipped; the rest proceeds.

Errors: :class:`natsched.client.errors.BatchError` and its subclasses (the tree is there).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson

from natsched.wire import chat, codec
from natsched.wire import subjects as S
from natsched.wire import msgids as M
from natsched.bus.connection import Bus
from natsched.bus.errors import ConflictError
from natsched.client.errors import BatchError, BatchFileError, JobStoreError, NotFound
from natsched.wire.ids import scoped
from natsched.wire.ids import attempt_id  # noqa: F401 (re-exported: the job model names it here too)
from natsched.wire.errors import ChatError, MessageError
from natsched.wire.schema import BatchManifest, JobRecord, JobStatus, Request, RequestId, TenantId

log = logging.getLogger(__name__)

SUBMITTED, WAITING, RUNNING, COMPLETED, FAILED = (JobStatus.SUBMITTED, JobStatus.WAITING, JobStatus.RUNNING,
                                                   JobStatus.COMPLETED, JobStatus.FAILED)  # short names
JOB_STATUSES = tuple(JobStatus)
FINAL = frozenset(s for s in JobStatus if s.final)
HISTORY_LIMIT = 32  # events kept per job record (the audit streams keep everything)




# ------------------------------------------------------------------ ids (pure)

def batch_id(tenant: str, cls: str, data: bytes) -> str:
    """Same tenant, class and bytes: same batch (and so the same request ids)."""
    digest = hashlib.sha256(b"natsched/batch/v1\0" + tenant.encode() + b"\0" + cls.encode() + b"\0" + data)
    return "b" + digest.hexdigest()[:24]


def request_id(batch: str, line: int, tenant: str) -> RequestId:
    """Line ``line``'s id, in ``tenant``'s scope (the same file of the same tenant: the same id)."""
    return scoped(tenant, f"{batch}-{line}")


def ids_prefix(batch: str, tenant: str) -> str:
    """What every request id of ``batch`` starts with (a batch's ids are never long enough to be
    replaced by a digest: ``b<24 hex>-<line>``)."""
    return request_id(batch, 0, tenant)[:-1]


# ------------------------------------------------------------------ lines (pure)

class LineError(ValueError):
    """One batch line that is not a request; the message says why."""


_SOURCES = ("prompt", "messages", "prompt_token_ids")


def _render_chat(messages: Any, system_prompt: str | None) -> tuple[str | None, str]:
    """Chat messages through the one template (:mod:`natsched.wire.chat`), so a batch line hashes
    like the same conversation sent to the gateway; the line's ``system_prompt`` leads."""
    try:
        rendered = chat.render(messages, system_prompt)
    except ChatError as exc:
        raise LineError(str(exc)) from None
    if all(m["role"] in ("system", "developer") for m in messages):
        raise LineError("'messages' holds only system messages: nothing to answer")
    return rendered


def _int(obj: dict, name: str, minimum: int) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LineError(f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value


def _str(obj: dict, name: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise LineError(f"'{name}' must be a string, got {type(value).__name__}")
    return value


def parse_line(raw: bytes) -> dict[str, Any]:
    """The Request fields one line asks for (no id, tenant or class), or :class:`LineError`."""
    if len(raw) > codec.MAX_MESSAGE_BYTES:
        raise LineError(f"line of {len(raw)} bytes exceeds the {codec.MAX_MESSAGE_BYTES}-byte message limit")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LineError(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("body"), dict):  # OpenAI batch format: {"custom_id", "method", "url", "body"}
        obj = obj["body"]
    given = [k for k in _SOURCES if obj.get(k) is not None]
    if len(given) != 1:
        raise LineError("needs exactly one of 'prompt', 'messages' or 'prompt_token_ids'"
                        + (f" (got {', '.join(given)})" if given else ""))
    fields: dict[str, Any] = {"system_prompt": _str(obj, "system_prompt"), "kb_version": _str(obj, "kb_version"),
                              "model": _str(obj, "model") or "default"}
    if given[0] == "prompt":
        fields["prompt"] = _str(obj, "prompt")
    elif given[0] == "messages":
        fields["system_prompt"], fields["prompt"] = _render_chat(obj["messages"], fields["system_prompt"])
    else:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           and t >= 0 for t in ids):
            raise LineError("'prompt_token_ids' must be a non-empty list of integers >= 0")
        fields["prompt_token_ids"] = ids
    max_tokens = _int(obj, "max_tokens", 1) or _int(obj, "max_completion_tokens", 1)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    fields["expected_output_tokens"] = _int(obj, "expected_output_tokens", 0)
    return {k: v for k, v in fields.items() if v is not None}


@dataclass
class BatchPlan:
    """A parsed batch file: the requests by line, the malformed lines with their reason."""

    id: str
    tenant: str
    cls: str
    digest: str
    lines: int
    requests: list[tuple[int, Request]]
    malformed: dict[int, str]

    def spans(self) -> list[list[int]]:
        return to_spans(line for line, _ in self.requests)


def plan_batch(data: bytes, tenant: str, cls: str = S.BATCH, now: float | None = None) -> BatchPlan:
    """Parse a whole file; blank lines are skipped, malformed ones collected, never fatal."""
    S.token(tenant, "tenant")
    S.token(cls, "class")
    bid = batch_id(tenant, cls, data)
    created = now if now is not None else time.time()
    requests, malformed = [], {}
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        rid = request_id(bid, number, tenant)
        try:
            fields = parse_line(raw)
            req = Request(id=rid, tenant=TenantId(tenant), cls=cls, reply=S.outcome(tenant, bid, rid),
                          created=created, **fields)
            if len(req.encode()) > codec.MAX_MESSAGE_BYTES:
                raise LineError("request exceeds the 1 MiB message limit")
        except (LineError, MessageError) as exc:
            malformed[number] = str(exc)
            continue
        requests.append((number, req))
    return BatchPlan(bid, tenant, cls, hashlib.sha256(data).hexdigest(), len(lines), requests, malformed)


def to_spans(numbers: Iterator[int] | list[int]) -> list[list[int]]:
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return spans


def span_lines(spans: list[list[int]]) -> Iterator[int]:
    for first, last in spans:
        yield from range(first, last + 1)


def note(record: JobRecord, event: str, now: float, **extra: Any) -> None:
    """Append one event to a record's (capped) history and stamp it."""
    entry = {"ts": now, "event": event, "attempt": record.attempts, **{k: v for k, v in extra.items() if v}}
    record.history = (record.history + [entry])[-HISTORY_LIMIT:]
    record.updated = now


def submitted_record(plan: BatchPlan, line: int, req: Request, now: float) -> JobRecord:
    record = JobRecord(id=req.id, tenant=req.tenant, status=SUBMITTED, batch=plan.id, line=line, request=req,
                       created=now)
    note(record, SUBMITTED, now)
    return record


# ------------------------------------------------------------------ the job store (I/O)

class JobStore:
    """Bucket ``jobs``: job records and batch manifests, changed by compare-and-swap."""

    def __init__(self, bus: Bus, max_attempts: int = 50) -> None:
        self.bus = bus
        self.max_attempts = max_attempts
        self.ready = False  # the bucket is known to exist

    async def ensure(self) -> None:
        """The bucket exists (a reader may be the first natsched process on a fresh server)."""
        if not self.ready:
            await self.bus.provision_jobs()
            self.ready = True

    async def get(self, key: str) -> tuple[JobRecord, int] | None:
        """(record, revision), or None when there is none (or it cannot be decoded: logged)."""
        record, rev = await self._read(key)
        return (record, rev) if record is not None else None

    async def _read(self, key: str) -> tuple[JobRecord | None, int]:
        await self.ensure()
        current = await self.bus.kv(S.BUCKET_JOBS).get(key)
        if current is None:
            return None, 0
        try:
            return _decode(key, current[0]), current[1]
        except JobStoreError as exc:  # garbage in the bucket: the next write replaces it
            log.error("%s; treated as absent", exc)
            return None, current[1]

    async def create(self, key: str, record: JobRecord) -> bool:
        """Write a new record; False when one exists already (then it is left alone)."""
        await self.ensure()
        try:
            await self.bus.kv(S.BUCKET_JOBS).create(key, record.encode())
            return True
        except ConflictError:
            return False

    async def update(self, key: str, change: Callable[[JobRecord | None], JobRecord | None]) -> JobRecord | None:
        """``change(current or None) -> new record or None (nothing to write)``, re-run on the fresh
        record after every lost race; returns what is stored afterwards."""
        for _ in range(self.max_attempts):
            record, rev = await self._read(key)
            new = change(_copy(record))
            if new is None:
                return record
            try:
                if rev:
                    await self.bus.kv(S.BUCKET_JOBS).update(key, new.encode(), rev)
                else:
                    await self.bus.kv(S.BUCKET_JOBS).create(key, new.encode())
                return new
            except ConflictError:
                continue
        raise BatchError(f"job record {key} changed {self.max_attempts} times while being updated")

    async def scan(self, pattern: str | None = None) -> list[tuple[str, JobRecord]]:
        """Every current record whose key matches ``pattern`` (:func:`natsched.wire.subjects.job_filter`;
        default: all); a record that cannot be decoded is logged and left out."""
        await self.ensure()
        out = []
        async for key, value in self.bus.kv(S.BUCKET_JOBS).entries(pattern or S.job_filter()):
            try:
                out.append((key, _decode(key, value)))
            except JobStoreError as exc:
                log.error("%s", exc)
        return out

    async def find(self, job_id: str, tenant: str = "*") -> tuple[str, JobRecord] | None:
        """A job by id (of any tenant, or of ``tenant``: a batch role may read only its own)."""
        S.token(job_id, "job id")
        found = await self.scan(S.job_filter(tenant, job_id=job_id))
        return found[0] if found else None

    async def manifest(self, batch: str) -> tuple[BatchManifest, int] | None:
        await self.ensure()
        current = await self.bus.kv(S.BUCKET_JOBS).get(S.batch_key(batch))
        if current is None:
            return None
        try:
            return BatchManifest.decode(current[0]), current[1]
        except MessageError as exc:
            raise JobStoreError(f"batch manifest {batch} cannot be decoded: {exc}") from None

    async def put_manifest(self, manifest: BatchManifest) -> None:
        await self.bus.kv(S.BUCKET_JOBS).put(S.batch_key(manifest.id), manifest.encode())


def _decode(key: str, raw: bytes) -> JobRecord:
    try:
        return JobRecord.decode(raw)
    except MessageError as exc:
        raise JobStoreError(f"job record {key} cannot be decoded: {exc}") from None


def _copy(record: JobRecord | None) -> JobRecord | None:
    return None if record is None else JobRecord.decode(record.encode())


# ------------------------------------------------------------------ the producer (I/O)

@dataclass
class SubmitReport:
    batch: str
    lines: int
    requests: int
    malformed: dict[int, str]
    published: int  # by this run
    already: int  # there before this run (earlier run, or deduplicated)
    resumed: bool = False


@dataclass
class BatchStatus:
    manifest: BatchManifest
    counts: dict[str, int] = field(default_factory=dict)  # job status -> requests; "pending" = no record

    @property
    def requests(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> bool:
        return self.manifest.complete and self.requests == sum(self.counts.get(s, 0) for s in FINAL)


Progress = Callable[[int, int], None]


class BatchClient:
    """Submit batch files and read their results, over an existing :class:`Bus`."""

    def __init__(self, bus: Bus, window: int = 64, checkpoint_s: float = 1.0) -> None:
        self.bus = bus
        self.store = JobStore(bus)
        self.window = window
        self.checkpoint_s = checkpoint_s

    async def prepare(self) -> None:
        """Every stream must exist before the first request (a producer may start before the
        services), and OUTCOMES and the jobs bucket before the first reply is sent."""
        await self.bus.provision(jobs=not self.store.ready)
        self.store.ready = True

    async def submit_file(self, path: str | Path, tenant: str, cls: str = S.BATCH, **kw: Any) -> SubmitReport:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise BatchFileError(f"cannot read batch file {path}: {exc.strerror or exc}") from None
        return await self.submit(data, tenant, cls, source=str(path), **kw)

    async def submit(self, data: bytes, tenant: str, cls: str = S.BATCH, *, source: str = "", rate: float | None = None,
                     resume: bool = False, progress: Progress | None = None) -> SubmitReport:
        """Publish every request line not already there; see the module docstring."""
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be > 0 requests per second, got {rate}")
        await self.prepare()
        plan = plan_batch(data, tenant, cls)
        manifest, existed = await self._manifest(plan, source, resume)
        already = await self._already_there(plan, manifest) if existed else set()
        todo = [(line, req) for line, req in plan.requests if req.id not in already]
        log.info("batch %s: %d requests, %d malformed, %d already there, %d to publish", plan.id, len(plan.requests),
                 len(plan.malformed), len(already), len(todo))
        published = await self._publish(plan, manifest, todo, len(already), rate, progress)
        manifest.submitted, manifest.complete, manifest.updated = len(plan.requests), True, time.time()
        await self.store.put_manifest(manifest)
        return SubmitReport(plan.id, plan.lines, len(plan.requests), plan.malformed, published,
                            len(plan.requests) - published, existed)

    async def _manifest(self, plan: BatchPlan, source: str, resume: bool) -> tuple[BatchManifest, bool]:
        current = await self.store.manifest(plan.id)
        if current is not None:
            return current[0], True
        if resume:
            raise NotFound(f"nothing to resume: no batch {plan.id} was submitted for tenant {plan.tenant!r}, class "
                           f"{plan.cls!r} from this file (has it changed since?)")
        now = time.time()
        manifest = BatchManifest(id=plan.id, tenant=TenantId(plan.tenant), cls=plan.cls, source=source,
                                 digest=plan.digest, lines=plan.lines, spans=plan.spans(),
                                 malformed={str(k): v for k, v in plan.malformed.items()}, created=now, updated=now)
        await self.store.put_manifest(manifest)  # first: an interruption leaves something to resume
        return manifest, False

    async def _already_there(self, plan: BatchPlan, manifest: BatchManifest) -> set[str]:
        """Ids the REQUESTS stream holds since the batch began, plus those whose job record shows
        the system saw them (the stream may have aged out; records live a month).

        Both subjects a request may be stored under (unpartitioned, or in any partition), one
        filtered read each: a read's permission names its one filter (``Stream.filtered``)."""
        prefix = ids_prefix(plan.id, plan.tenant)
        ids = set()
        for subject in S.stored_requests_of(plan.tenant, plan.cls):
            async for head in self.bus.stream(S.STREAM_REQUESTS).filtered(subject, since=manifest.created - 2.0,
                                                                          headers_only=True):
                if head.msg_id.startswith(prefix):
                    ids.add(M.request_of(head.msg_id))
        for _, record in await self.store.scan(S.job_filter(plan.tenant, plan.id)):
            if record.status != SUBMITTED:
                ids.add(record.id)
        return ids

    async def _publish(self, plan: BatchPlan, manifest: BatchManifest, todo: list[tuple[int, Request]],
                       done_before: int, rate: float | None, progress: Progress | None) -> int:
        total = len(plan.requests)
        started = last_checkpoint = time.monotonic()
        published = 0
        step = self.window if rate is None else max(1, min(self.window, int(rate // 10) or 1))
        for i in range(0, len(todo), step):
            chunk = todo[i:i + step]
            if rate is not None:  # the chunk may start once the ones before it were due
                await asyncio.sleep(max(0.0, started + published / rate - time.monotonic()))
            acks = await asyncio.gather(*(self._publish_one(plan, line, req) for line, req in chunk))
            published += sum(acks)
            done = done_before + i + len(chunk)
            if progress is not None:
                progress(done, total)
            if time.monotonic() - last_checkpoint >= self.checkpoint_s:
                manifest.submitted, manifest.updated = done, time.time()
                await self.store.put_manifest(manifest)
                last_checkpoint = time.monotonic()
        if progress is not None and not todo:
            progress(total, total)
        return published

    async def _publish_one(self, plan: BatchPlan, line: int, req: Request) -> int:
        """Record first (the collector may see a reply before we return), then publish."""
        now = time.time()
        await self.store.create(S.job_key(plan.tenant, plan.id, req.id), submitted_record(plan, line, req, now))
        msg_id = M.submission(req.id, self.bus.reply_key(plan.tenant))  # as the client: no other tenant knows it
        ack = await self.bus.jpublish(S.request(plan.cls, plan.tenant), req, msg_id=msg_id,
                                      headers={S.HDR_REPLY: req.reply or ""})
        return 0 if ack.duplicate else 1

    # --- reading ---------------------------------------------------------------------------
    async def manifest(self, batch: str) -> BatchManifest:
        S.token(batch, "batch id")
        current = await self.store.manifest(batch)
        if current is None:
            raise NotFound(f"batch {batch} not found (bucket {S.BUCKET_JOBS} keeps batches 30 days after their "
                           f"last change)")
        return current[0]

    async def records(self, manifest: BatchManifest) -> dict[str, JobRecord]:
        return {r.id: r for _, r in await self.store.scan(S.job_filter(manifest.tenant, manifest.id))}

    async def status(self, batch: str) -> BatchStatus:
        manifest = await self.manifest(batch)
        records = await self.records(manifest)
        counts: dict[str, int] = {}
        for line in span_lines(manifest.spans):
            record = records.get(request_id(manifest.id, line, manifest.tenant))
            key = record.status if record is not None else "pending"
            counts[key] = counts.get(key, 0) + 1
        return BatchStatus(manifest, dict(sorted(counts.items())))

    async def results(self, batch: str) -> list[dict[str, Any]]:
        """One dict per line of the file that held something: ``id``, ``line``, ``status`` and
        ``output`` (completed) or ``error`` (failed, malformed), in line order."""
        manifest = await self.manifest(batch)
        records = await self.records(manifest)
        rows = {}
        for line in span_lines(manifest.spans):
            rid = request_id(manifest.id, line, manifest.tenant)
            rows[line] = result_row(rid, line, records.get(rid))
        for line, why in manifest.malformed.items():
            rows[int(line)] = {"id": None, "line": int(line), "status": "malformed", "error": why}
        return [rows[k] for k in sorted(rows)]


def result_row(rid: str, line: int, record: JobRecord | None) -> dict[str, Any]:
    row: dict[str, Any] = {"id": rid, "line": line, "status": record.status if record else "pending"}
    if record is None:
        return row
    if record.status == COMPLETED:
        row["output"] = record.output or ""
        row.update({k: getattr(record, k) for k in ("output_tokens", "cached_tokens", "worker", "attempts")})
    elif record.status == FAILED:
        row["error"] = f"{record.reason}: {record.message}" if record.message else (record.reason or "failed")
        row["attempts"] = record.attempts
    return row
