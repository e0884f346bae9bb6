"""A discrete-event run of one admission policy over a generated overload.

Why not :mod:`natsched.sim.des`: that simulator replays single-tenant traces through the router and the
engine model, and its admission hook can only allow, queue or release — it has no way to report a
queued request rejected later (queue timeouts), no tenants and no degrade. The admission benchmark
needs exactly those, and does not need routing or prefix caches. So the cluster here is the simple
service-time model of :mod:`natsched.sim.admission_workload`: an admitted request holds its runtime tokens
for its hold time, then completes. The policy objects are the shipped ones all the same.

Events: arrivals (from the workload), completions (admission time + hold) and ticks every
``tick_s`` (aging, timeouts; count_fifo's releases). The :class:`Ledger` is the ground truth the
metrics are computed from — it never asks the policy what it holds.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from natsched.admitter.policy import ALLOW, DEGRADE, QUEUE, REJECT
from natsched.sim.admission_policies import Picked, SimAdmissionPolicy
from natsched.sim.admission_workload import AdmissionWorkload, SimRequest
from natsched.sim.errors import SimError

_ARRIVE, _FINISH, _TICK = 0, 1, 2
DRAIN_SLACK_S = 600.0  # after the last arrival: queue timeouts and holds end well before this


@dataclass
class Ledger:
    """What happened, integrated over the arrival window ``[0, duration)``."""

    total: int
    duration: float
    tenants: list[str]
    used: int = 0
    long_used: int = 0
    tenant_used: Counter = field(default_factory=Counter)
    queued_tenant: Counter = field(default_factory=Counter)
    queued_kind: Counter = field(default_factory=Counter)  # True = long
    now: float = 0.0
    # integrals (token-seconds, or seconds for *_time)
    used_int: float = 0.0
    tenant_int: Counter = field(default_factory=Counter)
    back_time: Counter = field(default_factory=Counter)  # per tenant: seconds with queued requests
    back_used: Counter = field(default_factory=Counter)  # per tenant: usage integral while backlogged
    back_tenant: Counter = field(default_factory=Counter)  # per tenant: its usage while backlogged
    both_time: float = 0.0  # seconds with long and short requests queued
    both_used: float = 0.0
    both_long: float = 0.0
    # per admission
    both_admit_tokens: int = 0
    both_admit_long: int = 0
    max_overadmit: int = 0
    offered: Counter = field(default_factory=Counter)  # True/False = long/short
    admitted: Counter = field(default_factory=Counter)
    tenant_offered: Counter = field(default_factory=Counter)
    tenant_admitted: Counter = field(default_factory=Counter)
    tenant_offered_load: Counter = field(default_factory=Counter)  # Σ cost × hold (token-seconds)
    tenant_served_load: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)  # "reject:<reason>", "degrade", ...
    waits: list[float] = field(default_factory=list)
    queued_at: dict[str, float] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)

    def advance(self, t: float) -> None:
        end = min(t, self.duration)
        dt = end - self.now
        if dt > 0:
            self.used_int += self.used * dt
            for name, u in self.tenant_used.items():
                self.tenant_int[name] += u * dt
            for name, n in self.queued_tenant.items():
                if n:
                    self.back_time[name] += dt
                    self.back_used[name] += self.used * dt
                    self.back_tenant[name] += self.tenant_used[name] * dt
            if self.both_backlogged():
                self.both_time += dt
                self.both_used += self.used * dt
                self.both_long += self.long_used * dt
        self.now = max(self.now, end)

    def both_backlogged(self) -> bool:
        return self.queued_kind[True] > 0 and self.queued_kind[False] > 0

    def arrive(self, req: SimRequest) -> None:
        self.offered[req.long] += 1
        self.tenant_offered[req.tenant] += 1
        self.tenant_offered_load[req.tenant] += req.cost * req.hold_s

    def admit(self, req: SimRequest, now: float, both: bool) -> None:
        self._unqueue(req)
        self.used += req.cost
        self.long_used += req.cost if req.long else 0
        self.tenant_used[req.tenant] += req.cost
        self.max_overadmit = max(self.max_overadmit, self.used - self.total)
        self.admitted[req.long] += 1
        self.tenant_admitted[req.tenant] += 1
        self.tenant_served_load[req.tenant] += req.cost * req.hold_s
        self.waits.append(now - req.arrival)
        if both:
            self.both_admit_tokens += req.cost
            self.both_admit_long += req.cost if req.long else 0

    def enqueue(self, req: SimRequest, now: float) -> None:
        self.queued_at[req.id] = now
        self.queued_tenant[req.tenant] += 1
        self.queued_kind[req.long] += 1

    def _unqueue(self, req: SimRequest) -> None:
        if self.queued_at.pop(req.id, None) is not None:
            self.queued_tenant[req.tenant] -= 1
            self.queued_kind[req.long] -= 1

    def drop(self, req: SimRequest, outcome: str) -> None:
        self._unqueue(req)
        self.outcomes[outcome] += 1

    def finish(self, req: SimRequest) -> None:
        self.used -= req.cost
        self.long_used -= req.cost if req.long else 0
        self.tenant_used[req.tenant] -= req.cost


def run_policy(policy: SimAdmissionPolicy, w: AdmissionWorkload, requests: list[SimRequest]) -> Ledger:
    """Replay ``requests`` through ``policy``; every request ends admitted-and-finished or dropped."""
    ledger = Ledger(w.total_runtime_tokens, w.duration_s, [t.name for t in w.tenants])
    heap: list = [(r.arrival, 0, r.index, _ARRIVE, r) for r in requests]
    heapq.heapify(heap)
    seq = len(requests)
    heapq.heappush(heap, (w.tick_s, 1, seq, _TICK, None))
    pending = len(requests)  # arrivals + completions still to come
    limit = w.duration_s + w.queue_timeout_s + DRAIN_SLACK_S
    while heap:
        now, _, _, kind, req = heapq.heappop(heap)
        if now > limit:
            raise SimError(f"policy {policy.name} still holds {policy.queued()} request(s) at t={now:.0f}s")
        ledger.advance(now)
        if kind == _ARRIVE:
            pending -= 1
            ledger.arrive(req)
            both = ledger.both_backlogged()
            decision, reason = policy.arrive(req, now)
            ledger.latencies_ms.append(policy.latency_ms)
            seq += 1
            pending += _handle(ledger, heap, seq, req, decision, reason, now, both)
        elif kind == _FINISH:
            pending -= 1
            ledger.finish(req)
            policy.finish(req, now)
            if policy.dequeue_on_finish:
                pending, seq = _dequeue(policy, ledger, heap, seq, pending, now)
        else:
            pending, seq = _dequeue(policy, ledger, heap, seq, pending, now)
            if pending or policy.queued():
                seq += 1
                heapq.heappush(heap, (now + w.tick_s, 1, seq, _TICK, None))
    return ledger


def _dequeue(policy: SimAdmissionPolicy, ledger: Ledger, heap: list, seq: int, pending: int,
             now: float) -> tuple[int, int]:
    if not policy.queued():
        return pending, seq
    both = ledger.both_backlogged()
    picks: list[Picked] = policy.dequeue(now)
    ledger.latencies_ms.append(policy.latency_ms)
    for req, decision, reason in picks:
        seq += 1
        pending += _handle(ledger, heap, seq, req, decision, reason, now, both)
    return pending, seq


def _handle(ledger: Ledger, heap: list, seq: int, req: SimRequest, decision: str, reason: str | None,
            now: float, both: bool) -> int:
    """Record one decision; returns 1 when it scheduled a completion."""
    if decision == ALLOW:
        ledger.admit(req, now, both)
        heapq.heappush(heap, (now + req.hold_s, 0, seq, _FINISH, req))
        return 1
    if decision == QUEUE:
        ledger.enqueue(req, now)
    elif decision in (REJECT, DEGRADE):
        ledger.drop(req, f"{decision}:{reason}")
    else:
        raise SimError(f"unknown decision {decision!r}")
    return 0
