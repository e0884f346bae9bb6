"""Rescue: a dead worker's unfinished requests go back through routing, still reserved.

A worker acks its ``work.<worker>`` message only after the request's completion is published,
so when a worker dies, everything it had not finished is still stored on its subject of the
WORK stream (work-queue retention). An admitter replica that sees a worker's lease expire, or
finds messages on the subject of a worker it has not heard from since it started, moves each
message back onto ADMITTED as the next *attempt*, naming the dead worker in ``avoid``:

1. reclaim: mark each reservation record ``moved_from`` the dead worker (compare-and-swap), at
   once, for every message found;
2. wait (bounded) until the completions stored so far are processed: a worker that died between
   publishing a completion and acking left a *finished* request behind, whose release may still
   be on its way. When the admitters' ack floor does not reach the newest completion in time
   (a killed admitter's un-acked deliveries hold it back for the whole ack wait), read the
   completions stored above it and note their request ids;
3. for each message: a record that is gone now, or a request whose completion was read in 2,
   finished: the message is only removed, never re-run (a reservation still held is released
   when its completion is processed). Otherwise publish the :class:`~natsched.wire.schema.Admitted`
   with ``Nats-Msg-Id`` ``<id>:adm:<attempt>`` (two replicas rescuing the same message at once
   store it once), after telling the producer (status ``rerouted``, with the new attempt: a job's
   runner refuses the old attempt's outcomes by it) and writing an audit record (``rescue``);
4. delete the WORK message (a replica that finds it already deleted did nothing wrong).

A crash between 3 and 4 leaves the message for the next sweep, whose publish is deduplicated.

A worker restarted under its id before its lease expired is alive, yet its predecessor's un-acked
work would wait for the ack wait: its heartbeat's ``predecessor_seq`` bounds that work, and
:meth:`Rescuer.take_over` rescues it the same way, at once.

The reservation is not released: the tokens stay booked for the re-run, so the quota never
over-admits while it runs elsewhere, and its completion releases them as usual.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

from natsched.admitter.shared import SharedState
from natsched.wire import subjects as S
from natsched.wire import msgids as M
from natsched.wire.fence import fenced
from natsched.wire.pools import PoolMap
from natsched.bus.connection import Bus
from natsched.wire.errors import MessageError
from natsched.wire.schema import Admitted, Assignment, Completion, Control, Decision, Reply, ReplyKind, ReplyStatus, WorkerId

log = logging.getLogger(__name__)

RESCUE_CONCURRENCY = 32  # messages re-admitted at once (each is a few round trips)
HANDLER_GRACE_S = 2.0  # a delivered completion's release is a few round trips away


@dataclass
class RescueReport:
    """What one sweep did: request ids re-admitted, and messages removed without a re-run."""

    rescued: dict[str, WorkerId] = field(default_factory=dict)  # request id -> the dead worker
    finished: list[str] = field(default_factory=list)  # their completion was counted already
    bad: int = 0  # undecodable messages moved to the dead-letter stream


def readmission(a: Assignment, dead: WorkerId, by: str) -> Admitted:
    """The next attempt of a stranded assignment: same request and reservation, ``dead`` avoided."""
    avoid = [*a.avoid, dead] if dead not in a.avoid else list(a.avoid)
    return Admitted(request=a.request, runtime_tokens=a.runtime_tokens, admitted_at=a.admitted_at, admitter=by,
                    attempt=a.attempt + 1, avoid=avoid)


def stranded(counts: dict[str, int], is_live: Callable[[WorkerId], bool]) -> list[tuple[WorkerId, str]]:
    """(worker, subject) of every ``work.<worker>`` subject with stored messages and no live worker."""
    out = []
    for subject, n in sorted(counts.items()):
        worker = S.work_owner(subject)
        if worker is not None and n > 0 and not is_live(worker):
            out.append((worker, subject))
    return out


@dataclass
class Stranded:
    """One assignment found on a dead worker's subject."""

    worker: WorkerId
    seq: int  # in the WORK stream
    assignment: Assignment


async def _overlapped(steps: Iterable[Awaitable[None]]) -> None:
    """Run ``steps`` a bounded number at a time: a dead worker's queue can be long, and each
    step is a few round trips."""
    batch: list[Awaitable[None]] = []
    for step in steps:
        batch.append(step)
        if len(batch) >= RESCUE_CONCURRENCY:
            await asyncio.gather(*batch)
            batch = []
    await asyncio.gather(*batch)


class Rescuer:
    """Moves stranded assignments back to routing; one sweep at a time per replica."""

    def __init__(self, bus: Bus, shared: SharedState, name: str, max_per_sweep: int = 10_000,
                 catch_up_s: float = 5.0, max_scan: int = 20_000) -> None:
        self.bus = bus
        self.max_scan = max_scan
        self.catch_up_s = catch_up_s
        self.shared = shared
        self.name = name
        self.max_per_sweep = max_per_sweep
        #: partitioned admission: the tenants whose work this replica's partition rescues (each
        #: partition sweeps every dead worker; another's request is left for its own partition)
        self.owns: Callable[[str], bool] = lambda tenant: True
        self.completions_consumer = S.CONSUMER_ADMITTER_COMPLETIONS
        #: the router pool map (a natsched.bus.pools.PoolWatch): a rescue goes to its model's pool
        self.pools = None

    async def sweep(self, is_live: Callable[[WorkerId], bool]) -> RescueReport:
        """Reclaim first (mark every stranded reservation moved), then, once the completions
        stored so far are processed, re-admit what is still reserved and drop what finished."""
        report = RescueReport()
        counts = await self.bus.subject_counts(S.STREAM_WORK, S.WORK_ALL)
        found: list[Stranded] = []
        for worker, subject in stranded(counts, is_live):
            found += await self._read_subject(worker, subject, min(counts[subject] + 16, self.max_per_sweep), report)
        return await self._rescue_found(found, report)

    async def take_over(self, worker: WorkerId, upto_seq: int, running: Callable[[str], bool]) -> RescueReport:
        """Rescue what a restarted worker's predecessor left: the assignments stored on its subject
        at or below ``upto_seq`` (the heartbeat's ``predecessor_seq``), except those the new
        instance reports running (``running``: a copy redelivered to it after the ack wait).

        The worker is alive, so :meth:`sweep` never looks at its subject; and its durable consumer
        would hand that work to it only after the ack wait (30 s)."""
        report = RescueReport()
        found = [s for s in await self._read_subject(worker, S.work(worker), self.max_per_sweep, report, upto_seq)
                 if not running(s.assignment.request.id) and self.owns(s.assignment.request.tenant)]
        if found:
            log.warning("worker %s restarted: rescuing %d requests its predecessor left unfinished", worker,
                        len(found))
            # first: the live worker must not run a copy the server redelivers to it from now on
            # (the heartbeat read above is older than this): schema.Control, kind handover
            for s in found:
                await self.bus.publish(S.control(worker), Control(
                    kind="handover", ts=time.time(), by=self.name, request_id=s.assignment.request.id,
                    attempt=s.assignment.attempt))
            await self.bus.flush(timeout=2)
        return await self._rescue_found(found, report)

    async def _rescue_found(self, found: list[Stranded], report: RescueReport) -> RescueReport:
        found = [s for s in found if self.owns(s.assignment.request.tenant)]
        if not found:
            return report
        await _overlapped(self._mark(s) for s in found)
        done = await self._completed_unprocessed(await self.completions_caught_up())
        await _overlapped(self._rescue_one(s, report, done) for s in found)
        return report

    async def _read_subject(self, worker: WorkerId, subject: str, limit: int, report: RescueReport,
                            upto_seq: int | None = None) -> list[Stranded]:
        """The assignments stored on a dead worker's subject (undecodable ones dead-lettered),
        at most ``limit``, none above ``upto_seq`` when given."""
        out, seq = [], 1
        for _ in range(limit):  # bounded: what arrives later waits for the next sweep
            got = await self.bus.next_message(S.STREAM_WORK, subject, seq)
            if got is None or (upto_seq is not None and got[0] > upto_seq):
                break
            seq, data = got
            try:
                out.append(Stranded(worker, seq, Assignment.decode(data)))
            except MessageError as exc:
                await self.bus.dead_letter_raw(subject, data, "admitter", "malformed", str(exc))
                await self.bus.delete_message(S.STREAM_WORK, seq)
                report.bad += 1
            seq += 1
        return out

    async def _mark(self, s: Stranded) -> None:
        # (the attempt moves on only in _rescue_one, once it is known not to have finished: a
        # completion of this attempt still being processed must be able to release it)
        await self.shared.mark_moved(s.assignment.request.id, s.worker)

    async def completions_caught_up(self) -> tuple[int, int]:
        """Wait (bounded) until the admitters have processed every completion stored so far;
        returns (ack floor, newest completion) as last seen.

        A worker publishes its completion, then acks: one that died between the two left a
        finished request on WORK. Its completion is stored, but may not be processed yet; once
        it is, the reservation is gone and the request is only removed, never run twice.
        """
        last = await self.bus.stream_last_seq(S.STREAM_COMPLETIONS)
        deadline = time.monotonic() + self.catch_up_s
        all_delivered_at = None
        acked = 0
        while time.monotonic() < deadline:
            acked, delivered = await self.bus.consumer_progress(S.STREAM_COMPLETIONS, self.completions_consumer)
            if acked >= last:
                return acked, last
            # all delivered but not all acked: handlers still at work, or acks that will not come
            # before the ack wait (lost in a leader election, or of a killed admitter): give the
            # handlers a moment, not the ack wait
            if delivered >= last:
                all_delivered_at = all_delivered_at or time.monotonic()
                if time.monotonic() - all_delivered_at >= HANDLER_GRACE_S:
                    return acked, last
            await asyncio.sleep(0.02)
        log.warning("rescue: completions not processed within %.0fs; reading the rest", self.catch_up_s)
        return acked, last

    async def _completed_unprocessed(self, progress: tuple[int, int]) -> set[str]:
        """Request ids of the completions stored above the ack floor (at most ``max_scan``
        read): their requests finished, whether or not a release has counted them yet."""
        acked, last = progress
        first = max(acked + 1, last - self.max_scan + 1)
        if first > last:
            return set()
        if first > acked + 1:
            log.warning("rescue: %d completions not processed; reading only the newest %d", last - acked,
                        self.max_scan)
        ids = set()
        for subject, data in await self.bus.messages_between(S.STREAM_COMPLETIONS, first, last):
            try:
                c = Completion.decode(data)
            except MessageError:
                continue  # the admitters' consumer dead-letters it
            if fenced(self.bus.fence_key, c, subject):  # a forged one finishes nothing
                ids.add(c.request_id)
        return ids

    async def _rescue_one(self, s: Stranded, report: RescueReport, done: set[str]) -> None:
        a, worker, rid = s.assignment, s.worker, s.assignment.request.id
        if rid in done or await self.shared.mark_moved(rid, worker, a.attempt + 1) is None:
            report.finished.append(rid)  # completed (or released) already: nothing to run again
        else:
            adm = readmission(a, worker, self.name)
            pools = self.pools.map if self.pools is not None else PoolMap()
            # told first: a job's offline runner fences outcomes by the attempt it names, and the
            # new attempt's outcome (and its release of the reservation) can only come after the
            # re-admission; a tell repeated by the next sweep after a failed publish changes nothing
            await self._tell(a, worker, adm.attempt)
            await self.bus.jpublish(pools.admitted_subject(a.request.model, a.request.cls, a.request.tenant), adm,
                                    msg_id=M.admitted(rid, adm.attempt))
            report.rescued[rid] = worker
            log.warning("request %s rescued from dead worker %s (attempt %d)", rid, worker, adm.attempt)
        await self.bus.delete_message(S.STREAM_WORK, s.seq)

    async def _tell(self, a: Assignment, worker: WorkerId, attempt: int) -> None:
        req = a.request
        record = Decision(request_id=req.id, tenant=req.tenant, cls=req.cls, stage="admission", decision="rescue",
                          ts=time.time(), reason=f"worker {worker} died", worker=worker,
                          runtime_tokens=a.runtime_tokens, by=self.name)
        await self.bus.jpublish_nowait(S.decision("admission", req.tenant), record, msg_id=M.rescue(req.id, attempt))
        if req.reply:
            await self.bus.publish(req.reply, Reply(request_id=req.id, kind=ReplyKind.STATUS,
                                                    status=ReplyStatus.REROUTED, worker=worker,
                                                    attempt=attempt))  # a job's runner fences by it
