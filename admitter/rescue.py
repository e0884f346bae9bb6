"""Rescue: a dead worker's unfinished requests go back through routing, still reserved.

A worker acks its ``work.<worker>`` message only after the request's completion is published,
so when a worker dies, everything it had not finished is still stored on its subject of the
WORK stream (work-queue retention). An admitter replica that sees a worker's lease expire, or
finds messages on the subject of a worker it has not heard from since it started, moves each
message back onto ADMITTED as the next *attempt*, naming the dead worker in ``avoid``:

1. mark the reservation record ``moved_from`` (compare-and-swap). A record that is gone means
   the request's completion was already counted: the message is only removed, never re-run;
2. publish the :class:`~bus.schema.Admitted` with ``Nats-Msg-Id`` ``<id>:adm:<attempt>``, so two
   replicas rescuing the same message at once store it once;
3. tell the producer (status ``rerouted``) and write an audit record (``rescue``);
4. delete the WORK message (a replica that finds it already deleted did nothing wrong).

A crash between 2 and 4 leaves the message for the next sweep, whose publish is deduplicated.
The reservation is not released: the tokens stay booked for the re-run, so the quota never
over-admits while it runs elsewhere, and its completion releases them as usual.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from admitter.shared import SharedState
from bus import subjects as S
from bus.connection import Bus
from bus.errors import MessageError
from bus.schema import Admitted, Assignment, Decision, Reply, WorkerId

log = logging.getLogger(__name__)


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


class Rescuer:
    """Moves stranded assignments back to routing; one sweep at a time per replica."""

    def __init__(self, bus: Bus, shared: SharedState, name: str, max_per_sweep: int = 10_000) -> None:
        self.bus = bus
        self.shared = shared
        self.name = name
        self.max_per_sweep = max_per_sweep

    async def sweep(self, is_live: Callable[[WorkerId], bool]) -> RescueReport:
        report = RescueReport()
        counts = await self.bus.subject_counts(S.STREAM_WORK, S.WORK_ALL)
        for worker, subject in stranded(counts, is_live):
            seq = 1
            for _ in range(min(counts[subject] + 16, self.max_per_sweep)):  # bounded: new ones wait
                found = await self.bus.next_message(S.STREAM_WORK, subject, seq)
                if found is None:
                    break
                seq, data = found
                await self._rescue_one(worker, subject, seq, data, report)
                seq += 1
        return report

    async def _rescue_one(self, worker: WorkerId, subject: str, seq: int, data: bytes, report: RescueReport) -> None:
        try:
            a = Assignment.decode(data)
        except MessageError as exc:
            await self.bus.dead_letter_raw(subject, data, "admitter", "malformed", str(exc))
            await self.bus.delete_message(S.STREAM_WORK, seq)
            report.bad += 1
            return
        rid = a.request.id
        if await self.shared.mark_moved(rid, worker) is None:
            report.finished.append(rid)  # completed (or released) already: nothing to run again
        else:
            adm = readmission(a, worker, self.name)
            await self.bus.jpublish(S.admitted(a.request.cls, a.request.tenant), adm,
                                    msg_id=f"{rid}:adm:{adm.attempt}")
            await self._tell(a, worker, adm.attempt)
            report.rescued[rid] = worker
            log.warning("request %s rescued from dead worker %s (attempt %d)", rid, worker, adm.attempt)
        await self.bus.delete_message(S.STREAM_WORK, seq)

    async def _tell(self, a: Assignment, worker: WorkerId, attempt: int) -> None:
        req = a.request
        record = Decision(request_id=req.id, tenant=req.tenant, cls=req.cls, stage="admission", decision="rescue",
                          ts=time.time(), reason=f"worker {worker} died", worker=worker,
                          runtime_tokens=a.runtime_tokens, by=self.name)
        await self.bus.jpublish_nowait(S.decision("admission", req.tenant), record, msg_id=f"{req.id}:rescue:{attempt}")
        if req.reply:
            await self.bus.publish(req.reply, Reply(request_id=req.id, kind="status", status="rerouted", worker=worker))
