"""The admitter's background repairs: worker leases, rescue of dead workers' work, reconciliation.

A mixin of :class:`natsched.admitter.service.AdmitterService`, apart so that the request path reads on
its own. Everything here runs beside admission: heartbeats renew leases; a lease that expires
has its worker's unfinished work rescued (:mod:`natsched.admitter.rescue`) and what nothing runs any more
released; the reconciliation compares the shared usage with the reservation records and
releases orphans. None of it may stop for good on one bad moment (a contended usage, a stalled
read, a server away): each pass that fails is tried again at the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from natsched.admitter.engines import EngineQueues
from natsched.admitter.errors import AdmitterError
from natsched.admitter.leases import LeaseTracker, reconcile
from natsched.admitter.rescue import RescueReport, Rescuer
from natsched.admitter.usage import Usage
from natsched.bus.aio import wait_event
from natsched.wire import subjects as S
from natsched.errors import NatschedError
from natsched.wire.errors import MessageError
from natsched.wire.schema import Heartbeat

if TYPE_CHECKING:
    from natsched.admitter.metrics import AdmitterMetrics
    from natsched.admitter.policy import AdmitterCore
    from natsched.admitter.shared import SharedState
    from natsched.bus.connection import Bus

log = logging.getLogger(__name__)

LEASE_TICK_S = 0.1  # how often leases are checked: a fraction of any heartbeat period
FAST_SWEEP_S = 0.1  # rescue sweeps this often ...
RECENT_DEATH_S = 30.0  # ... for this long after a worker's lease expired
REMEMBER_S = 60.0  # own reservation records kept in memory between two full reconciliations


class Repairs:
    """Heartbeats and leases, rescue and reconciliation of one admitter replica.

    The attributes below are the service's, set by ``AdmitterService.__init__``: declared here
    so that what the repairs touch is visible in one place.
    """

    bus: Bus
    settings: Any  # AdmitterServiceSettings
    core: AdmitterCore
    shared: SharedState
    leases: LeaseTracker
    rescuer: Rescuer
    metrics: AdmitterMetrics
    worker_load: dict[str, tuple[int, int, float]]
    knobs: Any  # natsched.admitter.knobs.Knobs: the lease settings in force
    _dead: dict[str, float]
    _instances: dict[str, float]  # worker -> the started_at of the instance last heard
    _takeovers: dict[str, int]  # restarted worker -> its predecessor_seq, waiting for the lease loop
    _taken_over: dict[str, int]  # worker -> the predecessor_seq last taken over (once per bound)
    _takeover_wake: asyncio.Event
    _wake: asyncio.Event
    engines: EngineQueues
    _started: float
    _lock: asyncio.Lock
    _suspect: object
    _reconciled_revision: int
    _full_at: float | None
    release: Callable[..., Awaitable[int]]  # AdmitterService.release: free one reservation once

    async def _on_heartbeat(self, subject: str, data: bytes, headers: dict) -> None:
        try:
            hb = Heartbeat.decode(data)
        except MessageError as exc:
            log.warning("ignoring bad heartbeat on %s: %s", subject, exc)
            return
        if subject != S.heartbeat(hb.worker):  # a worker may only hold leases for itself
            log.warning("ignoring heartbeat of %s published on %s", hb.worker, subject)
            return
        now = time.time()
        self._note_instance(hb)
        self.leases.on_heartbeat(hb.worker, now, hb.interval, hb.inflight)
        self._dead.pop(hb.worker, None)
        self.worker_load[hb.worker] = (hb.capacity_tokens, hb.runtime_tokens, now)
        self.note_model(hb.worker, frozenset({hb.model, *(m.id for m in hb.served)}), now)
        saturated = self.core.saturated
        self.engines.heartbeat(hb.worker, frozenset({hb.model, *(m.id for m in hb.served)}), hb.waiting)
        self.core.set_saturated(self.engines.saturated())
        if saturated - self.core.saturated:
            self._wake.set()  # a model's engines may take work again: the queue goes now
        for rid, held in hb.over.items():  # ran past its reservation: grow it (service.grow)
            if self.leases.holder.get(rid) == hb.worker:  # only the worker running it may say so
                self._grow_wanted[rid] = max(held, self._grow_wanted.get(rid, 0))
        if hb.over:
            self._grow_wake.set()

    def _note_instance(self, hb: Heartbeat) -> None:
        """A worker instance that took over un-acked work (its ``predecessor_seq``): that work is
        rescued at the next lease tick, once per bound (``started_at`` also moves when a fronted
        engine server's cache begins anew, without a new worker process: that rescues nothing)."""
        before = self._instances.get(hb.worker)
        if before != hb.started_at:
            self._instances[hb.worker] = hb.started_at
            if before is not None:
                log.warning("worker %s restarted (started_at %.3f -> %.3f)", hb.worker, before, hb.started_at)
        if hb.predecessor_seq and self._taken_over.get(hb.worker) != hb.predecessor_seq:
            self._taken_over[hb.worker] = hb.predecessor_seq
            self._takeovers[hb.worker] = hb.predecessor_seq
            self._takeover_wake.set()

    async def _lease_loop(self) -> None:
        """Judge leases every ``LEASE_TICK_S``; reclaim beside the loop, one reclaim at a time
        (a restarted worker's takeover, :meth:`_note_instance`, goes with the next one).

        A reclaim can take seconds while the cluster elects leaders. Awaited here, it stopped
        the ticks: other leases went unjudged, and the next tick took the gap for a pause of
        this process and restarted every lease (a second death was then seen late).
        """
        last_sweep = 0.0
        waiting: dict[str, set[str]] = {}  # expired while a reclaim ran: the next one takes them
        running: asyncio.Task | None = None
        try:
            while True:
                await wait_event(self._takeover_wake, LEASE_TICK_S)  # a restart's takeover starts at once
                self._takeover_wake.clear()
                deaf = self.leases.deaf
                for worker, held in self.leases.expired(time.time(), self.bus.connected).items():
                    waiting.setdefault(worker, set()).update(held)
                if self.leases.paused_s:
                    log.warning("this admitter was paused for %.1fs: worker leases restart now (heartbeats sent "
                                "meanwhile are still unread)", self.leases.paused_s)
                if deaf != self.leases.deaf:
                    log.warning("this admitter's connection is %s: worker leases %s", "down" if self.leases.deaf
                                else "back", "are not judged meanwhile (heartbeats sent now are lost to everyone)"
                                if self.leases.deaf else "restart now")
                if running is not None and not running.done():
                    continue  # (takeovers wait in self._takeovers, like expiries in waiting)
                takeovers, self._takeovers = self._takeovers, {}
                if not waiting and not takeovers and time.monotonic() - last_sweep < self._sweep_interval():
                    continue
                last_sweep = time.monotonic()
                expired, waiting = waiting, {}
                running = asyncio.create_task(self._reclaim_once(expired, takeovers), name="lease-reclaim")
        finally:  # the Bus closing cancels this loop: the reclaim in flight stops with it
            if running is not None:
                running.cancel()

    async def _reclaim_once(self, expired: dict[str, set[str]], takeovers: dict[str, int] | None = None) -> None:
        try:
            for worker, upto in (takeovers or {}).items():
                report = await self.rescuer.take_over(worker, upto, self.leases.reported)
                self.metrics.repairs.labels("restart").inc(len(report.rescued))
            await self.reclaim(expired)
        except (AdmitterError, NatschedError) as exc:
            log.warning("lease reclaim deferred: %s", exc)
        except Exception:  # e.g. a permission refused: say so loudly, but never stop reclaiming
            log.exception("lease reclaim failed; retrying at the next sweep")

    def _sweep_interval(self) -> float:
        """Soon after a death, routers may still be sending the dead worker work for a moment
        (they stop after 2 of its periods): sweep often then, so that work waits little."""
        now = time.monotonic()
        if any(now - since < RECENT_DEATH_S for since in self._dead.values()):
            return FAST_SWEEP_S
        return self.settings.rescue_interval_s

    def is_live(self, worker: str) -> bool:
        """Alive for rescue purposes: its lease holds, or (never seen) this replica is too new to judge."""
        if worker in self.leases.workers:
            return True
        return worker not in self._dead and time.monotonic() - self._started < self.knobs.lease.rescue_grace_s

    async def reclaim(self, expired: dict[str, set[str]]) -> RescueReport:
        """Rescue what dead workers left on WORK, then free the reservations nothing runs any more."""
        for worker, held in expired.items():
            log.warning("worker %s missed %d heartbeats: its lease expired (%d requests held); rescuing its "
                        "unfinished work", worker, self.knobs.lease.missed, len(held))
            self.worker_load.pop(worker, None)
            self.engines.gone(worker)
            self._dead[worker] = time.monotonic()
            self.metrics.lease_expiries.inc()
        report = await self.rescuer.sweep(self.is_live)
        self.metrics.repairs.labels("rescue").inc(len(report.rescued))
        for worker, held in expired.items():
            for rid in held - report.rescued.keys():
                res = await self.shared.lookup(rid)
                if res is not None and res.moved_from:
                    continue  # another replica rescued it: its tokens are booked for the re-run
                if await self.release(rid, why=f"lease of {worker} expired"):
                    self.metrics.repairs.labels("lease").inc()
        return report

    async def _reconcile_loop(self) -> None:
        """A pass that fails (a contended usage, a read that stalled, a server away) is tried again
        at the next interval: a background repair must never stop for good on one bad moment."""
        while True:
            await asyncio.sleep(self.knobs.lease.reconcile_interval_s)
            try:
                await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.bus.closed:  # for good (stopped, or reconnects exhausted): nothing to repair with
                    log.info("reconciliation stops: the connection is closed")
                    return
                log.warning("reconciliation deferred to the next pass: %r", exc)

    async def reconcile_once(self) -> int:
        """Repair drift seen twice in a row (once may be a commit between its two writes), and
        release orphans (reservations no live worker reports after ``orphan_after_s``).

        Reading every reservation record also reads the release markers of the last minute —
        tens of thousands at 1,000 requests/s — so the full pass runs only when the usage has
        not moved since the previous pass (the only time drift can be told from a commit in
        flight anyway) or every ``full_reconcile_s``; in between it only bounds this replica's
        memory of its own records. Measured: at 1,200 requests/s a full read (72k
        messages) stalls the admitter for ~1.2 s; every 10 s or every 60 s it made a soak's p99
        0.8-1.2 s. Every ten minutes it touches one request in 500, and orphans of another
        replica or drift under unbroken load wait that long (a quiet moment repairs them sooner).
        """
        quiet = self.shared.revision == self._reconciled_revision
        self._reconciled_revision = self.shared.revision
        full = (quiet or self._full_at is None or self.shared.corrupted
                or time.monotonic() - self._full_at >= self.settings.full_reconcile_s)
        if not full:
            # the full read is also what forgets records other replicas released: between two,
            # keep only the recent ones (an older own request pays one read at its release)
            self.shared.forget_older_than(REMEMBER_S)
            return 0
        records = await self.shared.snapshot()
        self._full_at = time.monotonic()
        now = time.time()
        ages = {rid: now - r.ts for rid, r in records.items()}
        repair = reconcile(self.shared.usage, records, self.shared.drift(records, self.core.is_long, self.shared.usage),
                           self.leases,
                           now, self.knobs.lease.orphan_after_s, ages)
        repaired = 0
        for rid in repair.orphans:
            if await self.release(rid, why="orphan: no worker reports it"):
                self.metrics.repairs.labels("orphan").inc()
                repaired += 1
        seen = (self.shared.revision, repair.usage)
        # an undecodable usage is repaired at once: there is no commit in flight to wait for
        if self.shared.corrupted or (repair.usage is not None and self._suspect == seen):
            async with self._lock:
                records = await self.shared.snapshot()

                def fix(u: Usage) -> tuple[Usage | None, None]:
                    expected = self.shared.drift(records, self.core.is_long, u)  # with u's credit entries
                    return (expected if u != expected or self.shared.corrupted else None), None

                await self.shared.change_usage(fix)
                self.core.usage = self.shared.usage
            self.metrics.repairs.labels("aggregate").inc()
            log.warning("usage drift repaired: aggregate now %d runtime tokens", self.shared.usage.used)
            repaired += 1
            self._suspect = None
        else:
            self._suspect = seen if repair.usage is not None else None
        return repaired
