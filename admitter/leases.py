"""Leases and reconciliation: pure bookkeeping of which worker holds which reservation.

Workers list their in-flight request ids in every heartbeat. A worker silent for
``missed`` heartbeat periods has lost its leases: its reservations are reclaimed. The
reconciliation compares the shared aggregate with the reservation records (and the records
with what workers report) and says what to repair; the service performs the repair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from admitter.usage import Usage


@dataclass
class _Lease:
    last: float
    interval: float
    inflight: set[str] = field(default_factory=set)


class LeaseTracker:
    def __init__(self, missed: int = 3) -> None:
        self.missed = missed
        self.workers: dict[str, _Lease] = {}
        self.holder: dict[str, str] = {}  # request id -> worker that last reported it

    def on_heartbeat(self, worker: str, now: float, interval: float, inflight: list[str]) -> None:
        lease = self.workers.setdefault(worker, _Lease(now, interval))
        lease.last, lease.interval = now, max(0.05, interval)
        lease.inflight = set(inflight)
        for rid in inflight:
            self.holder[rid] = worker

    def expired(self, now: float) -> dict[str, set[str]]:
        """Workers past their lease, with the request ids they held; they are forgotten."""
        out: dict[str, set[str]] = {}
        for worker, lease in list(self.workers.items()):
            if now - lease.last > self.missed * lease.interval:
                held = {rid for rid, w in self.holder.items() if w == worker}
                out[worker] = held
                del self.workers[worker]
                for rid in held:
                    del self.holder[rid]
        return out

    def forget(self, request_id: str) -> None:
        self.holder.pop(request_id, None)

    def reported(self, request_id: str) -> bool:
        """Whether a live worker listed this request in its latest heartbeat."""
        worker = self.holder.get(request_id)
        lease = self.workers.get(worker) if worker else None
        return lease is not None and request_id in lease.inflight


@dataclass
class Repair:
    usage: Usage | None  # the corrected aggregate, or None when it matches the records
    orphans: list[str]  # reservations no live worker reports, older than the grace period


def reconcile(usage: Usage, records: Mapping[str, object], expected: Usage, leases: LeaseTracker, now: float,
              orphan_after_s: float, ages: Mapping[str, float]) -> Repair:
    """Compare the aggregate with the records, and the records with the workers' reports."""
    fixed = None if expected == usage else expected
    orphans = [rid for rid in records if ages.get(rid, 0.0) > orphan_after_s and not leases.reported(rid)]
    return Repair(fixed, orphans)
