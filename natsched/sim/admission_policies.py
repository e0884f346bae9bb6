"""The two admission policies the benchmark compares, behind one small interface.

- :class:`NatschedAdmission` drives the shipped :class:`natsched.admitter.policy.AdmitterCore` exactly as
  ``admitter/service.py`` does: ``evaluate`` + ``apply`` per arrival, ``plan_dequeue`` +
  ``commit_dequeue`` whenever capacity may have changed (after every completion, and every tick
  for aging and timeouts), ``release`` with a :class:`natsched.wire.schema.Completion` per finished request.
- :class:`CountFifo`: the count-based FIFO the design brief warns about. Each time it runs it
  walks its queue in arrival order and releases up to ``per_tick`` requests, each one that fits in
  the free token budget (so it never over-admits) — a fixed *number* per tick, whatever their
  length. It holds no room for a request that does not fit, so short requests behind a long one
  keep taking the tokens it waits for. Same queue limit and queue timeout as natsched; no tenant
  awareness. It runs at the same moments as natsched (every tick and after every completion, as
  the service's dequeue loop wakes on releases), so the two differ in policy only; with
  ``on_release=False`` it runs on ticks only.

A policy answers ``(decision, reason)`` per arrival and a list of ``(request, decision, reason)``
per dequeue; decisions are :mod:`natsched.admitter.policy`'s strings. Each call leaves the wall time of the
policy's own work in ``latency_ms`` (for natsched: evaluate + apply, or plan + commit — building
the wire request and translating results are left out).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Protocol

from natsched.admitter.policy import ALLOW, QUEUE, REJECT, AdmissionSettings, AdmitterCore
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.wire import subjects as S
from natsched.wire.schema import Completion, CompletionStatus, Request, RequestId, TenantId
from natsched.sim.admission_workload import AdmissionWorkload, SimRequest

Outcome = tuple[str, str | None]
Picked = tuple[SimRequest, str, str | None]


class SimAdmissionPolicy(Protocol):
    name: str
    dequeue_on_finish: bool  # also dequeue right after each completion (not only on ticks)
    latency_ms: float  # wall time of the policy's work in the last arrive() / dequeue()

    def arrive(self, req: SimRequest, now: float) -> Outcome: ...

    def dequeue(self, now: float) -> list[Picked]: ...

    def finish(self, req: SimRequest, now: float) -> None: ...

    def queued(self) -> int: ...


def make_request(req: SimRequest) -> Request:
    """The wire request a producer would send: a text prompt of ``prompt_tokens`` tokens (4 chars
    per token, the admitter's estimate) and ``max_tokens`` = the output it will produce."""
    return Request(id=RequestId(req.id), tenant=TenantId(req.tenant), cls=S.ONLINE,
                   prompt="x" * (4 * req.prompt_tokens), max_tokens=req.output_tokens)


class NatschedAdmission:
    name = "natsched"
    dequeue_on_finish = True  # the service wakes its dequeue loop on every release

    def __init__(self, w: AdmissionWorkload) -> None:
        settings = AdmissionSettings(
            default_total=w.total_runtime_tokens, long_threshold_tokens=w.long_threshold_tokens,
            reserve_long_share=w.reserve_long_share, aging_s=w.aging_s, queue_timeout_s=w.queue_timeout_s,
            max_prompt_tokens=max(131_072, w.long_max_cost), max_output_tokens=max(32_768, w.output_tokens[1]),
        )
        quotas = Quotas(total=w.total_runtime_tokens,
                        tenants={t.name: TenantQuota(t.floor, t.weight, t.cap) for t in w.tenants})
        self.core = AdmitterCore(settings, quotas)
        self._requests: dict[str, tuple[SimRequest, Request]] = {}
        self.latency_ms = 0.0

    def arrive(self, req: SimRequest, now: float) -> Outcome:
        request = make_request(req)
        started = time.perf_counter()
        decision = self.core.evaluate(request, now)
        self.core.apply(request, decision, now)
        self.latency_ms = (time.perf_counter() - started) * 1000
        if decision.decision == QUEUE:
            self._requests[req.id] = (req, request)
        return decision.decision, decision.reason

    def dequeue(self, now: float) -> list[Picked]:
        started = time.perf_counter()
        picks = self.core.plan_dequeue(now)
        self.core.commit_dequeue(picks, now)
        self.latency_ms = (time.perf_counter() - started) * 1000
        return [(self._requests.pop(r.id)[0], d.decision, d.reason) for r, d in picks]

    def finish(self, req: SimRequest, now: float) -> None:
        self.core.release(Completion(request_id=RequestId(req.id), tenant=TenantId(req.tenant),
                                     status=CompletionStatus.OK, runtime_tokens=req.cost, cls=S.ONLINE,
                                     prompt_tokens=req.prompt_tokens, output_tokens=req.output_tokens, ts=now), now)

    def queued(self) -> int:
        return self.core.queued()


class CountFifo:
    name = "count_fifo"
    def __init__(self, w: AdmissionWorkload, per_tick: int, queue_limit: int = 1000, on_release: bool = True) -> None:
        self.dequeue_on_finish = on_release
        self.total = w.total_runtime_tokens
        self.per_tick = per_tick
        self.queue_limit = queue_limit
        self.timeout = w.queue_timeout_s
        self.used = 0
        self._queue: OrderedDict[str, tuple[SimRequest, float]] = OrderedDict()
        self.latency_ms = 0.0

    def arrive(self, req: SimRequest, now: float) -> Outcome:
        started = time.perf_counter()
        try:
            return self._arrive(req, now)
        finally:
            self.latency_ms = (time.perf_counter() - started) * 1000

    def _arrive(self, req: SimRequest, now: float) -> Outcome:
        if req.cost > self.total:
            return REJECT, "too_large"
        if not self._queue and self.used + req.cost <= self.total:
            self.used += req.cost
            return ALLOW, None
        if len(self._queue) >= self.queue_limit:
            return REJECT, "queue_full"
        self._queue[req.id] = (req, now)
        return QUEUE, None

    def dequeue(self, now: float) -> list[Picked]:
        started = time.perf_counter()
        try:
            return self._dequeue(now)
        finally:
            self.latency_ms = (time.perf_counter() - started) * 1000

    def _dequeue(self, now: float) -> list[Picked]:
        out: list[Picked] = []
        while self._queue:
            req, since = next(iter(self._queue.values()))
            if now - since <= self.timeout:
                break
            del self._queue[req.id]
            out.append((req, REJECT, "queue_timeout"))
        released = 0
        for rid, (req, _) in list(self._queue.items()):
            if released >= self.per_tick:
                break
            if self.used + req.cost <= self.total:
                del self._queue[rid]
                self.used += req.cost
                released += 1
                out.append((req, ALLOW, None))
        return out

    def finish(self, req: SimRequest, now: float) -> None:
        self.used -= req.cost

    def queued(self) -> int:
        return len(self._queue)
