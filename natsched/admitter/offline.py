"""The offline runner: degraded and offline work, run only on idle capacity, results kept for weeks.

The admitter puts class ``offline`` work (always) and ``batch``/degradable work (above its degrade
watermark) on the OFFLINE work queue and tells the producer ``degraded`` with a job id. This
service takes that work **only while the shared usage stays below a low watermark of the
admission total** (``low_watermark`` × total): it commits each reservation by compare-and-swap on
the admitters' own ``usage`` key (:class:`natsched.admitter.shared.SharedState`), so the online share above
the watermark is never taken, whatever the admitters decide at the same time. A taken job is
published to ADMITTED like any admitted request (the router and the workers run it as usual) with
a reservation record ``res.<attempt id>``, which the worker's completion releases through the
admitters exactly as for online work.

Every job has a record in bucket ``jobs`` (:mod:`natsched.client.batch`: the batch producer's, or
the admitter's :func:`on_degrade` for a request it degraded); the job's replies go to
``outcome.<tenant>.<batch>.<job id>``, which the OUTCOMES stream keeps until this service folds
them into the record (``completed`` with the output, or a failure). A failure is an outcome with
a reason: transient ones (``no_worker``, ``engine_error``, a timeout, a quota rejection) are retried
under a fresh attempt id up to ``max_attempts``; permanent ones (invalid, too large) and the last
failed attempt end ``failed`` and are dead-lettered on ``dead.offline`` — never dropped.

A worker's outcome is fenced like a producer's reply (:func:`natsched.wire.fence.reply_problem`:
its own sub-subject, the router's reply fence) *and by admission attempt*: a job whose worker died
is rescued as the next attempt of the same attempt id (:mod:`natsched.admitter.rescue`), and the
old worker, only paused, still holds a genuine fence for the old one. Its outcome is refused as
``stale`` (:func:`stale`: older than the reservation's attempt or the record's
``admission_attempt``), as the admitters refuse its completion.

**Partitioned admission** (``partitions`` > 1, :mod:`natsched.admitter.partition`): one runner
still reads all of OFFLINE, and admits each job *through its tenant's partition*: the watermark
applies to that partition's budget (its grant in ``budget/plan``), the reservation is committed
on that partition's usage key and its record kept in that partition's bucket
(``inflight-p<k>``), so the partition's admitters count it, report it to the coordinator as held
and release it on the completion, exactly as their own. Why not a runner per partition or a budget
of its own: a job's tenant already names one partition, so one consumer of OFFLINE needs no
split of the queue, and the coordinator's safety rule stays as it is — the runner never takes
beyond the partition's grant, which the coordinator counts as the partition's potential. A plan
that changes between the runner's read and its commit may lower that grant: the runner re-reads
the plan after committing and gives back what it took if a newer plan came meanwhile (taken
again at the next poll, under the new budget). Before a partition's first plan its grant is 0:
nothing of its tenants runs.

Pure parts first (:class:`IdleGate`, the record transitions), the thin service after.

Errors: :class:`natsched.admitter.errors.SettingsError` for unusable :class:`OfflineSettings`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

from natsched.admitter.budget import BudgetPlan, partition_of, partition_quotas
from natsched.admitter.classes import CLASS_LIMIT, ClassBook
from natsched.admitter.coordinator import decode_plan
from natsched.admitter.move import change_partitions
from natsched.admitter.dynamic import DynamicTotal, DynamicTotalSettings
from natsched.admitter.errors import AdmitterError, SettingsError
from natsched.admitter.policy import AdmissionSettings, runtime_tokens, validate
from natsched.admitter.quotas import Quotas
from natsched.admitter.shared import Reservation, SharedState
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.wire import msgids as M
from natsched.wire import fence
from natsched.client.batch import COMPLETED, FAILED, FINAL, RUNNING, SUBMITTED, WAITING, JobStore, attempt_id, note
from natsched.bus.connection import Bus, ConsumerSpec, Delivery
from natsched.bus.metrics import watch as watch_bus
from natsched.bus.pools import PoolWatch
from natsched.wire.errors import MessageError
from natsched.wire.schema import (Admitted, DeadLetter, Decision, Heartbeat, JobRecord, Reply, ReplyKind, ReplyStatus,
                                  Request)

log = logging.getLogger(__name__)

#: failures no retry can fix: the job ends ``failed`` at once
PERMANENT = frozenset({"invalid", "malformed", "invalid_class", "subject_mismatch", "invalid_max_tokens",
                       "prompt_too_long", "too_large", "unknown_tenant", "model_limit", "deadline_exceeded"})


@dataclass
class OfflineSettings:
    name: str = "offline"
    low_watermark: float = 0.5  # take work while usage + cost stays within this share of the total
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)  # cost and limits, as the admitters
    dynamic: DynamicTotalSettings = field(default_factory=DynamicTotalSettings)  # the admitters' total, followed
    max_attempts: int = 3  # runs of one job before it is failed and dead-lettered
    job_timeout_s: float = 600.0  # a running attempt silent this long counts as failed (reason timeout)
    max_held: int = 256  # OFFLINE messages held un-acked while waiting for capacity
    fetch_batch: int = 64
    ack_wait_s: float = 30.0
    keepalive_s: float = 10.0
    poll_s: float = 0.1  # how often held work is matched against the shared usage
    sweep_interval_s: float = 5.0
    metrics_port: int | None = None
    #: partitioned admission: admit each job through its tenant's partition (module docstring);
    #: None: as many as REQUESTS stores requests in when the runner starts
    partitions: int | None = 1

    def __post_init__(self) -> None:
        if self.partitions is not None and self.partitions < 1:
            raise SettingsError(f"partitions must be >= 1, got {self.partitions}")
        if not 0.0 < self.low_watermark <= 1.0:
            raise SettingsError(f"low_watermark must be in (0, 1], got {self.low_watermark}")
        if self.max_attempts < 1 or self.max_held < 1 or self.fetch_batch < 1:
            raise SettingsError("max_attempts, max_held and fetch_batch must be >= 1")
        for name in ("job_timeout_s", "ack_wait_s", "keepalive_s", "poll_s", "sweep_interval_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be > 0, got {getattr(self, name)}")


# ------------------------------------------------------------------ pure: which work may run now

@dataclass
class Verdicts:
    takes: list[tuple[int, int]]  # (index in held, runtime tokens)
    refusals: list[tuple[int, str, str]]  # (index, reason, message): can never run
    usage: Usage | None  # after the takes; None when nothing was taken
    budget: dict


class IdleGate:
    """Which held requests fit under the low watermark now, oldest first (no overtaking: a large
    job at the head is not starved by small ones behind it)."""

    def __init__(self, settings: OfflineSettings) -> None:
        self.settings = settings

    def cost(self, request: Request) -> int:
        return runtime_tokens(request)

    def is_long(self, cost: int) -> bool:
        return cost >= self.settings.admission.long_threshold_tokens

    def plan(self, usage: Usage, quotas: Quotas, total: int, held: list[Request],
             limits: Quotas | None = None) -> Verdicts:
        """``quotas`` decide what can never run (the cluster's); ``limits`` (default: the same)
        bound what may run now: a partition's share of the caps and limits, ``total`` its budget."""
        room = limits or quotas
        limit = int(self.settings.low_watermark * total)
        ceiling = int(self.settings.low_watermark * quotas.ceiling())
        budget = {"used": usage.used, "total": total, "low_watermark": self.settings.low_watermark,
                  "offline_budget": limit, "held": len(held)}
        out = Verdicts([], [], None, budget)
        new = usage
        for i, req in enumerate(held):
            cost = self.cost(req)
            refusal = self._never(req, cost, quotas, ceiling)
            if refusal:
                out.refusals.append((i, *refusal))
                continue
            if new.used + cost > limit:
                break
            quota = room.tenant_quota(req.tenant) or quotas.tenant_quota(req.tenant)
            model_limit = room.model_limit(req.model)
            if (quota.cap is not None and new.tenant(req.tenant) + cost > quota.cap) or \
                    (model_limit is not None and new.model(req.model) + cost > model_limit):
                continue  # this tenant / model is at its limit: others may still run
            if not _offline_room(new, room, cost):
                break  # the offline class is at its limit (what it lent included): oldest first
            new = new.plus(req.tenant, req.model, cost, self.is_long(cost), S.OFFLINE)
            out.takes.append((i, cost))
        out.usage = new if out.takes else None
        return out

    def _never(self, req: Request, cost: int, quotas: Quotas, ceiling: int) -> tuple[str, str] | None:
        problem = validate(req, self.settings.admission)
        if problem:
            return problem
        quota = quotas.tenant_quota(req.tenant)
        if quota is None:
            return "unknown_tenant", f"tenant {req.tenant!r} has no quota and unknown tenants are rejected"
        if cost > ceiling or (quota.cap is not None and cost > quota.cap):
            return "too_large", (f"{cost} runtime tokens can never fit the offline share ({ceiling} = low watermark "
                                 f"{self.settings.low_watermark:g} x total) or the tenant cap")
        limit = quotas.model_limit(req.model)
        if limit is not None and cost > limit:
            return "model_limit", f"{cost} runtime tokens exceed model {req.model!r}'s limit {limit}"
        offline = quotas.class_limit(S.OFFLINE)
        if offline is not None and cost > offline:
            return CLASS_LIMIT, f"{cost} runtime tokens exceed the offline class limit {offline}"
        return None


def _offline_room(usage: Usage, quotas: Quotas, cost: int) -> bool:
    """Whether the offline class limit (``class.offline.limit``) has ``cost`` free: everything
    the offline path runs counts in class offline, and what online or batch borrowed of it is not
    free (natsched.admitter.classes); it borrows from no one."""
    book = ClassBook(quotas.class_limits, dict(usage.classes), dict(usage.loans))
    room = book.room(S.OFFLINE)
    return room is None or cost <= room


# ------------------------------------------------------------------ pure: what happens to a job record

def on_degrade(request: Request, now: float, by: str) -> tuple[str, JobRecord]:
    """(key, record) the admitter creates as it degrades ``request``, before its producer hears
    the job id: a gateway client told "GET /v1/natsched/jobs/<id>" reads ``waiting`` (on the
    OFFLINE queue, once) at once, not "no such job" until a runner takes it, which may wait long
    for idle capacity. A batch producer's own record is there already; the create leaves it alone
    (the degraded reply on its outcome subject moves it on, :func:`on_reply`)."""
    key, batch = job_of(request)
    record = JobRecord(id=request.id, tenant=request.tenant, status=WAITING, batch=batch, created=now, enqueued=1)
    note(record, "degraded", now, by=by)
    return key, record


def on_take(record: JobRecord | None, request: Request, batch: str, now: float, by: str) -> JobRecord:
    """A new attempt starts (offline path): the record says which id it runs under."""
    if record is None:
        record = JobRecord(id=request.id, tenant=request.tenant, status=WAITING, batch=batch, created=now)
    record.request = record.request or request
    record.attempts += 1
    record.attempt_id = attempt_id(record.id, record.attempts)
    record.status, record.path, record.started, record.worker = RUNNING, "offline", now, None
    record.admission_attempt = 0  # a fresh attempt id starts at its first admission
    note(record, "taken", now, by=by)
    return record


def on_failure(record: JobRecord, reason: str, message: str | None, now: float, max_attempts: int
               ) -> tuple[JobRecord, str]:
    """A failed attempt: ``retry`` (back on the OFFLINE queue) or ``fail`` (final, dead-lettered)."""
    record.reason, record.message = reason, message
    record.attempts = max(1, record.attempts)  # an error before we heard "admitted": that attempt counts
    if reason in PERMANENT or record.request is None or record.attempts >= max_attempts:
        if reason not in PERMANENT and record.request is not None:
            record.message = f"gave up after {record.attempts} attempt(s): {message or reason}"
        record.status, record.finished = FAILED, now
        note(record, FAILED, now, reason=reason)
        return record, "fail"
    record.status, record.enqueued = WAITING, record.enqueued + 1
    note(record, "retry", now, reason=reason)
    return record, "retry"


def on_reply(record: JobRecord | None, reply: Reply, job: tuple[str, str, str], now: float, max_attempts: int
             ) -> tuple[JobRecord | None, str | None]:
    """Fold one reply into the record: (new record or None for "nothing to write", action) where
    action is None, ``requeue`` / ``retry`` (put it on OFFLINE) or ``fail`` (dead-letter it)."""
    tenant, batch, job_id = job
    if record is None:  # a reply for a job nobody recorded (not from a batch producer): keep it anyway
        record = JobRecord(id=job_id, tenant=tenant, status=SUBMITTED, batch=batch, created=now)
    if record.status in FINAL:
        return None, None  # late or duplicate: the first outcome stands
    current = record.attempt_id or record.id
    if reply.request_id not in {attempt_id(record.id, n) for n in range(1, record.attempts + 1)} | {record.id}:
        return None, None  # not one of this job's attempts: someone else's reply on our subject
    if reply.kind == ReplyKind.RESULT:
        return _completed(record, reply, now), None  # any attempt's result: the first one stands
    if reply.kind == ReplyKind.STATUS:
        return _status(record, reply, now), None
    if reply.kind != "error" or reply.request_id != current:
        return None, None  # a token chunk, or an error of an attempt already given up on
    reason = reply.reason or "error"
    if reply.status == ReplyStatus.REJECTED and reply.retry_after is not None and reason not in PERMANENT:
        record.status, record.enqueued, record.reason = WAITING, record.enqueued + 1, reason
        note(record, "requeue", now, reason=reason)
        return record, "requeue"
    return on_failure(record, reason, reply.message, now, max_attempts)


def stale(record: JobRecord | None, reply: Reply, reserved: int = 0) -> bool:
    """Whether a worker's outcome ``reply`` is of an admission attempt since rescued: older than
    the newest attempt its reservation (``reserved``: ``Reservation.attempt``, 0 when released) or
    the record (a ``rerouted`` status, an outcome taken) knows of its attempt id.

    Why both: a rescue moves the reservation's attempt on before it re-admits the request, so
    while the new attempt runs the reservation says so; once that attempt's completion has
    released it, the record has heard the rescue's ``rerouted`` (or taken the new attempt's
    outcome). The old worker's fence is genuine (it was assigned the old attempt), so the fence
    alone cannot tell; the attempt it signs can. Outcomes of an earlier attempt *id* (a retried
    job) are not judged here: :func:`on_reply` keeps the first result of any of them."""
    current = (record.attempt_id or record.id) if record is not None else reply.request_id
    if reply.request_id != current:
        return False
    known = record.admission_attempt if record is not None else 0
    return (reply.attempt or 0) < max(known, reserved)


def _completed(record: JobRecord, reply: Reply, now: float) -> JobRecord:
    record.status, record.finished, record.reason, record.message = COMPLETED, now, None, None
    if reply.request_id == (record.attempt_id or record.id):
        record.admission_attempt = max(record.admission_attempt, reply.attempt or 0)
    record.output = reply.text or ""
    for name in ("worker", "prompt_tokens", "cached_tokens", "output_tokens", "ttft", "tpot"):
        setattr(record, name, getattr(reply, name))
    if record.attempts == 0:  # ran before we heard it was admitted (replies may overtake)
        record.attempts, record.attempt_id, record.path = 1, record.id, record.path or "online"
    note(record, COMPLETED, now)
    return record


def _status(record: JobRecord, reply: Reply, now: float) -> JobRecord | None:
    if reply.status == ReplyStatus.DEGRADED and record.status == SUBMITTED:
        record.status, record.enqueued = WAITING, record.enqueued + 1
        note(record, "degraded", now)
        return record
    if reply.status == ReplyStatus.ADMITTED and record.status in (SUBMITTED, WAITING) and record.attempts == 0:
        record.status, record.path, record.attempts, record.attempt_id = RUNNING, "online", 1, record.id
        record.started = now
        note(record, "admitted", now)
        return record
    if reply.status == ReplyStatus.REROUTED and record.status == RUNNING and reply.request_id == record.attempt_id \
            and (reply.attempt or 0) > record.admission_attempt:  # rescued: only the new attempt's outcome counts
        record.admission_attempt, record.worker = reply.attempt, None
        note(record, "rerouted", now, worker=reply.worker, admission=reply.attempt)
        return record
    if reply.status == ReplyStatus.ASSIGNED and record.status == RUNNING and reply.request_id == record.attempt_id:
        record.worker = reply.worker
        note(record, "assigned", now, worker=reply.worker)
        return record
    return None


def job_of(request: Request) -> tuple[str, str]:
    """(job key, batch) of an OFFLINE request: a batch producer's reply subject names the batch."""
    parsed = S.parse_outcome_subject(request.reply or "")
    batch = parsed[1] if parsed and parsed[0] == request.tenant and parsed[2] == request.id else S.NO_BATCH
    return S.job_key(request.tenant, batch, request.id), batch


# ------------------------------------------------------------------ the service

class OfflineMetrics:
    """Prometheus metrics of one runner replica (names listed in subjects.md, "Offline runner")."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.jobs = Counter("natsched_offline_jobs", "Job events: taken, completed, failed, retried, requeued",
                            ["event"], registry=r)
        self.held = Gauge("natsched_offline_held", "OFFLINE messages held waiting for idle capacity", registry=r)
        self.running = Gauge("natsched_offline_running", "Attempts this replica watches for a timeout", registry=r)
        self.wait = Histogram("natsched_offline_wait_seconds", "Time on the OFFLINE queue before a job was taken",
                              buckets=(0.1, 1, 5, 30, 60, 300, 900, 3600, 4 * 3600, 86400), registry=r)
        self.refused = Counter("natsched_offline_refused_outcomes", "Outcomes refused: not from the worker the "
                               "attempt was assigned to, or of an attempt since rescued (reason: wrong_worker, "
                               "bad_fence, unfenced, stale)", ["reason"], registry=r)


@dataclass
class Held:
    delivery: Delivery
    request: Request
    since: float  # when it was put on the OFFLINE queue


class OfflineRunner:
    def __init__(self, bus: Bus, settings: OfflineSettings | None = None) -> None:
        self.bus = bus
        self.settings = s = settings or OfflineSettings()
        self.gate = IdleGate(s)
        # the admitters release its records; it decides ten times a second at most: no usage mirror
        self.shared = SharedState(bus, s.name, remember=False, watch=False)
        self.partitions = s.partitions or 1  # (None: read from REQUESTS at start)
        self.by_partition: dict[int, SharedState] = {}  # partitioned: each partition's usage key and bucket
        self.store = JobStore(bus)
        self.quotas = Quotas(total=s.admission.default_total)
        self.total = self.quotas.ceiling()
        self.dynamic = DynamicTotal(s.dynamic)
        self.pools = PoolWatch(bus)  # router pools: a job's attempt goes to its model's pool
        self.quota_entries: dict[str, bytes] = {}
        self.worker_load: dict[str, tuple[int, int, float]] = {}
        self.held: list[Held] = []
        self.running: dict[str, tuple[str, float]] = {}  # job key -> (attempt id, started)
        self.metrics = OfflineMetrics()
        watch_bus(self.metrics.registry, self.bus)  # its records lost, reconnects (natsched.bus.metrics)
        self._lock = asyncio.Lock()
        self._offline = ConsumerSpec(S.STREAM_OFFLINE, S.CONSUMER_OFFLINE, S.OFFLINE_ALL, ack_wait_s=s.ack_wait_s,
                                     max_ack_pending=s.max_held, batch=s.fetch_batch)
        self._outcomes = ConsumerSpec(S.STREAM_OUTCOMES, S.CONSUMER_OFFLINE_OUTCOMES, S.OUTCOMES_ALL, batch=128)

    async def start(self) -> None:
        await self.bus.provision(jobs=True)  # keeps `natsched retention set` limits
        if self.settings.partitions is None:
            self.partitions = await self.bus.partitions()
        if self.partitions > 1:
            await change_partitions(self.bus, self.partitions)  # the buckets exist (refused while the old P holds work)
            self.by_partition = {k: SharedState(self.bus, self.settings.name, remember=False, watch=False,
                                                bucket=S.partition_bucket(k)) for k in range(self.partitions)}
        for shared in (self.by_partition or {0: self.shared}).values():
            await shared.start()
        ready = asyncio.Event()
        self.bus.spawn(self._watch_quotas(ready), "offline-quotas")
        await asyncio.wait_for(ready.wait(), 10)
        self._apply_quotas()
        await self.pools.start()
        for key, record in await self.store.scan():
            if record.status == RUNNING and record.attempt_id:
                self.running[key] = (record.attempt_id, record.started or record.updated)
        await self.bus.subscribe(S.HEARTBEATS_ALL, self._on_heartbeat)
        await self.bus.consume_batches(self._outcomes, self._on_outcomes, source="offline")
        await self.bus.consume_batches(self._offline, self._on_offline, source="offline")
        for loop in (self._take_loop, self._keepalive_loop, self._sweep_loop, self._dynamic_loop):
            self.bus.spawn(loop(), f"offline-{loop.__name__}")
        if self.settings.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.settings.metrics_port, registry=self.metrics.registry)
        log.info("offline runner %s ready (low watermark %.2f of %s)", self.settings.name, self.settings.low_watermark,
                 f"{self.total} runtime tokens" if self.partitions == 1 else
                 f"each of {self.partitions} partitions' budgets")

    # --- totals: the same inputs the admitters use ------------------------------------------
    async def _watch_quotas(self, ready: asyncio.Event) -> None:
        async for key, value, _rev in self.bus.kv(S.BUCKET_QUOTAS).watch(">", ready=ready):
            if value is None:
                self.quota_entries.pop(key, None)
            else:
                self.quota_entries[key] = value
            if ready.is_set():
                self._apply_quotas()

    def _apply_quotas(self) -> None:
        quotas, errors = Quotas.from_kv(self.quota_entries, previous=self.quotas,
                                        default_total=self.settings.admission.default_total)
        for err in errors:
            log.error("quota entry ignored: %s", err)
        self.quotas = quotas
        self.total = quotas.ceiling()
        if self.worker_load:
            self._update_total()

    async def _on_heartbeat(self, subject: str, data: bytes, headers: dict) -> None:
        try:
            hb = Heartbeat.decode(data)
        except MessageError:
            return  # the admitters and routers log bad heartbeats
        self.worker_load[hb.worker] = (hb.capacity_tokens, hb.runtime_tokens, time.time())

    async def _dynamic_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.dynamic.interval_s)
            self._update_total()

    def _update_total(self) -> None:
        now = time.time()
        live = [(cap, used) for cap, used, seen in self.worker_load.values() if now - seen < 10.0]
        q = self.quotas
        self.total = self.dynamic.next_total(q.total, q.hard_cap, sum(c for c, _ in live), sum(u for _, u in live))

    # --- taking work ----------------------------------------------------------------------
    async def _on_offline(self, batch: list[Delivery]) -> None:
        for d in batch:
            try:
                await self._hold(d)
            except Exception as exc:  # this message only: bad input dead-lettered, the rest retried
                await self.bus.settle_failed(d, self._offline, "offline", exc)

    async def _hold(self, d: Delivery) -> None:
        """Keep an OFFLINE message until capacity frees (or drop it: its job already ran)."""
        request = Request.decode(d.data)
        if d.subject != S.offline(request.tenant):
            raise MessageError(f"request for tenant {request.tenant!r} published on {d.subject}")
        current = await self.store.get(job_of(request)[0])
        if current is not None and current[0].status in (RUNNING, *FINAL):
            log.info("job %s is already %s: duplicate OFFLINE message dropped", request.id, current[0].status)
            await d.ack()
        elif any(h.request.id == request.id for h in self.held):
            await d.ack()  # the same job twice on the queue: one copy is enough
        else:
            self.held.append(Held(d, request, d.timestamp))

    async def _take_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_s)
            self.metrics.held.set(len(self.held))
            self.metrics.running.set(len(self.running))
            if self.held:
                try:
                    await self.take_once()
                except AdmitterError as exc:
                    log.warning("offline take deferred: %s", exc)
                except Exception:  # a bus blip must not stop the loop; held messages stay held
                    log.exception("offline take failed; trying again")

    async def take_once(self) -> int:
        """Reserve what fits under the watermark (one CAS per partition), then launch it and refuse
        the hopeless."""
        if self.partitions == 1:
            return await self._take(self.shared, list(self.held), self.total)
        plan = await self._plan()
        groups: dict[int, list[Held]] = {}
        for h in self.held:
            groups.setdefault(partition_of(h.request.tenant, self.partitions), []).append(h)
        taken = 0
        for k, held in sorted(groups.items()):
            grant = plan.grant(k) if plan else 0
            limits = partition_quotas(self.quotas, grant, self.quotas.ceiling(), k, self.partitions)
            taken += await self._take(self.by_partition[k], held, grant, limits, plan, k)
        return taken

    async def _plan(self) -> BudgetPlan | None:
        """The budget plan in force (None: none yet, or unreadable: then no partition has a budget)."""
        got = await self.bus.kv(S.BUCKET_BUDGET).get(S.KEY_PLAN)
        try:
            return decode_plan(got[0]) if got else None
        except AdmitterError as exc:
            log.error("offline: budget plan refused, nothing taken until a good one: %s", exc)
            return None

    async def _take(self, shared: SharedState, held: list[Held], total: int, limits: Quotas | None = None,
                    plan: BudgetPlan | None = None, partition: int | None = None) -> int:
        async with self._lock:
            requests = [h.request for h in held]

            def decide(usage: Usage) -> tuple[Usage | None, Verdicts]:
                verdicts = self.gate.plan(usage, self.quotas, total, requests, limits)
                return verdicts.usage, verdicts

            await shared.refresh()
            verdicts = await shared.change_usage(decide)
            if partition is not None:
                verdicts.budget["partition"] = partition
                if verdicts.takes and await self._plan_moved(plan):
                    await self._give_back(shared, [(held[i].request, cost) for i, cost in verdicts.takes])
                    verdicts.takes = []
            gone = {id(held[i]) for i, _ in verdicts.takes} | {id(held[i]) for i, *_ in verdicts.refusals}
            self.held = [h for h in self.held if id(h) not in gone]  # more may have arrived meanwhile
        outcomes = await asyncio.gather(
            *(self._launch(held[i], cost, verdicts.budget, shared) for i, cost in verdicts.takes),
            *(self._refuse(held[i], reason, msg) for i, reason, msg in verdicts.refusals), return_exceptions=True)
        for exc in (o for o in outcomes if isinstance(o, Exception)):
            # its OFFLINE message was not acked: redelivered after ack_wait; a reservation taken
            # for it is repaired by the admitters' reconciliation, a started attempt by the sweep
            log.error("offline launch failed: %r", exc)
        return len(verdicts.takes)

    async def _plan_moved(self, plan: BudgetPlan | None) -> bool:
        """Whether a newer plan came while we committed on the old one's budget (then what was
        taken goes back: the new plan may have lowered this partition's grant, and the coordinator
        may already count on the lower one)."""
        now = await self._plan()
        return (now.epoch if now else 0) != (plan.epoch if plan else 0)

    async def _give_back(self, shared: SharedState, taken: list[tuple[Request, int]]) -> None:
        def undo(usage: Usage) -> tuple[Usage, None]:
            for req, cost in taken:
                usage = usage.minus(req.tenant, req.model, cost, self.gate.is_long(cost), S.OFFLINE)
            return usage, None

        await shared.change_usage(undo)
        log.info("offline: a new budget plan came during a take: %d job(s) given back, taken again at the next poll",
                 len(taken))

    async def _launch(self, h: Held, cost: int, budget: dict, shared: SharedState | None = None) -> None:
        shared = shared or self.shared
        req, now = h.request, time.time()
        key, batch = job_of(req)
        started: dict = {}

        def take(record: JobRecord | None) -> JobRecord | None:
            if record is not None and record.status in (RUNNING, *FINAL):
                started.pop("ok", None)
                return None  # it started or ended elsewhere meanwhile
            started["ok"] = True
            return on_take(record, req, batch, now, self.settings.name)

        record = await self.store.update(key, take)
        if record is None or not started:
            await self._unreserve(req, cost, shared)
            await h.delivery.ack()
            return
        aid = record.attempt_id or req.id
        await shared.record(Reservation(aid, req.tenant, req.model, cost, now, self.settings.name,
                                             cls=S.OFFLINE))
        run = dataclasses.replace(req, id=aid, reply=S.outcome(req.tenant, batch, req.id), stream=False)
        admitted = Admitted(request=run, runtime_tokens=cost, admitted_at=now, admitter=self.settings.name,
                            queue_wait=max(0.0, now - h.since))
        await asyncio.gather(
            self.bus.jpublish(self.pools.map.admitted_subject(req.model, req.cls, req.tenant), admitted,
                              msg_id=M.admitted(aid)),
            self._decide(run, "allow", None, cost, {**budget, "attempt": record.attempts}, admitted.queue_wait))
        await h.delivery.ack()
        self.running[key] = (aid, now)
        self.metrics.jobs.labels("taken").inc()
        self.metrics.wait.observe(admitted.queue_wait)
        log.info("job %s attempt %d taken as %s: %d runtime tokens, waited %.3fs", req.id, record.attempts, aid,
                 cost, admitted.queue_wait)

    async def _unreserve(self, req: Request, cost: int, shared: SharedState) -> None:
        async with self._lock:
            await shared.change_usage(lambda u: (u.minus(req.tenant, req.model, cost, self.gate.is_long(cost),
                                                              S.OFFLINE), None))

    async def _refuse(self, h: Held, reason: str, message: str) -> None:
        key, batch = job_of(h.request)
        action: dict = {}

        def change(record: JobRecord | None) -> JobRecord | None:
            if record is not None and record.status in FINAL:
                return None
            record = record or JobRecord(id=h.request.id, tenant=h.request.tenant, status=WAITING, batch=batch,
                                         created=time.time(), request=h.request)
            record, action["act"] = on_failure(record, reason, message, time.time(), 0)
            return record

        record = await self.store.update(key, change)
        if action.get("act") == "fail" and record is not None:
            await self._dead_letter(record)
        await h.delivery.ack()

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.keepalive_s)
            for h in list(self.held):
                try:
                    await h.delivery.in_progress()
                except Exception as exc:  # a blip: ack_wait still leaves room
                    log.warning("in_progress for job %s failed: %s", h.request.id, exc)

    # --- outcomes -------------------------------------------------------------------------
    async def _on_outcomes(self, batch: list[Delivery]) -> None:
        for d in batch:  # in order: a job's replies are folded in the order they were stored
            try:
                parsed = S.parse_stored_outcome(d.subject)
                if parsed is None:
                    raise MessageError(f"{d.subject} is not an outcome subject (outcome.<tenant>.<batch>.<job_id>)")
                job, source = parsed
                reply = Reply.decode(d.data)
                if not self._refused(job, reply, source):
                    await self.fold(job, reply, await self._reserved_attempt(job[0], reply) if source else None,
                                    source)
                await d.ack()
            except Exception as exc:  # this message only: bad input dead-lettered, the rest retried
                await self.bus.settle_failed(d, self._outcomes, "offline", exc)

    def _refused(self, job: tuple[str, str, str], reply: Reply, source: str | None) -> bool:
        """Whether a worker's output must not reach the job record, as the client refuses it
        (:func:`natsched.wire.fence.reply_problem`): output comes only on the sending worker's own
        sub-subject, with the reply fence the router signed for that worker and the attempt's id
        (with the tenant's reply key: no worker holds it). Refused ones are counted and logged."""
        why = fence.reply_problem(self.bus.reply_key(job[0]), reply, source, reply.request_id, 0)
        if why is None:
            return False
        self.metrics.refused.labels(why).inc()
        log.warning("job %s: a %s outcome from %s refused (%s): not from the worker its attempt %s was assigned to",
                    job[2], reply.kind, source or "the services' subject", why, reply.request_id)
        return True

    async def _reserved_attempt(self, tenant: str, reply: Reply) -> int:
        """The admission attempt the reservation of a final outcome's attempt id is at now (0:
        released, or not final: a token chunk changes no record)."""
        if not reply.final:
            return 0
        shared = (self.by_partition.get(partition_of(tenant, self.partitions), self.shared) if self.by_partition
                  else self.shared)
        res = await shared.lookup(reply.request_id)
        return res.attempt if res is not None else 0

    async def fold(self, job: tuple[str, str, str], reply: Reply, reserved: int | None = None,
                   source: str | None = None) -> JobRecord | None:
        """Apply one reply to its job record and act on what it means. ``reserved`` (a worker's
        outcome: the attempt its reservation is at, :meth:`_reserved_attempt`) fences it by
        admission attempt: one of an attempt since rescued is refused (:func:`stale`), counted
        and logged, and never folded. None: a message of the services', not bound to an attempt."""
        key = S.job_key(*job)
        action: dict = {}

        def change(record: JobRecord | None) -> JobRecord | None:
            action["stale"] = reserved is not None and reply.final and stale(record, reply, reserved)
            if action["stale"]:
                return None
            new, action["act"] = on_reply(record, reply, job, time.time(), self.settings.max_attempts)
            action["wrote"] = new is not None
            return new

        record = await self.store.update(key, change)
        if action["stale"]:
            self.metrics.refused.labels(fence.REPLY_STALE).inc()
            log.warning("job %s: a %s outcome from %s refused (stale): attempt %d of %s was rescued and runs as "
                        "attempt %d", job[2], reply.kind, source or "?", reply.attempt or 0, reply.request_id,
                        max(reserved or 0, record.admission_attempt if record else 0))
        elif record is not None and action["wrote"]:  # a late or duplicate reply changes nothing
            await self._act(key, record, action["act"])
        return record

    async def _act(self, key: str, record: JobRecord, act: str | None) -> None:
        if record.status in FINAL:
            self.running.pop(key, None)
            self.metrics.jobs.labels(record.status).inc()
            log.info("job %s %s after %d attempt(s)%s", record.id, record.status, record.attempts,
                     f": {record.reason}" if record.reason else "")
        elif record.status == RUNNING and record.attempt_id:
            self.running.setdefault(key, (record.attempt_id, record.started or record.updated))
        if act in ("retry", "requeue"):
            self.running.pop(key, None)
            self.metrics.jobs.labels("retried" if act == "retry" else "requeued").inc()
            await self._enqueue(record, act)
        elif act == "fail":
            await self._dead_letter(record)

    async def _enqueue(self, record: JobRecord, why: str) -> None:
        assert record.request is not None
        req = dataclasses.replace(record.request, reply=S.outcome(record.tenant, record.batch, record.id))
        await self.bus.jpublish(S.offline(record.tenant), req, msg_id=M.offline(record.id, record.enqueued))
        await self._decide(dataclasses.replace(req, id=record.attempt_id or req.id), why, record.reason, None,
                           {"attempt": record.attempts, "enqueued": record.enqueued})
        log.info("job %s back on the OFFLINE queue (%s: %s)", record.id, why, record.reason)

    async def _dead_letter(self, record: JobRecord) -> None:
        data = record.request.encode() if record.request is not None else b""
        dead = DeadLetter(subject=S.offline(record.tenant), reason=record.reason or "failed",
                          error=record.message or record.reason or "failed", ts=time.time(), data=data,
                          headers={S.HDR_MSG_ID: M.request(record.id)}, by=self.settings.name)
        await self.bus.jpublish(S.deadletter("offline"), dead, msg_id=M.dead(record.id))
        if record.request is not None:
            run = dataclasses.replace(record.request, id=record.attempt_id or record.id)
            await self._decide(run, "fail", record.reason, None, {"attempt": record.attempts,
                                                                  "enqueued": record.enqueued})

    async def _decide(self, req: Request, what: str, reason: str | None, cost: int | None, budget: dict,
                      queue_wait: float | None = None) -> None:
        record = Decision(request_id=req.id, tenant=req.tenant, cls=req.cls, stage=S.STAGE_OFFLINE, decision=what,
                          ts=time.time(), reason=reason, runtime_tokens=cost, budget=budget,
                          queue_wait=queue_wait, by=self.settings.name)
        msg_id = (M.offline_decision(req.id) if what == "allow"  # an allow's budget holds no attempt count
                  else M.offline_decision(req.id, what, budget["attempt"], budget["enqueued"]))
        await self.bus.jpublish(S.decision(S.STAGE_OFFLINE, req.tenant), record, msg_id=msg_id)

    # --- lost attempts --------------------------------------------------------------------
    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self.sweep_once()
            except Exception:  # the next sweep tries again
                log.exception("offline sweep failed")

    async def sweep_once(self, now: float | None = None) -> int:
        """Attempts silent for ``job_timeout_s`` (a worker died, a message was lost) fail: retried."""
        now = now or time.time()
        late = [(k, aid) for k, (aid, started) in self.running.items() if now - started > self.settings.job_timeout_s]
        for key, aid in late:
            self.running.pop(key, None)
            action: dict = {}

            def change(record: JobRecord | None, aid=aid) -> JobRecord | None:
                if record is None or record.status != RUNNING or record.attempt_id != aid:
                    return None
                new, action["act"] = on_failure(record, "timeout", f"no outcome within "
                                                f"{self.settings.job_timeout_s:g}s", now, self.settings.max_attempts)
                return new

            record = await self.store.update(key, change)
            if record is not None and action:
                await self._act(key, record, action["act"])
        return len(late)
