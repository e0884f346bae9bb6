"""The router service: decode -> RouterCore.route -> publish. All I/O lives here.

Learned cost models are shared through bucket ``workers`` (``subjects.md``): every tick a replica
puts its own statistics of each worker it learned something new about under
``cost.<worker>.<replica>`` and watches ``cost.>``; the others' statistics are merged into its book
(:meth:`natsched.router.learned.CostBook.merge`), so every replica solves the same fit. A record
older than ``cost_share_ttl_s`` (a replica that left) is dropped. A worker's heartbeat naming its
``deployment`` makes the router read the calibration stored for it and start that worker's model
from the measured speed.

Router pools (``natsched.wire.pools``): a replica of pool ``P`` consumes only ``adm.<P>.>``
(consumer ``router-<P>``) and registers only the workers whose heartbeats name a model of ``P``,
so its scoring and prefix index cover its pool's tens of workers, not the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections import OrderedDict
import time
from dataclasses import dataclass, field

import orjson

from natsched.wire import subjects as S
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire.blocks import estimate_prompt_tokens
from natsched.bus.connection import Bus, ConsumerSpec, Delivery
from natsched.bus.metrics import watch as watch_bus
from natsched.bus.pools import PoolWatch
from natsched.wire.pools import check_pool
from natsched.wire.errors import MessageError
from natsched.wire.schema import (Admitted, Assignment, CacheEvent, Completion, CompletionStatus, Control, Decision,
                                  Heartbeat, Reply, ReplyKind, ReplyStatus)
from natsched.router.core import RouterCore, RouterSettings
from natsched.router.errors import ConfigError
from natsched.router.learned import calibrated_prior
from natsched.router.metrics import RouterMetrics
from natsched.router.policy import RouteDecision, RouteRequest
from natsched import tracing
from natsched.workers.recent import CANCEL_MEMORY_MAX, CANCEL_MEMORY_S, RecentIds, RecentMap

#: completions remembered (request id and attempt): a copy of a hand-off whose ack was lost comes
#: back after the consumer's ack wait (30 s), after a server restart counted from its return; at
#: 550 completions a second the oldest go first before the three minutes are up
FINISHED_MEMORY_S = 180.0
FINISHED_MEMORY_MAX = 100_000

log = logging.getLogger(__name__)


@dataclass
class RouterServiceSettings:
    name: str = "router"
    core: RouterSettings = field(default_factory=RouterSettings)
    no_worker_wait_s: float = 10.0  # how long an admitted request waits for a healthy worker
    retry_delay_s: float = 1.0
    tick_s: float = 1.0  # upkeep: stale workers, index expiry, snapshot requests
    migration_memory: int = 100_000  # first blocks remembered for the migration-rate metric
    metrics_port: int | None = None  # serve Prometheus metrics here (natsched.router.metrics)
    share_costs: bool = True  # publish and merge learned cost statistics (bucket workers)
    cost_share_ttl_s: float = 120.0  # another replica's statistics older than this are dropped
    #: the router pool this replica routes (natsched.wire.pools): its consumer ``router-<pool>``
    #: reads only ``adm.<pool>.>`` and only the workers serving the pool's models are registered;
    #: the default pool (no pool map) is every model, on consumer ``router``
    pool: str = S.DEFAULT_POOL


@dataclass
class Routed:
    """One routing decision on its way out: the WORK message to store, then :meth:`RouterService.assigned`."""

    delivery: Delivery | None  # the ADMITTED message, or None on the inline path (in the admitter)
    adm: Admitted
    decision: RouteDecision
    latency_ms: float
    first_block: int | None
    assignment: Assignment | None = None
    outgoing: tuple | None = None
    admission: Decision | None = None  # inline: the admitter's record, stored inside the routing one


class RouterService:
    def __init__(self, bus: Bus, settings: RouterServiceSettings | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        self.bus = bus
        self.settings = settings or RouterServiceSettings()
        self.core = RouterCore(self.settings.core)
        self.metrics = metrics or RouterMetrics()
        watch_bus(self.metrics.registry, self.bus)  # its records lost, reconnects (natsched.bus.metrics)
        self._last_worker: OrderedDict[int, str] = OrderedDict()
        self.cancelled = RecentIds(CANCEL_MEMORY_S, CANCEL_MEMORY_MAX)  # cancel.<tenant>.<id> heard
        self.finished = RecentIds(FINISHED_MEMORY_S, FINISHED_MEMORY_MAX)  # _attempt_key of fenced completions
        #: _attempt_key -> what the stored WORK message said beside the request (see _repeat_copy)
        self.routed = RecentMap(FINISHED_MEMORY_S, FINISHED_MEMORY_MAX)
        attempts = int(self.settings.no_worker_wait_s / self.settings.retry_delay_s) + 1
        # the key part of this replica's cost statistics: unique per process, so replicas that share
        # a name do not overwrite each other's
        self.instance = f"{self.settings.name}-{secrets.token_hex(3)}"
        self._published: dict[str, float] = {}  # worker -> newest own sample published
        self._others: dict[tuple[str, str], float] = {}  # (worker, replica) -> its record's time
        self._priors: dict[tuple[str, str], object] = {}  # (model, deployment) -> prior or None (asked)
        self._refused_seen: dict[str, int] = {}  # reason -> refusals already counted in the metrics
        self.pool = check_pool(self.settings.pool)
        self.pools = PoolWatch(bus) if self.pooled else None  # the map: which workers are this pool's
        self.foreign = 0  # heartbeats of workers of other pools, ignored
        self._spec = ConsumerSpec(S.STREAM_ADMITTED, S.pool_router(self.pool), S.pool_admitted(self.pool),
                                  max_deliver=attempts + 3,
                                  redeliver_delay_s=self.settings.retry_delay_s, batch=256)

    async def start(self, watch_completions: bool = True) -> None:
        """``watch_completions`` False: an inline admitter hands over each completion it consumes
        (:meth:`observe_completion`) instead of this router watching ``done.>`` beside it, which
        brought every completion into the same process twice."""
        await self.bus.provision()
        if self.pools is not None:
            await self.pools.start()
            if self.pool not in self.pools.map.pools:
                raise ConfigError(f"router pool {self.pool!r} is not in the pool map (config key "
                                  f"{S.KEY_POOLS!r}): {self.pools.map.describe()}")
        current = await self.bus.kv(S.BUCKET_CONFIG).get(S.KEY_ROUTER_CONFIG)
        if current is not None:
            self.apply_config(current[0])
        self.bus.spawn(self._watch_config(), "router-config")
        self.bus.spawn(self._tick_loop(), "router-tick")
        if self.settings.share_costs:
            self.bus.spawn(self._watch_costs(), "router-costs")
        await self.bus.subscribe(S.HEARTBEATS_ALL, self._on_heartbeat)
        await self.bus.subscribe(S.CACHE_EVENTS_ALL, self._on_cache_event)
        await self.bus.subscribe(S.CANCELS_ALL, self._on_cancel)
        # completions are watched, not consumed: every replica sees each one (it releases the load
        # of what it routed itself), and a missed one costs only accuracy until the next heartbeat
        if watch_completions:
            await self.bus.subscribe(S.COMPLETIONS_ALL, self._on_completion)
        await self.bus.consume_batches(self._spec, self._on_admitted, source="router")
        if self.settings.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.settings.metrics_port, registry=self.metrics.registry)
        log.info("router ready (policy %s, pool %s)", self.core.policy.name, self.pool)

    @property
    def pooled(self) -> bool:
        """Whether this replica routes a configured pool (not the default one: every model)."""
        return self.pool != S.DEFAULT_POOL

    def is_mine(self, hb: Heartbeat) -> bool:
        """Whether ``hb``'s worker serves a model of this router's pool (the default pool: any)."""
        if self.pools is None:
            return True
        return self.pools.map.routes(self.pool, (hb.model, *(m.id for m in hb.served)))

    def apply_config(self, raw: bytes) -> bool:
        """Apply ``{"policy", "weights", "canary", "canary_share", "learn", "health"}`` from the config bucket.

        A value that cannot be used is logged and ignored: the running policy stays.
        """
        try:
            cfg = orjson.loads(raw)
            if not isinstance(cfg, dict):
                raise ConfigError("router config must be a JSON object")
            weights = cfg.get("weights") or {}
            if "policy" in cfg:
                self.core.set_policy(str(cfg["policy"]), weights.get(cfg["policy"], weights))
            if "canary" in cfg:
                canary = cfg["canary"]
                self.core.set_canary(canary, float(cfg.get("canary_share", 0.0)),
                                     weights.get(canary) if canary else None)
            if cfg.get("learn") is not None or cfg.get("health") is not None:
                self.core.set_learning(cfg.get("learn"), cfg.get("health"))
        except (orjson.JSONDecodeError, ConfigError, TypeError, ValueError, AttributeError) as exc:
            log.error("ignoring router config %r: %s; keeping policy %s", raw[:120], exc, self.core.policy.name)
            self.metrics.config_errors.inc()
            return False
        return True

    async def _watch_config(self) -> None:
        async for _key, value, _rev in self.bus.kv(S.BUCKET_CONFIG).watch(S.KEY_ROUTER_CONFIG):
            if value is not None:
                self.apply_config(value)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            now = time.time()
            self.core.tick(now)
            self.metrics.set_worker_states([str(getattr(s, "value", s)) for s in
                                            (self.core.registry.state(w, now) for w in list(self.core.workers))])
            self.metrics.index_entries.set(self.core.index.stats()["entries"])
            self._count_refused()
            await self._ask_snapshots()
            if self.settings.share_costs:
                try:
                    await self.publish_costs(now)
                except Exception as exc:  # the bucket is unreachable for now: the next tick tries again
                    log.warning("could not publish learned cost statistics: %s", exc)

    def _count_refused(self) -> None:
        for reason, n in self.core.costs.refused.items():
            seen = self._refused_seen.get(reason, 0)
            if n > seen:
                self.metrics.cost_refused.labels(reason).inc(n - seen)
                self._refused_seen[reason] = n

    async def publish_costs(self, now: float) -> int:
        """Put this replica's new statistics of each worker in bucket ``workers``; how many."""
        costs, n = self.core.costs, 0
        for w in costs.workers():
            last = costs.last_sample(w)
            if last is None or self._published.get(w) == last:
                continue
            rec = costs.record(w, now, self.core.health.state(w))
            if rec is None:
                continue
            await self.bus.kv(S.BUCKET_WORKERS).put(S.cost_key(w, self.instance), orjson.dumps(rec))
            self._published[w] = last
            n += 1
        cutoff = now - self.settings.cost_share_ttl_s
        for (w, replica), at in list(self._others.items()):
            if at < cutoff:  # that replica left (or stopped learning this worker): its old view goes
                del self._others[(w, replica)]
                costs.merge(w, replica, None)
        return n

    async def _watch_costs(self) -> None:
        async for key, value, _rev in self.bus.kv(S.BUCKET_WORKERS).watch(S.COST_KEYS):
            self.apply_cost_record(key, value, time.time())

    def apply_cost_record(self, key: str, value: bytes | None, now: float) -> bool:
        """Merge another replica's statistics of a worker; a bad record is logged, counted, ignored."""
        parsed = S.parse_cost_key(key)
        if parsed is None or parsed[1] == self.instance:
            return False
        w, replica = parsed
        try:
            if value is None:
                self.core.costs.merge(w, replica, None)
                self._others.pop((w, replica), None)
                return True
            rec = orjson.loads(value)
            if not isinstance(rec, dict) or not isinstance(rec.get("at"), (int, float)) or not math.isfinite(rec["at"]):
                raise ValueError("a cost record needs a finite 'at'")
            if rec["at"] < now - self.settings.cost_share_ttl_s:
                return False
            self.core.costs.merge(w, replica, rec.get("stats"))
            self._others[(w, replica)] = float(rec["at"])
            return True
        except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
            log.warning("ignoring cost statistics %s: %s", key, exc)
            self.metrics.bad_reports.labels("cost").inc()
            return False

    async def _load_prior(self, model: str, deployment: str, worker: str) -> None:
        """Start ``worker``'s model from the calibration stored for (model, deployment), if any."""
        from natsched.workers.calibrate import load_calibration

        key = (model, deployment)
        if key not in self._priors:
            self._priors[key] = None  # asked (once per deployment, even if it fails)
            try:
                cal = await load_calibration(self.bus, model, deployment)
                if cal is not None:
                    self._priors[key] = calibrated_prior(self.core.settings.cost, cal.baseline_ttft, cal.baseline_tpot,
                                                         cal.prompt_tokens)
            except Exception as exc:  # no bucket, a bad record: the fixed model stays the prior
                log.warning("no calibration prior for %s/%s: %s", model, deployment, exc)
        prior = self._priors.get(key)
        if prior is not None:
            self.core.costs.set_prior(worker, prior, "calibration")
            log.info("worker %s starts from calibration %s/%s", worker, model, deployment)

    async def _ask_snapshots(self) -> None:
        for worker in self.core.pop_snapshot_requests():
            log.info("asking worker %s for a cache snapshot", worker)
            self.metrics.snapshot_requests.inc()
            await self.bus.publish(S.control(worker), Control(kind="snapshot", ts=time.time(), by=self.settings.name))

    async def _on_heartbeat(self, subject: str, data: bytes, headers: dict) -> None:
        try:
            hb = Heartbeat.decode(data)
        except MessageError as exc:
            log.warning("ignoring bad heartbeat on %s: %s", subject, exc)
            self.metrics.bad_reports.labels("heartbeat").inc()
            return
        if subject != S.heartbeat(hb.worker):  # a worker may only speak for itself
            log.warning("ignoring heartbeat of %s published on %s", hb.worker, subject)
            self.metrics.bad_reports.labels("heartbeat").inc()
            return
        if not self.is_mine(hb):  # another pool's worker: not scored, not indexed here
            self.foreign += 1
            return
        known = hb.worker in self.core.workers
        self.core.on_heartbeat(hb, time.time())
        if not known and hb.deployment:
            self.bus.spawn(self._load_prior(hb.model, hb.deployment, hb.worker), "router-prior")
        await self._ask_snapshots()  # a worker first heard mid-stream: ask now, not at the next tick

    async def _on_cache_event(self, subject: str, data: bytes, headers: dict) -> None:
        try:
            ev = CacheEvent.decode(data)
        except MessageError as exc:
            log.warning("ignoring bad cache event on %s: %s", subject, exc)
            self.metrics.bad_reports.labels("cache_event").inc()
            return
        if subject != S.cache_events(ev.worker):
            log.warning("ignoring cache event of %s published on %s", ev.worker, subject)
            self.metrics.bad_reports.labels("cache_event").inc()
            return
        if self.pooled and ev.worker not in self.core.workers:
            # another pool's worker, or one not heard yet: its first heartbeat asks for a snapshot
            return
        if not self.core.on_cache_event(ev, time.time()):
            log.info("cache events of %s have a gap at seq %d; asking for a snapshot", ev.worker, ev.seq)
            self.metrics.snapshot_requests.inc()
            await self.bus.publish(S.control(ev.worker), Control(kind="snapshot", ts=time.time(), by=self.settings.name))

    async def _on_completion(self, subject: str, data: bytes, headers: dict) -> None:
        try:
            c = Completion.decode(data)
        except MessageError as exc:  # the admitters' durable consumer dead-letters it
            log.warning("ignoring an undecodable completion on %s: %s", subject, exc)
            return
        if not fence.fenced(self.bus.fence_key, c, subject):  # a forged one frees no load, teaches nothing
            log.warning("ignoring completion of %s on %s: not from the worker it was assigned to", c.request_id,
                        subject)
            return
        self.observe_completion(c)

    def observe_completion(self, c: Completion) -> None:
        """Release the load of a finished request and score the cache claim it confirms or refutes
        (and remember that its attempt finished: :meth:`_finished_copy`)."""
        self.finished.add(_attempt_key(c.request_id, c.attempt))
        if self.core.on_completion(c, time.time()):
            self.metrics.claim_failures.labels(c.worker or "").inc()
        if c.worker and c.status == CompletionStatus.OK:
            self.metrics.cached_tokens.labels(c.worker, "actual").inc(c.cached_tokens)
            self.metrics.cached_tokens.labels(c.worker, "expected").inc(c.expected_cached_tokens or 0)

    async def _on_admitted(self, batch: list[Delivery]) -> None:
        """Route a batch in order (the core sees each decision before the next), publish concurrently."""
        routed = []
        for d in batch:
            try:
                adm = Admitted.decode(d.data)
            except MessageError as exc:
                await self.bus.settle_failed(d, self._spec, "router", exc)
                continue
            if self._finished_copy(adm):
                await d.ack()
                continue
            if await self._repeat_copy(adm, d):
                continue
            if self.is_cancelled(adm):  # admitted, then its producer gave up: never routed
                await self._fail(adm, RouteDecision(None, self.core.policy.name, reason="cancelled"), "cancelled",
                                 "its producer cancelled it before it was routed")
                await d.ack()
                continue
            routed.append(self.decide(adm, d))
        assigned = [r for r in routed if r.decision.worker is not None]
        for r in routed:
            if r.decision.worker is None:
                await self._no_worker(r.delivery, r.adm, r.decision)
        if assigned:
            await self.bus.jpublish_batch([r.outgoing for r in assigned])
            for r in assigned:
                await self.assigned(r)

    def _finished_copy(self, adm: Admitted) -> bool:
        """A hand-off whose attempt's completion was seen already: a copy whose ack was lost.

        After an unclean server restart, the acks the server had not written are gone, and so is
        the dedup of every consumed hand-off (rebuilt from what is stored; ADMITTED and WORK are
        work queues): a copy routed again is stored as new WORK, and runs a finished request a
        second time, whenever the first WORK message's id is forgotten (a loaded ``natsched chaos
        --scenario recovery`` run re-dispatched 17 of 300 this way, 28 s after their completions,
        11 to another worker; the WORK dedup happened to still know them). Its completion could
        release nothing (one accepted completion per request), but the engine time is spent
        twice. Only fenced completions are remembered, so a forged one cannot make a router drop
        a request."""
        if _attempt_key(adm.request.id, adm.attempt) not in self.finished:
            return False
        self.metrics.finished_copies.inc()
        log.warning("request %s (attempt %d) handed off again after its completion: acked, not routed",
                    adm.request.id, adm.attempt)
        return True

    async def _repeat_copy(self, adm: Admitted, d: Delivery) -> bool:
        """A hand-off of an attempt this router assigned already: sent again, unchanged, to the
        worker it went to, and acked.

        The copy of a hand-off whose ack a server restart lost can come back before that
        attempt's completion does (the worker's publish is retried after the same restart), so
        :meth:`_finished_copy` cannot see it finished yet; routed anew, it ran a finished request
        a second time on another worker (``natsched chaos --scenario recovery``: 1–2 of 300, 3–4 s
        after their completions). The same assignment (same worker, fence and ``routed_at``) under
        the same message id is deduplicated by WORK while the server remembers the first, and
        otherwise reaches the worker that ran it, whose own memory of finished requests acks it
        without running it (or that has not got it yet, and runs it once). A router that
        restarted has no memory and routes it as new, as before."""
        previous = self.routed.get(_attempt_key(adm.request.id, adm.attempt))
        if not isinstance(previous, _Sent):
            return False
        await self.bus.jpublish(S.work(previous.worker), previous.assignment(adm),
                                msg_id=M.work(adm.request.id, adm.attempt))
        await d.ack()
        self.metrics.repeated_copies.inc()
        log.warning("request %s (attempt %d) handed off again: sent to %s as before, not re-routed",
                    adm.request.id, adm.attempt, previous.worker)
        return True

    async def _on_cancel(self, subject: str, data: bytes, headers: dict) -> None:
        """Remember a producer's cancel (``cancel.<tenant>.<id>``): an admitted request of that
        tenant not routed yet is failed as ``cancelled`` when it comes (waiting for a worker, it
        comes back within the retry delay); one routed already is its worker's to stop."""
        if S.parse_cancel_subject(subject) is None:
            log.warning("ignoring a cancel on %s", subject)
            return
        self.cancelled.add(subject)

    def is_cancelled(self, adm: Admitted) -> bool:
        """Whether the request's own tenant cancelled it (the subject names the tenant: a cancel
        by another tenant for the same id is another key)."""
        return S.cancel(adm.request.tenant, adm.request.id) in self.cancelled

    def decide(self, adm: Admitted, d: Delivery | None = None, trace: dict[str, str] | None = None) -> "Routed":
        """Route one admitted request (state in, decision out) and build its WORK message.

        Also the inline path (``natsched.admitter.service`` with a router in its process): the admitter
        publishes ``outgoing`` with its own batch and calls :meth:`assigned` once it is stored.
        ``trace``: the admission span's headers there (else the delivery's carry the context).
        """
        started = time.perf_counter()
        rr = RouteRequest.from_request(adm.request, self.core.settings.block_size, adm.runtime_tokens)
        rr.avoid = frozenset(adm.avoid)
        decision = self.core.route(rr, time.time())
        elapsed = time.perf_counter() - started
        self.metrics.latency.observe(elapsed)
        r = Routed(d, adm, decision, elapsed * 1000, rr.hashes[0] if rr.hashes else None)
        if decision.worker is not None:
            req = adm.request
            r.assignment = _Sent(
                decision.worker, time.time(), decision.policy, decision.expected_cached_tokens,
                fence.sign(self.bus.fence_key, req.id, decision.worker, adm.attempt),
                fence.reply_sign(fence.reply_key(self.bus.fence_key, req.tenant), req.id, decision.worker,
                                 adm.attempt)).assignment(adm)
            # one id per request and attempt: a router that crashes after this publish and re-routes
            # on redelivery is deduplicated by the server instead of running the request twice; a
            # rescue (its worker died) is a new attempt, which must not be deduplicated away
            msg_id = M.work(req.id, adm.attempt)
            span = _routing_span(adm, decision, d.headers if d is not None else trace)
            r.outgoing = (S.work(decision.worker), r.assignment, msg_id, tracing.carry(span))
        else:
            _routing_span(adm, decision, d.headers if d is not None else trace)
        return r

    async def _no_worker(self, d: Delivery, adm: Admitted, decision: RouteDecision) -> None:
        """Retry later while the request may still wait for a worker; then fail it."""
        waited = time.time() - adm.admitted_at
        if waited < self.settings.no_worker_wait_s:
            self.metrics.decisions.labels(decision.policy or "", "retry", decision.reason or "").inc()
            await d.nak(delay=self.settings.retry_delay_s)
            return
        why = self.core.registry.why_no_worker(adm.request.model, time.time())
        await self._fail(adm, decision, "no_worker", f"{why}; waited {waited:.0f}s")
        await d.ack()

    async def assigned(self, r: "Routed") -> None:
        """A WORK message is stored: record the decision, tell the producer, ack the hand-off."""
        adm, decision, assignment = r.adm, r.decision, r.assignment
        req = adm.request
        self.routed.put(_attempt_key(req.id, adm.attempt), _Sent.of(assignment))
        await self._record(adm, decision, "assign", r.latency_ms, admission=r.admission)
        if req.reply:
            await self.bus.publish(req.reply, Reply(request_id=req.id, kind=ReplyKind.STATUS,
                                                    status=ReplyStatus.ASSIGNED, worker=decision.worker))
        if r.delivery is not None:
            await r.delivery.ack()
        m = self.metrics
        m.decisions.labels(decision.policy or "", "assign", "").inc()
        m.wait.observe(max(0.0, assignment.routed_at - adm.admitted_at))
        m.expected_cached.labels(decision.policy or "").inc(decision.expected_cached_tokens)
        m.prompt_tokens.labels(decision.policy or "").inc(estimate_prompt_tokens(req))
        m.assignments.labels(decision.policy or "", decision.worker).inc()
        self._count_migration(r.first_block, decision.worker)
        log.info("request %s assigned to %s by %s (expected cached %d)", req.id, decision.worker, decision.policy,
                 decision.expected_cached_tokens)

    def _count_migration(self, first_block: int | None, worker: str) -> None:
        """Prefix migration: a request whose first block last went to another worker."""
        if first_block is None:
            return
        last = self._last_worker.pop(first_block, None)
        self._last_worker[first_block] = worker
        if len(self._last_worker) > self.settings.migration_memory:
            self._last_worker.popitem(last=False)
        if last is not None:
            self.metrics.prefix_routes.inc()
            if last != worker:
                self.metrics.prefix_migrations.inc()

    async def _fail(self, adm: Admitted, decision: RouteDecision, reason: str, message: str) -> None:
        """Close an admitted request that cannot run: its completion releases the reservation."""
        req = adm.request
        token = fence.sign(self.bus.fence_key, req.id, S.ROUTER_SOURCE, adm.attempt)
        completion = Completion(request_id=req.id, tenant=req.tenant, cls=req.cls, model=req.model,
                                status=CompletionStatus.ERROR, runtime_tokens=adm.runtime_tokens, reason=reason,
                                ts=time.time(), worker=S.ROUTER_SOURCE, attempt=adm.attempt, fence=token)
        await self.bus.jpublish(S.completion(req.tenant, S.ROUTER_SOURCE), completion,
                                msg_id=M.completion(req.id, token))
        await self._record(adm, decision, "fail", 0.0, reason)
        self.metrics.decisions.labels(decision.policy or "", "fail", reason).inc()
        if req.reply:
            await self.bus.publish(req.reply, Reply(request_id=req.id, kind=ReplyKind.ERROR, status=ReplyStatus.FAILED,
                                                    reason=reason, message=message))
        log.warning("request %s failed in routing: %s", req.id, message)

    async def _record(self, adm: Admitted, decision: RouteDecision, what: str, latency_ms: float,
                      reason: str | None = None, admission: Decision | None = None) -> None:
        """The routing record; with ``admission`` (inline routing) the admission record inside it:
        one stored message for the two decisions one process made at once."""
        req = adm.request
        record = Decision(request_id=req.id, tenant=req.tenant, cls=req.cls, stage="routing", decision=what,
                          ts=time.time(), reason=reason or decision.reason, worker=decision.worker,
                          policy=decision.policy,
                          scores={str(k): decision.terms.get(k, v) for k, v in decision.scores.items()},
                          expected_cached_tokens=decision.expected_cached_tokens, by=self.settings.name,
                          latency_ms=latency_ms, runtime_tokens=adm.runtime_tokens,
                          admission=admission.to_wire() if admission is not None else None)
        await self.bus.jpublish_nowait(S.decision("routing", req.tenant), record, msg_id=M.routing(req.id))


@dataclass(frozen=True, slots=True)
class _Sent:
    """What a stored WORK message said beside its request (the request itself is in every copy:
    keeping it would hold every prompt for minutes)."""

    worker: str
    routed_at: float
    policy: str
    expected_cached_tokens: int
    fence: str
    reply_fence: str

    @classmethod
    def of(cls, a: Assignment) -> "_Sent":
        return cls(a.worker, a.routed_at, a.policy, a.expected_cached_tokens, a.fence, a.reply_fence)

    def assignment(self, adm: Admitted) -> Assignment:
        """The WORK message for ``adm`` (the first one, or a copy of it: the same fields)."""
        return Assignment(request=adm.request, worker=self.worker, runtime_tokens=adm.runtime_tokens,
                          admitted_at=adm.admitted_at, routed_at=self.routed_at, policy=self.policy,
                          expected_cached_tokens=self.expected_cached_tokens, attempt=adm.attempt,
                          avoid=adm.avoid, fence=self.fence, reply_fence=self.reply_fence)


def _attempt_key(request_id: str, attempt: int) -> str:
    return f"{request_id}{M.SEP}{attempt}"


def _routing_span(adm: Admitted, decision: RouteDecision, parent: dict[str, str] | None):
    """The routing decision as a (finished) span: the worker, the policy and its terms per
    candidate (what the audit's routing record holds); None when tracing is off."""
    if not tracing.enabled():
        return None
    span = tracing.start("natsched.routing", parent, adm.request.id, {
        "natsched.worker": decision.worker, "natsched.policy": decision.policy, "natsched.reason": decision.reason,
        "natsched.expected_cached_tokens": decision.expected_cached_tokens, "natsched.attempt": adm.attempt,
        "natsched.route.terms": orjson.dumps({str(k): decision.terms.get(k, v)
                                              for k, v in decision.scores.items()}).decode()})
    tracing.end(span)
    return span
