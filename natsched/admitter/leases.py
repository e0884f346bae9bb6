"""Leases and reconciliation: pure bookkeeping of which worker holds which reservation.

Workers list their in-flight request ids in every heartbeat. A worker silent for
``missed`` heartbeat periods has lost its leases: its reservations are reclaimed. Only silence
this process could have heard counts: after a pause of its own (a stalled event loop, a
starved or frozen machine, a long GC), the heartbeats sent meanwhile are still unread in its
socket, and judging by them would "rescue" — run twice — the work of live workers. Nor does
the time its own connection was down (a nats-server restarting): heartbeats are core NATS
messages, those sent meanwhile are gone for everyone, and the workers, alive all along, are
reconnecting too. Judged by that silence, every in-flight request of every worker was rescued
after a server restart and ran twice (issue 26: two ``ok`` completions, one of them stale, and
a request whose first run had finished meanwhile run again). The
reconciliation compares the shared aggregate with the reservation records (and the records
with what workers report) and says what to repair; the service performs the repair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from natsched.admitter.usage import Usage


@dataclass
class _Lease:
    last: float
    interval: float
    inflight: set[str] = field(default_factory=set)


class LeaseTracker:
    """Leases by worker. ``expired`` is meant to be called every fraction of a second; a gap of
    more than ``pause_s`` between two calls is this process's own pause, and a call made while
    this process is not connected (``listening=False``) judges nothing: every lease is then
    judged from the end of the pause or of the outage (``listening_since``)."""

    def __init__(self, missed: int = 3, pause_s: float = 0.5) -> None:
        self.missed = missed
        self.pause_s = pause_s
        self.workers: dict[str, _Lease] = {}
        self.holder: dict[str, str] = {}  # request id -> worker that last reported it
        self.listening_since = float("-inf")
        self.paused_s = 0.0  # the own pause the latest check found (0 when none), for the log
        self._last_check: float | None = None
        self.deaf = False  # the latest check found this process disconnected

    def on_heartbeat(self, worker: str, now: float, interval: float, inflight: list[str]) -> None:
        lease = self.workers.setdefault(worker, _Lease(now, interval))
        lease.last, lease.interval = now, max(0.05, interval)
        lease.inflight = set(inflight)
        for rid in inflight:
            self.holder[rid] = worker

    def expired(self, now: float, listening: bool = True) -> dict[str, set[str]]:
        """Workers past their lease, with the request ids they held; they are forgotten.

        ``listening``: whether this process's connection is up now. While it is not, nothing
        expires; once it is back, the silence counts from then on."""
        self._note_pause(now)
        if not listening:
            self.deaf = True
            return {}
        if self.deaf:
            self.deaf = False
            self.listening_since = now
        out: dict[str, set[str]] = {}
        for worker, lease in list(self.workers.items()):
            if now - max(lease.last, self.listening_since) > self.missed * lease.interval:
                held = {rid for rid, w in self.holder.items() if w == worker}
                out[worker] = held
                del self.workers[worker]
                for rid in held:
                    del self.holder[rid]
        return out

    def _note_pause(self, now: float) -> None:
        gap = 0.0 if self._last_check is None else now - self._last_check
        self.paused_s = gap if gap > self.pause_s else 0.0
        if self.paused_s:
            self.listening_since = now
        self._last_check = now

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
