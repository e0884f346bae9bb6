"""The admitter service: decode -> AdmitterCore -> shared-state commit -> publish.

All I/O of admission lives here; every decision is the pure core's. A replica:
- decides each request against the shared usage and commits *allow* by compare-and-swap
  (:mod:`natsched.admitter.shared`), so replicas never over-admit together;
- holds *queued* requests as un-acked JetStream messages kept alive with ``in_progress``: if
  this replica dies they are redelivered to another one, nothing is lost;
- releases reservations on completions (once, even if a completion is seen twice), reclaims
  those of workers that miss their heartbeats, and reconciles drift periodically (those
  background repairs are in :mod:`natsched.admitter.repair`);
- follows the quotas bucket live and the workers' measured capacity (dynamic total).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, TypeVar

from natsched.admitter.credit import Credit, CreditSettings, KeeperPlan
from natsched.admitter.dynamic import CacheShare, DynamicTotal, DynamicTotalSettings, ModelLoad, ModelTotals
from natsched.admitter.errors import AdmitterError, QuotaError
from natsched.admitter import knobs as K
from natsched.admitter.leases import LeaseTracker
from natsched.admitter.metrics import AdmitterMetrics
from natsched.admitter.offline import on_degrade
from natsched.admitter.partition import PartitionMember
from natsched.admitter.policy import (ALLOW, DEGRADE, QUEUE, REJECT, AdmissionDecision, AdmissionSettings,
                                      AdmitterCore, runtime_tokens)
from natsched.admitter.quotas import Quotas
from natsched.admitter.engines import EngineQueues
from natsched.admitter.repair import Repairs
from natsched.admitter.rescue import Rescuer
from natsched.admitter.scaling import ScaleAdvisor, ScaleSettings, WorkerLoad
from natsched.admitter.shared import Reservation, SharedState
from natsched.admitter.usage import Usage
from natsched.wire import fence
from natsched.wire import subjects as S
from natsched.wire import msgids as M
from natsched.bus.aio import wait_event
from natsched.bus.connection import CREATE_ONLY, Bus, ConsumerSpec, Delivery
from natsched.bus.metrics import watch as watch_bus
from natsched.bus.pools import PoolWatch
from natsched.errors import NatschedError
from natsched import tracing
from natsched.wire.errors import MessageError, SchemaError
from natsched.wire.ids import in_scope, scope_of
from natsched.wire.schema import (Admitted, Completion, CompletionStatus, Decision, JobRecord, Reply, ReplyKind,
                                  ReplyStatus, Request, ScaleEvent)
from natsched.workers.recent import CANCEL_MEMORY_MAX, CANCEL_MEMORY_S, RecentIds

log = logging.getLogger(__name__)

_DEFAULT_POOL_PREFIX = S.pool_admitted(S.DEFAULT_POOL)[:-1]  # "adm.all."
T = TypeVar("T")



@dataclass
class AdmitterServiceSettings:
    name: str = "admitter"
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    ack_wait_s: float = 30.0
    keepalive_s: float = 10.0  # in_progress for held (queued) messages, well inside ack_wait
    dequeue_interval_s: float = 0.1
    max_held: int = 100_000  # un-acked requests one replica may hold (max ack pending)
    fetch_batch: int = 256  # requests pulled per fetch
    lease_missed: int = 3  # heartbeats a worker may miss before its reservations are reclaimed
    rescue_interval_s: float = 2.0  # how often work stranded on silent workers is looked for
    rescue_grace_s: float = 10.0  # after start: workers not heard from yet are not judged dead
    reconcile_interval_s: float = 10.0
    full_reconcile_s: float = 600.0  # under load, every reservation record is read this often (see reconcile_once)
    orphan_after_s: float = 120.0  # a reservation no live worker reports after this is leaked
    dynamic: DynamicTotalSettings = field(default_factory=DynamicTotalSettings)
    credit: CreditSettings = field(default_factory=CreditSettings)
    scale: ScaleSettings = field(default_factory=ScaleSettings)
    metrics_port: int | None = None
    model_memory_s: float = 60.0  # a model no heartbeat named for this long is no longer served
    #: partitioned admission (natsched.admitter.partition): this replica's partition of
    #: ``partitions``; 1 partition is the unpartitioned service. ``coordinate``: also run a
    #: budget-coordinator candidate in this process (one of them holds the lease)
    partition: int = 0
    partitions: int = 1
    coordinate: bool = True


class InlineRouter(Protocol):
    """A router in the admitter's process (``natsched.router.service.RouterService``): what the admitter
    allows goes straight to a worker's WORK subject instead of through ADMITTED and a router.

    Why: on a small machine every stored hop is a round of wake-ups in three processes (the
    admitter publishing, the server storing, a router pulling); routing in-process skips one
    (``natsched bench pipeline --inline-routing``). ``decide`` is synchronous (state in, decision
    out) and returns ``outgoing`` None when no worker can take the request: it is then handed to
    ADMITTED as usual, where this router's own consumer (and any other router) retries it.
    """

    async def start(self, watch_completions: bool = True) -> None: ...

    def decide(self, adm: Admitted) -> Any: ...  # natsched.router.service.Routed

    def observe_completion(self, c: Completion) -> None: ...

    async def assigned(self, routed: Any) -> None: ...


@dataclass
class Held:
    delivery: Delivery
    request: Request
    since: float


class AdmitterService(Repairs, PartitionMember):
    def __init__(self, bus: Bus, settings: AdmitterServiceSettings | None = None,
                 metrics: AdmitterMetrics | None = None, router: InlineRouter | None = None) -> None:
        self.bus = bus
        self.settings = s = settings or AdmitterServiceSettings()
        self.core = AdmitterCore(s.admission)
        self.init_partition()
        if self.partitioned:  # its own bucket (usage key and records); no credit (partition.py)
            self.shared = SharedState(bus, s.name, bucket=S.partition_bucket(s.partition))
            s.credit = replace(s.credit, enabled=False)
        else:
            self.shared = SharedState(bus, s.name)
        self.shared.is_long = self.core.is_long
        self.shared.pending = lambda: [res for _, res in (*self._releasing, *self._committing)]
        self._refused_seen = 0
        self.credit = Credit(s.name, s.credit)  # blocks reserved ahead: allows without a write
        self._keeper_wake = asyncio.Event()
        self.leases = LeaseTracker(s.lease_missed)
        self.rescuer = Rescuer(bus, self.shared, s.name)
        self._jobs_bucket = False  # bucket jobs seen (the batch producer's and the offline runner's)
        self.rescuer.owns = self.owns
        # router pools (natsched.wire.pools): where each model's admitted requests go
        self.pools = PoolWatch(bus, on_change=self.core.set_pools)
        self.rescuer.pools = self.pools
        self._started = time.monotonic()
        self._dead: dict[str, float] = {}  # worker -> when its lease expired here (until it heartbeats)
        self._instances: dict[str, float] = {}  # worker -> started_at of its instance last heard (repair.py)
        self._takeovers: dict[str, int] = {}  # restarted worker -> predecessor_seq, to rescue (repair.py)
        self._taken_over: dict[str, int] = {}  # worker -> the predecessor_seq last taken over (repair.py)
        self._takeover_wake = asyncio.Event()
        self._recheck_upto: float = 0  # after a server change: REQUESTS sequences to check (_maybe_seen)
        self._settling: asyncio.Future | None = None  # after a server change: completions catching up
        self.refused_duplicates = 0  # copies of a reserved (or just released) request id refused
        self.dynamic = DynamicTotal(s.dynamic)
        self.cache_share = CacheShare(s.dynamic.share_half_life_s)  # from completions: the factor's ceiling
        self.model_totals = ModelTotals(s.dynamic)  # per-model capacity: each model's own workers
        self.scale = ScaleAdvisor(s.scale)
        self.knobs = self.base_knobs()  # plus the quotas bucket's setting.* entries (apply_knobs)
        self.metrics = metrics or AdmitterMetrics()
        watch_bus(self.metrics.registry, self.bus)  # its records lost, reconnects (natsched.bus.metrics)
        self.held: dict[str, Held] = {}
        self.cancelled = RecentIds(CANCEL_MEMORY_S, CANCEL_MEMORY_MAX)  # cancel.<tenant>.<id> heard
        self.worker_load: dict[str, tuple[int, int, float]] = {}  # worker -> (capacity, used, seen)
        self.engines = EngineQueues()  # saturated models (natsched.admitter.engines), from heartbeats
        self.quota_entries: dict[str, bytes] = {}
        self.worker_models: dict[str, tuple[frozenset[str], float]] = {}  # worker -> (models and adapters, last heard)
        self._quota_errors: set[str] = set()
        self._lock = asyncio.Lock()  # one decision-and-commit at a time per replica
        self._releasing: list[tuple[Completion | None, Reservation]] = []  # waiting for the next commit
        self._committing: list[tuple[Completion | None, Reservation]] = []  # in the commit running now
        self._grow_wanted: dict[str, int] = {}  # request -> runtime tokens its worker says it holds
        self._grow_wake = asyncio.Event()
        self._wake = asyncio.Event()
        self.router = router  # inline routing (see InlineRouter), or None: ADMITTED to the routers
        self._suspect: object = None  # drift seen on the previous reconciliation
        self._reconciled_revision = -1  # the usage revision at the previous reconciliation
        self._full_at: float | None = None  # when the reservation records were last read in full
        self._conflicts_seen = 0
        self.total = self.core.quotas.total  # the total in force (configured, or capacity-following)
        consumer, completions, requests = S.CONSUMER_ADMITTER, S.CONSUMER_ADMITTER_COMPLETIONS, S.REQUESTS_ALL
        if self.partitioned:
            consumer, completions = S.partition_admitter(s.partition), S.partition_completions(s.partition)
            requests = S.partition_requests(s.partition)
            self.rescuer.completions_consumer = completions
        self._completions_spec = ConsumerSpec(S.STREAM_COMPLETIONS, completions, S.COMPLETIONS_ALL, deliver_new=True,
                                              batch=256)
        self._spec = ConsumerSpec(S.STREAM_REQUESTS, consumer, requests, ack_wait_s=s.ack_wait_s,
                                  max_ack_pending=s.max_held, batch=s.fetch_batch)

    async def start(self) -> None:
        self.bus.on_server_change(self._server_changed)
        await self.bus.provision()
        await self.provision_partition()  # (P > 1 only) REQUESTS partitioned, the partition's bucket
        await self.shared.start()
        quotas_ready = asyncio.Event()
        self.bus.spawn(self._watch_quotas(quotas_ready), "quota-watch")
        await asyncio.wait_for(quotas_ready.wait(), 10)
        self.apply_quotas()  # the bucket's content at start; the watch applies every later change
        await self.pools.start()  # the pool map in force before any request (one pool without one)
        await self.start_partition()  # (P > 1 only) the budget plan in force, before any request
        await self.bus.subscribe(S.HEARTBEATS_ALL, self._on_heartbeat)
        await self.bus.subscribe(S.CANCELS_ALL, self._on_cancel)
        if self.router is not None:  # before the first request: it routes from the first batch on
            # fed from our COMPLETIONS consumer: with one admitter it sees every completion, with K
            # about 1/K (the rest the next heartbeat tells it, as for any completion it missed)
            await self.router.start(watch_completions=False)
        await self.bus.consume_batches(self._completions_spec, self._on_completions, source="admitter")
        await self.bus.consume_batches(self._spec, self._on_requests, source="admitter")
        for loop in (self._dequeue_loop, self._keepalive_loop, self._lease_loop, self._reconcile_loop,
                     self._dynamic_loop, self._keeper_loop, self._grow_loop, self._scale_loop):
            self.bus.spawn(loop(), loop.__name__)
        if self.settings.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.settings.metrics_port, registry=self.metrics.registry)
        log.info("admitter %s ready (total %d runtime tokens)", self.settings.name, self.total)

    # --- quotas ---------------------------------------------------------------------------
    async def _watch_quotas(self, ready: asyncio.Event) -> None:
        async for key, value, _rev in self.bus.kv(S.BUCKET_QUOTAS).watch(">", ready=ready):
            if key == S.KEY_DYNAMIC_TOTAL:
                continue  # ours, informational
            if value is None:
                self.quota_entries.pop(key, None)
            else:
                self.quota_entries[key] = value
            if ready.is_set():
                self.apply_quotas()
        # (the loop ends only when the Bus closes)

    def base_knobs(self) -> K.Knobs:
        """The settings this replica started with (code defaults and flags), before the bucket's."""
        s = self.settings
        return K.Knobs(admission=s.admission, dynamic=s.dynamic, scale=s.scale,
                       lease=K.LeaseSettings(missed=s.lease_missed, rescue_grace_s=s.rescue_grace_s,
                                             reconcile_interval_s=s.reconcile_interval_s,
                                             orphan_after_s=s.orphan_after_s, model_memory_s=s.model_memory_s))

    def apply_knobs(self) -> K.Knobs:
        """The bucket's ``setting.*`` entries over the start settings, in force now; an entry that
        is bad keeps what ran before for that knob (logged and counted, like a bad quota)."""
        knobs, errors = K.resolve(self.base_knobs(), self.quota_entries, previous=self.knobs)
        for err in errors:
            self.metrics.bad_quota_entries.inc()
            log.error("setting ignored, last good value kept: %s", err)
        if knobs != self.knobs:
            changed = {k: v for k, v in K.flat(knobs).items() if K.flat(self.knobs).get(k) != v}
            log.info("settings in force: %s", ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) or "-")
        self.knobs = knobs
        self.core.set_settings(knobs.admission)
        self.dynamic.settings = knobs.dynamic
        self.scale.settings = knobs.scale
        self.leases.missed = knobs.lease.missed
        return knobs

    def apply_quotas(self) -> None:
        self.apply_knobs()
        quotas, errors = Quotas.from_kv(self.quota_entries, previous=self.cluster_quotas,
                                        default_total=self.core.settings.default_total)
        for err in errors:  # counted and logged once each: every quota change re-reads them all
            if err not in self._quota_errors:
                self._quota_errors.add(err)
                self.metrics.bad_quota_entries.inc()
                log.error("quota entry refused, last good value kept until natsched quota set rewrites it: %s", err)
        try:
            quotas.validate()
            self.core.set_quotas(self.core_quotas(quotas))  # (a partition's share of them: partition.py)
        except QuotaError as exc:
            log.error("quota change refused, old quotas kept: %s", exc)
            return
        self.total = self.core.quotas.total
        if self.worker_load:
            self.update_dynamic_total()  # the new ceiling applies now, not at the next interval
        self._wake.set()

    # --- requests -------------------------------------------------------------------------
    async def _on_requests(self, batch: list[Delivery]) -> None:
        """Decide every waiting request against one usage revision, commit once, act concurrently.

        One compare-and-swap per batch instead of per request: under load the shared-state cost
        is paid once for dozens of decisions, and a lost race re-decides the whole batch.
        """
        items: list[tuple[Delivery, Request]] = []
        seen: set[str] = set()
        self.bus.check_server()  # a batch from a restarted server is checked like a redelivery
        for d in batch:
            try:
                request = Request.decode(d.data)
                _check_scope(request, d.subject, keyed=self.bus.fence_key is not None)
            except MessageError as exc:  # error reply + dead letter + term
                await self.bus.settle_failed(d, self._spec, "admitter", exc)
                continue
            if self._is_cancelled(request) and request.id not in self.held:  # cancelled before it got here
                await self._drop_cancelled(request, d, 0.0)
                continue
            held = self.held.get(request.id)
            if held is not None:  # our own held message, redelivered: keep holding the newest
                held.delivery = d
            elif self._maybe_seen(d) and await self._seen_before(request, d):
                continue
            elif request.id not in seen:
                seen.add(request.id)
                items.append((d, request))
        if not items:
            return
        self.metrics.batch.observe(len(items))
        started = time.perf_counter()
        now = time.time()
        async with self._lock:
            decisions, paid, returned = await self._commit(lambda usage: self._decide(items, usage, now))
            items, decisions = self.hold_for_budget(items, decisions)  # (a partition's: partition.py)
            for (_, request), dec in zip(items, decisions):
                if dec.decision != ALLOW:
                    self.core.apply(request, dec, now)
            paid = self._spent(items, decisions, paid, returned)
            self.core.usage = self.shared.usage
        elapsed = time.perf_counter() - started
        for _ in items:
            self.metrics.latency.observe(elapsed / len(items))
        await self._act_batch([(request, dec, d, 0.0, elapsed * 1000 / len(items))
                               for (d, request), dec in zip(items, decisions)], paid)

    def _decide(self, items: list[tuple[Delivery, Request]], usage: Usage, now: float):
        """Decide a batch on ``usage``: (the usage to write or None, (decisions, ids paid from
        credit, credit given back)).

        Each request is decided on the usage minus this replica's unspent credit. An allow the
        credit of its (tenant, model) covers is paid from it (nothing to write); any other allow
        is reserved on the shared usage, and if only this replica's own unspent credit stands in
        its way, that credit is given back in the same write (so credit never makes a request
        wait). The next request in the batch sees every reservation before it. Pure: re-run
        after a lost race (``natsched.admitter.credit``).
        """
        free = dict(self.credit.free) if self.credit.usable(usage, time.monotonic()) else {}
        shared, view = usage, self.credit.view(usage, free)
        decisions, paid, returned = [], set(), {}
        for d, request in items:
            self.core.usage = view
            dec = self.core.evaluate(request, now, self.request_subject(d.subject))
            if dec.decision == ALLOW:
                tokens, key = dec.runtime_tokens, (request.tenant, request.model)
                long = self.core.is_long(tokens)
                if not long and free.get(key, 0) >= tokens and not self.core.quotas.class_limits:
                    free[key] -= tokens
                    paid.add(request.id)
                else:
                    if any(free.values()) and not self._allows(shared, request, now, d.subject):
                        shared = self._give_back(shared, free, returned)  # now the same as the view
                    shared = shared.plus(request.tenant, request.model, tokens, long, request.cls, dec.loan)
                view = view.plus(request.tenant, request.model, tokens, long, request.cls, dec.loan)
            decisions.append(dec)
        return (shared if shared is not usage else None), (decisions, paid, returned)

    def _allows(self, usage: Usage, request: Request, now: float, subject: str) -> bool:
        self.core.usage = usage
        return self.core.evaluate(request, now, self.request_subject(subject)).decision == ALLOW

    def _give_back(self, usage: Usage, free: dict, returned: dict) -> Usage:
        """Every unspent token of this replica's credit back into ``usage`` (noted in ``returned``)."""
        for (tenant, model), n in free.items():
            if n > 0:
                usage = usage.give_back(self.settings.name, self.credit.epoch, tenant, model, n)
                returned[(tenant, model)] = returned.get((tenant, model), 0) + n
        free.clear()
        return usage

    def _spent(self, items, decisions, paid: set[str], returned: dict) -> dict[str, str]:
        """After the batch's commit: the credit it paid is spent, what it gave back is gone, and
        the demand is noted (the caller holds the lock). Returns the epoch each paid request's
        record carries."""
        mono = time.monotonic()
        for key, n in returned.items():
            self.credit.spend(key, n)
        keys = set()
        for (_, request), dec in zip(items, decisions):
            if dec.decision != ALLOW or self.core.is_long(dec.runtime_tokens):
                continue
            key = (request.tenant, request.model)
            if request.id in paid:
                self.credit.spend(key, dec.runtime_tokens)
                self.metrics.credit_allows.inc()
            self.credit.note(key, dec.runtime_tokens, mono)
            keys.add(key)
        if any(self.credit.low(key, mono) for key in keys):  # once per pair, not per request
            self._keeper_wake.set()
        return {rid: self.credit.epoch for rid in paid}

    def _maybe_seen(self, d: Delivery) -> bool:
        """Whether this delivery may have been decided before: a redelivery, or, after the server
        changed, any request stored before that (a restarted server can have lost the consumer
        acks it had not written yet, and then delivers decided requests as if new)."""
        return d.num_delivered > 1 or (self._recheck_upto > 0 and d.stream_seq <= self._recheck_upto)

    def _server_changed(self) -> None:
        """From the reconnect: check every delivery at once, then only up to what was stored."""
        self._recheck_upto = float("inf")
        self._settling = None  # a new wait for the completions stored by now
        log.warning("admitter %s: the server changed; requests stored before now are checked against their "
                    "reservations and release markers before they are decided", self.settings.name)
        self.bus.spawn(self._bound_recheck(), "recheck-bound")

    async def _completions_settled(self) -> None:
        """Once per server change (shared by every delivery that asks): until the completions
        stored so far are processed (bounded, as a rescue waits for them)."""
        if self._settling is None:
            self._settling = asyncio.ensure_future(self.rescuer.completions_caught_up())
        try:
            await asyncio.shield(self._settling)
        except Exception as exc:  # the wait is a courtesy: on failure, decide as before
            log.warning("admitter %s: completions not caught up after the server change: %s", self.settings.name, exc)

    async def _bound_recheck(self) -> None:
        try:
            self._recheck_upto = await self.bus.stream_last_seq(S.STREAM_REQUESTS)
        except Exception as exc:  # the bound stays infinite: slower (one read per request), never wrong
            log.warning("admitter %s: could not read the request log's last sequence: %s", self.settings.name, exc)

    async def _seen_before(self, request: Request, d: Delivery) -> bool:
        """A redelivered request that was decided before (its ack was lost): settled here, True.

        Only a redelivery can have been decided (the first copy of a request reaches one replica),
        or, after a server restart, a copy whose ack the server lost (:meth:`_maybe_seen`).
        """
        res = await self.shared.lookup(request.id)
        if res is not None and self._recheck_upto:
            # after a server change its hand-off may have run and completed already, and JetStream's
            # dedup no longer knows the consumed hand-off (it is rebuilt from what is stored): first
            # let the completions stored so far release what they finished
            await self._completions_settled()
            res = await self.shared.lookup(request.id)
        if res is not None:  # allowed before: hand it off again
            await self._hand_off_again(request, d, res)
            return True
        if await self._released_recently(request.id):
            await d.ack()  # allowed, run and released before this copy came back: never twice
            log.info("request %s redelivered after its completion; dropped", request.id)
            return True
        return False

    async def _released_recently(self, request_id: str) -> bool:
        """Its reservation existed and was released (the purge marker lives ``MARKER_TTL_S``,
        longer than the ack wait after which a copy whose ack was lost comes back)."""
        op = await self.bus.kv(self.shared.bucket).last_operation(S.reservation_key(request_id))
        return op in ("DEL", "PURGE")

    async def _hand_off_again(self, request: Request, d: Delivery, res: Reservation) -> None:
        """Re-publish an allowed request (the same msg id: deduplicated if it did go out) and ack.

        With an inline router, the allow's record was to be stored inside its routing record, after
        its WORK message: an admitter that died between the two stored neither, so the allow is
        recorded again here, from the reservation (reason ``redelivered``)."""
        if self.router is not None:
            await self.bus.jpublish_nowait(S.decision("admission", request.tenant), Decision(
                request_id=request.id, tenant=request.tenant, cls=request.cls, stage="admission", decision=ALLOW,
                ts=res.ts, reason="redelivered", runtime_tokens=res.tokens, by=res.by), msg_id=M.admission(request.id))
        admitted = Admitted(request=request, runtime_tokens=res.tokens, admitted_at=res.ts, admitter=res.by)
        await self.bus.jpublish(self._admitted_subject(request), admitted, msg_id=M.admitted(request.id))
        await d.ack()
        log.info("request %s redelivered after its allow; handed off again", request.id)

    def _admitted_subject(self, request: Request) -> str:
        return self.core.pools.admitted_subject(request.model, request.cls, request.tenant)

    def _routes_inline(self, subject: str) -> bool:
        """The inline router is the default pool's: with a pool map, each pool's routers route."""
        return self.router is not None and subject.startswith(_DEFAULT_POOL_PREFIX)

    async def _act_batch(self, entries: list[tuple[Request, AdmissionDecision, Delivery, float, float]],
                         paid: dict[str, str] | None = None) -> None:
        """Carry out a batch of decisions: records, reservations and hand-offs published together
        (one wait for all their acks), then the producers told and the requests acked. With an
        inline router an allowed request's hand-off is its WORK message (ADMITTED only if no
        worker can take it now).

        Per batch rather than per request: a service answering hundreds of requests a second
        spends most of its time in per-message machinery (a task, a timer and a wake-up per
        publish), and one shared wait costs what one publish did. ``paid``: the requests paid
        from this replica's credit, with the epoch of the block (their records carry it).
        """
        now = time.time()
        reservations = []
        for request, dec, d, queue_wait, latency_ms in entries:
            if dec.decision == ALLOW:
                reservations.append(Reservation(request.id, request.tenant, request.model, dec.runtime_tokens, now,
                                                self.settings.name, credit=(paid or {}).get(request.id, ""),
                                                ceiling=runtime_tokens(request), cls=request.cls))
                for lender, n in dec.loan.items():
                    self.metrics.borrowed.labels(request.cls, lender).inc(n)
        sent = time.perf_counter()
        # the reservation records are stored before any hand-off (the completion that deletes one is
        # a service or two further away), and each is a create: a request id reserved already
        # (published again under another msg id) is refused here, never reserved or run twice
        refused = await self._reserve(reservations)
        handoffs, routed, jobs = [], {}, []
        for request, dec, d, queue_wait, latency_ms in entries:
            rid = request.id
            record = self._decision_record(request, dec, queue_wait, latency_ms) if rid not in refused else None
            trace = _admission_span(request, dec, d, queue_wait)  # None unless tracing is on
            if dec.decision == ALLOW and rid not in refused:
                admitted = Admitted(request=request, runtime_tokens=dec.runtime_tokens, admitted_at=now,
                                    admitter=self.settings.name, queue_wait=queue_wait)
                subject = self._admitted_subject(request)
                r = self.router.decide(admitted, trace=tracing.carry(trace)) if self._routes_inline(subject) else None
                if r is not None and r.outgoing is not None:  # straight to the worker's WORK subject
                    # its admission record is stored inside its routing record, once the WORK
                    # message is (RouterService.assigned): one DECISIONS message, not two
                    r.admission, record = record, None
                    routed[rid] = r
                    handoffs.append(r.outgoing)
                else:
                    handoffs.append((subject, admitted, M.admitted(rid),
                                     tracing.carry(trace)))
            elif dec.decision == DEGRADE:
                jobs.append(on_degrade(request, now, self.settings.name))
                handoffs.append((S.offline(request.tenant), request, M.offline(rid), tracing.carry(trace)))
            elif dec.decision == QUEUE:
                self.held[rid] = Held(d, request, now)
            if record is not None:
                await self._publish_record(record, dec)
        await asyncio.gather(self.bus.jpublish_batch(handoffs), self._create_job_records(jobs))
        if reservations or handoffs:
            self.metrics.handoff.observe(time.perf_counter() - sent)
        for request, dec, d, queue_wait, _ in entries:
            if request.id in refused:
                await self._refuse_duplicate(request, d)
                continue
            await self._tell_producer(request, dec)
            if request.id in routed:  # its WORK message is stored: "assigned" follows "admitted"
                await self.router.assigned(routed[request.id])
            if dec.decision != QUEUE:
                await d.ack()
            elif self._is_cancelled(request):  # cancelled while it was being queued
                await self._cancel_held(request.tenant, request.id)
            self.metrics.decisions.labels(request.tenant, request.cls, dec.decision, dec.reason or "").inc()
            log.info("request %s %s tenant=%s class=%s tokens=%d%s%s", request.id, dec.decision, request.tenant,
                     request.cls, dec.runtime_tokens, f" reason={dec.reason}" if dec.reason else "",
                     f" waited={queue_wait:.3f}s" if queue_wait else "")

    async def _create_job_records(self, jobs: list[tuple[str, JobRecord]]) -> None:
        """Degraded requests' job records (:func:`natsched.admitter.offline.on_degrade`), stored
        before their producers hear the job ids. Best effort: one that cannot be stored within the
        publish budget (bucket ``jobs`` full, say: the server answers 503 and the write is retried)
        fails no hand-off; it is logged, and the offline runner writes the record when it takes the
        job, as it always could."""
        if not jobs or not await self._jobs_bucket_exists():
            return
        try:
            await self.bus.jpublish_batch([(S.kv_subject(S.BUCKET_JOBS, key), record.encode(), None, CREATE_ONLY)
                                           for key, record in jobs])
        except NatschedError as exc:
            self._jobs_bucket = False  # (deleted meanwhile?) looked up again next time
            log.warning("%d degraded request(s)' job records not stored (the runner writes them on take): %s",
                        len(jobs), exc)

    async def _jobs_bucket_exists(self) -> bool:
        """Bucket ``jobs`` is created by the batch producer and the offline runner (and the
        operator's provisioning under auth), not by an admitter, whose role may not: before one of
        them ran there is no record to write, and no runner to take the job either."""
        if not self._jobs_bucket:
            try:
                await self.bus.stream(S.kv_stream(S.BUCKET_JOBS)).info()
                self._jobs_bucket = True
            except NatschedError:  # not there (StreamNotFound), or the server did not answer: no record
                pass
        return self._jobs_bucket

    async def _reserve(self, reservations: list[Reservation]) -> set[str]:
        """Store the records (creates); the ids refused because their key exists are returned, and
        what their allow had committed to the usage (or spent of the credit) is given back."""
        acks = await self.bus.jpublish_batch([self.shared.outgoing(res) for res in reservations])
        refused = []
        for res, ack in zip(reservations, acks):
            if ack is None and not await self._ours_already(res):
                refused.append(res)
            elif ack is not None:
                self.shared.recorded(res, ack.seq)
        if refused:
            pairs = await self._refund([(None, res) for res in refused])
            if pairs:
                await self._release_taken(pairs)
        return {res.request_id for res in refused}

    async def _ours_already(self, res: Reservation) -> bool:
        """A create refused because the key holds *this* record: its first publish was stored and
        only the ack was lost (a stalled server), so the retry met it. It is ours, recorded; a
        second copy of the request, decided apart, has another time or admitter and is refused.
        (The server checks the expected sequence before the msg id: a msg id cannot tell them apart.)"""
        stored = await self.shared.lookup(res.request_id)
        if stored is None or (stored.by, stored.ts, stored.tokens) != (res.by, res.ts, res.tokens):
            return False
        self.shared.recorded(res, stored.revision)
        log.info("request %s: its reservation was stored before a lost ack; kept", res.request_id)
        return True

    async def _refuse_duplicate(self, request: Request, d: Delivery) -> None:
        """A request id that is reserved already, or was released a moment ago: one run per id.

        Nothing is said on its reply subject: that is the reserved request's too (a copy that came
        back after a server restart, or was published again under another msg id), and its
        producer is waiting for that request's outcome, which follows as usual."""
        self.refused_duplicates += 1
        self.metrics.decisions.labels(request.tenant, request.cls, "reject", "duplicate").inc()
        log.warning("request %s: a copy refused, its id is reserved already or just finished (a redelivery, or "
                    "published again under another msg id)", request.id)
        await d.ack()

    async def _record(self, request: Request, dec: AdmissionDecision, queue_wait: float, latency_ms: float) -> None:
        await self._publish_record(self._decision_record(request, dec, queue_wait, latency_ms), dec)

    def _decision_record(self, request: Request, dec: AdmissionDecision, queue_wait: float,
                         latency_ms: float) -> Decision:
        return Decision(
            request_id=request.id, tenant=request.tenant, cls=request.cls, stage="admission",
            decision=dec.decision, ts=time.time(), reason=dec.reason, retry_after=dec.retry_after,
            runtime_tokens=dec.runtime_tokens, budget=dec.budget, queue_wait=queue_wait or None,
            by=self.settings.name, latency_ms=latency_ms,
        )

    async def _publish_record(self, record: Decision, dec: AdmissionDecision) -> None:
        # a queued request is decided twice (queue, then allow/reject): one record each
        await self.bus.jpublish_nowait(S.decision("admission", record.tenant), record,
                                       msg_id=M.admission(record.request_id, queued=dec.decision == QUEUE))

    async def _tell_producer(self, request: Request, dec: AdmissionDecision) -> None:
        if not request.reply:
            return
        rid = request.id
        if dec.decision == ALLOW:
            reply = Reply(request_id=rid, kind=ReplyKind.STATUS, status=ReplyStatus.ADMITTED)
        elif dec.decision == QUEUE:
            reply = Reply(request_id=rid, kind=ReplyKind.STATUS, status=ReplyStatus.QUEUED, est_wait=dec.est_wait)
        elif dec.decision == DEGRADE:
            reply = Reply(request_id=rid, kind=ReplyKind.STATUS, status=ReplyStatus.DEGRADED, job_id=rid)
        else:
            reply = Reply(request_id=rid, kind=ReplyKind.ERROR, status=ReplyStatus.REJECTED, reason=dec.reason,
                          message=dec.message, retry_after=dec.retry_after)
        await self.bus.publish(request.reply, reply)

    # --- cancels ------------------------------------------------------------------------
    def _is_cancelled(self, request: Request) -> bool:
        return S.cancel(request.tenant, request.id) in self.cancelled

    async def _on_cancel(self, subject: str, data: bytes, headers: dict) -> None:
        """A producer gave up (``cancel.<tenant>.<id>``): a request of that tenant held in this
        replica's queue leaves it now; one not here yet is refused when it comes (every replica
        remembers it). One admitted already is the router's or its worker's to stop."""
        parsed = S.parse_cancel_subject(subject)
        if parsed is None:
            log.warning("ignoring a cancel on %s", subject)
            return
        self.cancelled.add(subject)
        await self._cancel_held(*parsed)

    async def _cancel_held(self, tenant: str, request_id: str) -> None:
        held = self.held.get(request_id)
        if held is None or held.request.tenant != tenant:  # not queued here, or not that tenant's
            return
        async with self._lock:  # not while a dequeue plans on the queue
            if self.held.get(request_id) is not held:
                return  # dequeued meanwhile: admitted, so the router or its worker stops it
            del self.held[request_id]
            self.core.forget(request_id)
        await self._drop_cancelled(held.request, held.delivery, time.time() - held.since)
        self._wake.set()  # its place in the queue is free

    async def _drop_cancelled(self, request: Request, d: Delivery, queue_wait: float) -> None:
        """Refuse a cancelled request before it holds anything: recorded, told, acked."""
        dec = AdmissionDecision(REJECT, 0, "cancelled", "its producer cancelled it before it was admitted")
        await self._record(request, dec, queue_wait, 0.0)
        await self._tell_producer(request, dec)
        await d.ack()
        self.metrics.decisions.labels(request.tenant, request.cls, REJECT, "cancelled").inc()
        log.info("request %s cancelled by its producer before admission tenant=%s%s", request.id, request.tenant,
                 f" waited={queue_wait:.3f}s" if queue_wait else "")

    # --- the queue ----------------------------------------------------------------------
    async def _dequeue_loop(self) -> None:
        while True:
            await wait_event(self._wake, self.settings.dequeue_interval_s)
            self._wake.clear()
            if self.core.queued():
                try:
                    await self.dequeue_once()
                except AdmitterError as exc:
                    log.warning("dequeue deferred: %s", exc)
            self._refresh_gauges()

    async def dequeue_once(self) -> int:
        now = time.time()
        started = time.perf_counter()

        planned: list[Usage] = []

        def attempt(usage):
            planned[:] = [usage]
            self.core.usage = usage
            picks = self.core.plan_dequeue(now)
            new = usage
            for req, dec in picks:
                if dec.decision == ALLOW:
                    new = new.plus(req.tenant, req.model, dec.runtime_tokens, self.core.is_long(dec.runtime_tokens),
                                   req.cls, dec.loan)
            return (new if new is not usage else None), picks

        async with self._lock:
            picks = await self.shared.change_usage(attempt)
            self.core.usage = planned[0]  # the usage the committed picks were planned on
            self.core.commit_dequeue(picks, now)
            self.core.usage = self.shared.usage
        latency_ms = (time.perf_counter() - started) * 1000
        entries = []
        for req, dec in picks:
            held = self.held.pop(req.id, None)
            if held is None:
                log.warning("dequeued %s but its message is no longer held", req.id)
                continue
            wait = now - held.since
            self.metrics.queue_wait.labels(req.cls).observe(wait)
            self.scale.observe_wait(now, wait)
            entries.append((req, dec, held.delivery, wait, latency_ms))
        await self._act_batch(entries)  # one wait for the whole dequeue, like a fresh batch
        return len(picks)

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.keepalive_s)
            for held in list(self.held.values()):
                try:
                    await held.delivery.in_progress()
                except Exception as exc:  # connection blip: ack_wait still leaves room
                    log.warning("in_progress for %s failed: %s", held.request.id, exc)

    # --- credit (natsched.admitter.credit) ----------------------------------------------------------
    async def _keeper_loop(self) -> None:
        """Top up, give back and renew this replica's credit; drop silent replicas' entries."""
        while True:
            await wait_event(self._keeper_wake, self.settings.credit.tick_s)
            self._keeper_wake.clear()
            try:
                await self.keep_credit()
            except AdmitterError as exc:
                log.warning("credit upkeep deferred: %s", exc)

    async def keep_credit(self) -> KeeperPlan | None:
        """One look (and, if needed, one write): returns the plan written, or None."""
        now = time.monotonic()
        self.credit.forget_demand(now)
        if self._credit_plan(self.shared.usage, now) is None:
            return None  # the common case, without taking the lock
        async with self._lock:
            sent = time.monotonic()
            plan = await self._commit(lambda usage: self._with_plan(self._credit_plan(usage, sent)))
            if plan is not None:
                self.credit.applied(plan, sent)
                self._log_plan(plan)
            self.core.usage = self.shared.usage
        return plan

    def _credit_plan(self, usage: Usage, now: float) -> KeeperPlan | None:
        return self.credit.plan(usage, now, self.core.total, self.core.queued() > 0,
                                lambda u, tenant, model, n: self.core.grantable(u, tenant, model, n, time.time()))

    @staticmethod
    def _with_plan(plan: KeeperPlan | None) -> tuple[Usage | None, KeeperPlan | None]:
        return (plan.usage if plan is not None else None), plan

    def _log_plan(self, plan: KeeperPlan) -> None:
        for replica in plan.dropped:
            log.warning("credit of admitter %s dropped: its entry did not change for %gs (its unspent part "
                        "stays reserved until the reconciliation repairs it)", replica, self.settings.credit.lease_s)
        if plan.lost:
            log.warning("this admitter's credit was dropped by another replica (paused past its lease?)")
        for (tenant, model), delta in plan.deltas.items():
            log.debug("credit %s/%s %+d runtime tokens", tenant, model, delta)

    async def stop(self) -> None:
        """Give back the unspent credit, so the others need not wait out its lease (and the
        coordinator lease, when this replica holds it)."""
        await self.stop_partition()
        self.credit.settings = replace(self.credit.settings, enabled=False)
        try:
            await asyncio.wait_for(self.keep_credit(), 3)
        except (asyncio.TimeoutError, AdmitterError, NatschedError) as exc:
            log.warning("credit not given back at stop (%s): it is dropped after its lease", exc)

    # --- completions, leases, reconciliation ----------------------------------------------
    async def _on_completions(self, batch: list[Delivery]) -> None:
        """Release a batch of completions: reservations taken concurrently, one usage commit."""
        completions = []
        for d in batch:
            if not self.owns_completion(d.subject):  # another partition's tenant: acked below
                continue
            try:
                c = Completion.decode(d.data)
            except MessageError as exc:
                await self.bus.settle_failed(d, self._completions_spec, "admitter", exc)
                continue
            if self._fenced_off(c, d.subject) is None:
                completions.append(c)
        stale = self.shared.stale
        taken = await asyncio.gather(*(self.shared.take(c.request_id, c.attempt) for c in completions))
        if self.shared.stale > stale:
            self.metrics.refused_completions.labels(fence.STALE).inc(self.shared.stale - stale)
        pairs = [(c, res) for c, res in zip(completions, taken) if res is not None]
        for c in completions:  # (the fenced ones only: a forged one must not end a lease either)
            self.leases.forget(c.request_id)
            if self.router is not None:
                self.router.observe_completion(c)
        now = time.time()
        for c, _ in pairs:  # once per request (a completion seen twice released nothing the second time)
            if c.status == CompletionStatus.OK:
                self.cache_share.observe(c.prompt_tokens, c.cached_tokens, now)
        if pairs:
            pairs = await self._refund(pairs)
        if pairs:
            await self._release_taken(pairs)
        await asyncio.gather(*(d.ack() for d in batch if not d.settled))

    def _fenced_off(self, c: Completion, subject: str) -> str | None:
        """Why a completion may not release anything (:mod:`natsched.wire.fence`), counted and
        logged; None when it comes from the worker its attempt was assigned to. A refused one
        is acked and kept in COMPLETIONS (the audit checks the same fence): it frees nothing."""
        problem = fence.problem(self.bus.fence_key, c, subject)
        if problem is not None:
            self.metrics.refused_completions.labels(problem).inc()
            log.warning("completion of request %s on %s refused (%s): it releases nothing", c.request_id, subject,
                        problem)
        return problem

    async def _refund(self, pairs: list[tuple[Completion | None, Reservation]]):
        """Requests paid from this replica's live credit go back into it, without a write; the
        rest is returned for a release by compare-and-swap. Under the lock, so the keeper cannot
        drop the block in between (a refund into a dropped block would be lost)."""
        async with self._lock:
            if not self.credit.usable(self.shared.usage, time.monotonic()):
                return pairs
            rest, refunded = [], []
            for c, res in pairs:
                if res.credit and res.credit == self.credit.epoch and res.by == self.settings.name:
                    self.credit.refund((res.tenant, res.model), res.tokens)
                    refunded.append((c, res))
                else:
                    rest.append((c, res))
            if refunded:
                self._released(refunded)
            return rest

    async def _release_taken(self, pairs: list[tuple[Completion | None, Reservation]]) -> None:
        """Give back what ``pairs`` reserved, in the next usage commit.

        Releases wait in ``_releasing`` for the lock; an admission batch that gets it first folds
        them into its own compare-and-swap (and may admit into the freed room), so under load one
        commit carries both and the completions no longer hold up the requests. Whoever finds
        releases still waiting once it has the lock commits them: when this returns, they are in
        the shared usage.
        """
        self._releasing.extend(pairs)
        async with self._lock:
            if self._releasing:  # else an admission commit took them meanwhile
                await self._commit(lambda usage: (None, None))
            self.core.usage = self.shared.usage

    async def _commit(self, change: Callable[[Usage], tuple[Usage | None, T]]) -> T:
        """One usage compare-and-swap (caller holds ``_lock``) that also gives back the releases
        waiting for the lock: ``change`` sees the usage without them, like ``change_usage``'s
        function; they are put back for the next commit if this one fails."""
        releasing, self._releasing = self._releasing, []
        self._committing = releasing

        def attempt(usage: Usage) -> tuple[Usage | None, T]:
            base = self._minus(usage, releasing)
            new, result = change(base)
            return (base if new is None and base is not usage else new), result

        try:
            result = await self.shared.change_usage(attempt)
        except BaseException:
            self._releasing[:0] = releasing
            raise
        finally:
            self._committing = []
        if releasing:
            self._released(releasing)
        return result

    def _minus(self, usage, pairs: list[tuple[Completion | None, Reservation]]):
        for _, res in pairs:  # (out of the block it was paid from, if that block still exists)
            usage = usage.release_from(res.by, res.credit, res.tenant, res.model, res.tokens,
                                       self.core.is_long(res.tokens), res.cls or None)
        return usage

    def _released(self, pairs: list[tuple[Completion | None, Reservation]]) -> None:
        """After the commit that gave ``pairs`` back: learning, the queue woken, one line each."""
        now = time.time()
        for c, res in pairs:
            if c is not None:
                self.core.release(c, now)  # learning (output EWMA, release rate)
                self.engines.completed(c.worker)
            log.info("request %s released %d runtime tokens (%s)", res.request_id, res.tokens,
                     "completion" if c is not None else "reclaimed")
        self.core.set_saturated(self.engines.saturated())
        self._wake.set()

    async def release(self, request_id: str, completion: Completion | None = None, why: str = "completion") -> int:
        """Free one reservation once (duplicates, other replicas and lease reclaims free nothing)."""
        res = await self.shared.take(request_id)
        self.leases.forget(request_id)
        if res is None:
            return 0
        if await self._refund([(completion, res)]):  # (not paid from our credit)
            await self._release_taken([(completion, res)])
        if completion is None:
            log.info("request %s: %s", request_id, why)
        return res.tokens

    # --- reservations that grow (a request running past its price) --------------------------
    async def _grow_loop(self) -> None:
        while True:
            await self._grow_wake.wait()
            self._grow_wake.clear()
            wanted, self._grow_wanted = self._grow_wanted, {}
            for rid, held in wanted.items():
                try:
                    await self.grow(rid, held)
                except (AdmitterError, NatschedError) as exc:  # the next heartbeat asks again
                    log.warning("reservation of %s not grown: %s", rid, exc)

    async def grow(self, request_id: str, held: int) -> int:
        """Grow a reservation its request has run past: runtime tokens include the generated
        ones, and a request priced below what it ends up holding (a learned estimate, a
        producer asking for more room later) must not hold more than the usage says. Returns
        the runtime tokens added (0: nothing to do, or another replica did it).

        The record is rewritten first by compare-and-swap (so of the replicas that hear the
        same heartbeat, one grows it), then the usage in the next commit; a crash between the
        two is drift the reconciliation repairs, as for an allow. It grows by at least a
        quarter each time (a heartbeat per token would be a write per token), never past its
        ceiling (prefill + ``max_tokens``: what pricing at ``max_tokens`` would have reserved).
        Credit-paid records are not grown (they are short by construction)."""
        res = self.shared.reservations.get(request_id) or await self.shared.lookup(request_id)
        if res is None or res.credit or held <= res.tokens or res.tokens >= res.ceiling:
            return 0
        tokens = min(res.ceiling, max(held, res.tokens + max(1, res.tokens // 4)))
        grown = await self.shared.regrow(res, tokens)
        if grown is None:
            return 0
        old_long, new_long = self.core.is_long(res.tokens), self.core.is_long(tokens)
        async with self._lock:
            await self._commit(lambda u: (u.minus(res.tenant, res.model, res.tokens, old_long)
                                          .plus(res.tenant, res.model, tokens, new_long)
                                          .reclass(res.cls or None, tokens - res.tokens), None))
            self.core.usage = self.shared.usage
        self.metrics.grown.inc(tokens - res.tokens)
        log.info("request %s grew its reservation %d -> %d runtime tokens (its worker holds %d)", request_id,
                 res.tokens, tokens, held)
        return tokens - res.tokens

    async def _dynamic_loop(self) -> None:
        while True:
            await asyncio.sleep(self.dynamic.settings.interval_s)
            self.update_dynamic_total()

    def update_dynamic_total(self) -> int:
        if self.partitioned:  # the budget is the total (partition.py)
            return self.total
        now = time.time()
        live = [(cap, used) for cap, used, seen in self.worker_load.values() if now - seen < 10.0]
        q = self.core.quotas
        # what every admitter has booked (the shared usage): the factor is measured from it
        total = self.dynamic.next_total(q.total, q.hard_cap, sum(c for c, _ in live), sum(u for _, u in live),
                                        reserved=self.shared.usage.used, cache_share=self.cache_share.share())
        if total != self.total:
            log.info("dynamic total %d runtime tokens (factor %.2f, prefix-cache hit share %s)", total,
                     self.dynamic.factor, "-" if (h := self.cache_share.share()) is None else f"{h:.2f}")
        self.total = total
        self.core.set_total(total)
        self.update_model_totals(now)
        self._wake.set()
        return total

    def update_model_totals(self, now: float, step: bool = True) -> dict[str, int | None] | None:
        """Each model's bound from the live workers that name it in their heartbeats (their model
        and what a fronted server serves), stepped like the total (``ModelTotals``; ``step``
        False: at the factors in force, for a model that just appeared); None before any worker
        naming its models is heard, or with the capacity-following total off."""
        self.model_totals.settings = s = self.dynamic.settings
        loads = [ModelLoad(self.worker_models[w][0], cap, used) for w, (cap, used, seen) in self.worker_load.items()
                 if now - seen < 10.0 and self.worker_models.get(w, ((),))[0]]  # (one that names no model: none)
        totals = None
        if loads and s.enabled and not self.partitioned:
            totals = (self.model_totals.next_totals(loads, self.shared.usage.models, self.total,
                                                    self.cache_share.share())
                      if step else self.model_totals.current(loads, self.total))
        if totals != self.core.model_totals:
            log.info("per-model totals %s runtime tokens", "-" if totals is None else
                     ", ".join(f"{m} {'-' if t is None else t}" for m, t in sorted(totals.items())))
        self.core.set_model_totals(totals)
        return totals

    async def _scale_loop(self) -> None:
        while True:
            await asyncio.sleep(self.scale.settings.interval_s)
            try:
                await self.check_scale()
            except NatschedError as exc:  # the bus away: the next check tries again
                log.warning("scaling signal deferred: %s", exc)

    async def check_scale(self, now: float | None = None) -> ScaleEvent | None:
        """One look at the queue and the workers; publishes the signal due, if any (and returns it)."""
        now = time.time() if now is None else now
        entries = list(self.core.queue.oldest())
        live = [WorkerLoad(w, cap, used) for w, (cap, used, seen) in sorted(self.worker_load.items())
                if now - seen < 10.0]
        signal = self.scale.check(now, [now - e.enqueued_at for e in entries], sum(e.cost for e in entries),
                                  self.shared.usage.used, live)
        held = self.scale.current
        self.metrics.queue_wait_p95.set(self.scale.wait_p95)
        self.metrics.scale_advice.labels("out").set(held.add if held is not None and held.kind == "out" else 0)
        self.metrics.scale_advice.labels("in").set(1 if held is not None and held.kind == "in" else 0)
        if signal is None:
            return None
        event = ScaleEvent(kind=signal.kind, ts=now, by=self.settings.name, reason=signal.reason,
                           workers=signal.workers, add=signal.add, drain=signal.drain,
                           queue_wait_p95=signal.queue_wait_p95, demand_tokens=signal.demand_tokens,
                           worker_capacity=signal.worker_capacity, utilisation=signal.utilisation)
        self.metrics.scale_signals.labels(signal.kind).inc()
        log.warning("scale %s: %s%s", signal.kind, signal.reason,
                    f"; add {signal.add} worker(s)" if signal.kind == "out" else f"; drain {signal.drain}")
        await self.bus.publish(S.scale(signal.kind), event)
        await self.bus.kv(S.BUCKET_CONFIG).put(S.KEY_SCALE, event.encode())
        return event

    def note_model(self, worker: str, models: frozenset[str], now: float) -> None:
        """A heartbeat named ``models`` (its model, and what a fronted server serves: base models
        and LoRA adapters): the core refuses models no live worker serves (issue 25: an unknown
        model failed after the router's 10 s wait as ``no_worker``)."""
        self.worker_models[worker] = (models, now)
        served = self.core.served_models
        if served is None or not models <= served:
            self.refresh_served_models(now)
        bounds = self.core.model_totals
        if bounds is not None and not models <= bounds.keys():  # a model (back) on a worker: its bound now
            self.update_model_totals(time.time(), step=False)

    def refresh_served_models(self, now: float) -> None:
        """Forget workers silent for ``model_memory_s``; called with the gauges (every 0.1 s)."""
        memory = self.knobs.lease.model_memory_s
        for worker, (_, seen) in list(self.worker_models.items()):
            if now - seen > memory:
                del self.worker_models[worker]
        self.core.set_served_models(frozenset(m for models, _ in self.worker_models.values() for m in models))

    def _refresh_gauges(self) -> None:
        self.refresh_served_models(time.time())
        if self.shared.refused > self._refused_seen:
            self.metrics.refused_values.inc(self.shared.refused - self._refused_seen)
            self._refused_seen = self.shared.refused
        if self.shared.conflicts > self._conflicts_seen:
            self.metrics.cas_conflicts.inc(self.shared.conflicts - self._conflicts_seen)
            self._conflicts_seen = self.shared.conflicts
        for tenant, used in self.shared.usage.tenants.items():
            self.metrics.inflight.labels(tenant).set(used)
        for cls, depth in self.core.queue_depths().items():
            self.metrics.queue_depth.labels(cls).set(depth)
        self._class_gauges()
        self.metrics.total.set(self.total)
        self.metrics.credit_unspent.set(sum(self.credit.free.values()))


    def _class_gauges(self) -> None:
        """``natsched_admission_class_tokens{class,kind}``: what each class holds, its limit, and
        what it borrowed and lent (the shared usage: the same on every replica)."""
        usage, limits = self.shared.usage, self.core.quotas.class_limits
        for cls in S.CLASSES:
            borrowed = sum(n for (b, _), n in usage.loans.items() if b == cls)
            lent = sum(n for (_, l), n in usage.loans.items() if l == cls)
            gauge = self.metrics.class_tokens
            gauge.labels(cls, "used").set(usage.cls(cls))
            gauge.labels(cls, "borrowed").set(borrowed)
            gauge.labels(cls, "lent").set(lent)
            gauge.labels(cls, "limit").set(limits.get(cls, -1))


def _admission_span(request: Request, dec: AdmissionDecision, d: Delivery | None, queue_wait: float):
    """The admission decision as a (finished) span, child of the producer's; None when tracing is off."""
    span = tracing.start("natsched.admission", getattr(d, "headers", None), request.id, {
        "natsched.tenant": request.tenant, "natsched.class": request.cls, "natsched.decision": dec.decision,
        "natsched.reason": dec.reason, "natsched.runtime_tokens": dec.runtime_tokens,
        "natsched.queue_wait_s": queue_wait, "natsched.est_wait_s": dec.est_wait})
    tracing.end(span)
    return span


def _check_scope(request: Request, subject: str, keyed: bool = False) -> None:
    """Refuse, before it touches any state, a request whose id is in another tenant's scope than
    its subject's (natsched.wire.ids.scoped): no tenant may take, or act on, another's ids.

    ``keyed`` (the deployment runs with ``natsched auth init``'s keys: this admitter was given a
    fence key) also refuses an id of *no* scope: a raw publisher bypassing the client would
    otherwise share one namespace of bare ids with every other tenant's raw publishers (its ``x``
    makes another tenant's ``x`` a duplicate). Refused (``invalid``, dead-lettered, nothing
    reserved), not scoped here on intake: the id is in the subjects the producer chose before it
    published (``resp.<tenant>.<id>``, a job's ``outcome.<tenant>.<batch>.<id>``, which the offline
    runner matches to the request's id), and it is what the producer matches replies, cancels
    and reply fences by (the worker signs and names the id it runs): an id rewritten here would
    answer on a subject naming one id with a body naming another, fenced for an id the producer
    never sent, and its job would lose its record. Open
    mode (no keys) keeps accepting bare ids as they are: there every connection may publish
    anything anyway, and legacy publishers keep working."""
    parsed = S.parse_request_subject(subject)
    tenant = parsed[1] if parsed is not None else request.tenant
    if not in_scope(tenant, request.id) or not in_scope(request.tenant, request.id):
        raise SchemaError(f"request id {request.id!r} is in another tenant's scope than {tenant!r}'s", "id")
    if keyed and scope_of(request.id) is None:
        raise SchemaError(f"request id {request.id!r} is not in tenant {tenant!r}'s scope: with tenant keys every "
                          f"request id must be scoped (natsched.wire.ids.scoped(tenant, id); the natsched client, "
                          f"batch producer and gateway do it)", "id")