"""``natsched bench priority``: online waits during a burst over a batch backlog, with and
without lending (:mod:`natsched.admitter.classes`), on the shipped :class:`AdmitterCore`.

The cluster is the admission benchmark's service-time model (:mod:`natsched.sim.admission_sim`):
an admitted request holds its runtime tokens for a hold time, then completes. Two tenants: ``b``
keeps a batch backlog (it offers more than its class limit can run, all the time) and ``a`` sends
online work at a base rate with a burst of ``burst`` × online's own capacity in the middle. The
contenders differ only in quotas and settings:

- ``lend``: class limits, online borrows batch's room (``lend_share``);
- ``no_lend``: the same class limits as hard caps (``lend_to = []``);
- ``no_limits``: no class limits at all (the total only; class before tenant past the watermark).

Reported per contender: the admission wait of online requests arriving during the burst (p50,
p99; a request rejected counts as waiting the whole queue timeout), online rejections, the batch
tokens admitted during and after the burst, the largest loan and how long after the burst the
loan was repaid. Virtual time, seeded: the same arguments give the same numbers.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field, replace

from natsched.admitter.policy import ALLOW, QUEUE, REJECT, AdmissionSettings, AdmitterCore
from natsched.admitter.quotas import Quotas
from natsched.stats import percentile
from natsched.wire import subjects as S
from natsched.wire.schema import Completion, CompletionStatus, Request, RequestId, TenantId

CONTENDERS = ("lend", "no_lend", "no_limits")


@dataclass(frozen=True)
class PrioritySettings:
    total: int = 100_000
    online_limit: int = 40_000
    batch_limit: int = 60_000
    online_cost: int = 1_000  # runtime tokens per online request
    online_hold_s: tuple[float, float] = (1.0, 3.0)
    batch_cost: int = 4_000
    batch_hold_s: tuple[float, float] = (5.0, 15.0)
    base_load: float = 0.5  # online's base demand, a share of its own limit's capacity
    burst: float = 2.0  # online's demand during the burst, a share of its own limit's capacity
    batch_load: float = 1.5  # batch's demand, a share of its limit's capacity (> 1: a backlog)
    burst_start_s: float = 60.0
    burst_s: float = 30.0
    duration_s: float = 150.0
    lend_share: float = 0.5
    seed: int = 1

    def rate(self, cls: str, load: float) -> float:
        """Requests/s that keep ``load`` of a class's limit busy."""
        if cls == S.ONLINE:
            return load * self.online_limit / self.online_cost / (sum(self.online_hold_s) / 2)
        return load * self.batch_limit / self.batch_cost / (sum(self.batch_hold_s) / 2)


@dataclass
class PriorityRow:
    contender: str
    burst: float
    online_wait_p50: float
    online_wait_p99: float
    online_rejected: int
    online_offered: int
    batch_tokens_burst: int  # batch runtime tokens admitted while the burst lasted
    batch_tokens_after: int  # ... in the same length of time after it
    max_loan: int
    repaid_after_s: float | None  # after the burst's end, until no loan is left (None: never lent)
    waits: list[float] = field(default_factory=list, repr=False)


def _request(i: int, tenant: str, cls: str, cost: int) -> Request:
    out = 2 if cost % 2 == 0 else 1
    return Request(id=RequestId(f"{cls[0]}{i}"), tenant=TenantId(tenant), cls=cls,
                   prompt_token_ids=[0] * ((cost - out) // 2), max_tokens=out)


def _arrivals(s: PrioritySettings) -> list[tuple[float, Request]]:
    rng = random.Random(s.seed)
    out, i = [], 0
    for cls, tenant, cost in ((S.BATCH, "b", s.batch_cost), (S.ONLINE, "a", s.online_cost)):
        t = 0.0
        while True:
            burst = cls == S.ONLINE and s.burst_start_s <= t < s.burst_start_s + s.burst_s
            load = s.batch_load if cls == S.BATCH else (s.burst if burst else s.base_load)
            t += rng.expovariate(s.rate(cls, load))
            if t >= s.duration_s:
                break
            out.append((t, _request(i, tenant, cls, cost)))
            i += 1
    return sorted(out, key=lambda x: x[0])


def _core(contender: str, s: PrioritySettings) -> AdmitterCore:
    limits = {} if contender == "no_limits" else {S.ONLINE: s.online_limit, S.BATCH: s.batch_limit}
    # standing-queue shedding off: this measures what lending does to waits, and counts a refusal
    # as the whole queue timeout, so a rule that refuses early would blur the comparison
    settings = AdmissionSettings(default_total=s.total, degrade_classes=(), lend_share=s.lend_share,
                                 lend_to=() if contender == "no_lend" else (S.ONLINE,), standing_shed=False)
    return AdmitterCore(settings, Quotas(total=s.total, class_limits=limits))


def run_priority(contender: str, s: PrioritySettings) -> PriorityRow:
    """One contender over the seeded arrivals (virtual time)."""
    core = _core(contender, s)
    rng = random.Random(s.seed + 1)
    events: list[tuple[float, int, int, object]] = []  # (time, kind 0 finish / 1 arrive / 2 tick, seq, payload)
    seq = 0
    for t, req in _arrivals(s):
        events.append((t, 1, seq, req))
        seq += 1
    t = 0.0
    while t < s.duration_s + 120:
        events.append((t, 2, seq, None))
        seq += 1
        t += 0.25
    heapq.heapify(events)
    arrived: dict[str, float] = {}
    end = s.burst_start_s + s.burst_s
    row = PriorityRow(contender, s.burst, 0.0, 0.0, 0, 0, 0, 0, 0, None)

    def admitted(req: Request, dec, now: float) -> None:
        nonlocal seq
        hold = rng.uniform(*(s.online_hold_s if req.cls == S.ONLINE else s.batch_hold_s))
        heapq.heappush(events, (now + hold, 0, seq, (req, dec.runtime_tokens)))
        seq += 1
        if req.cls == S.ONLINE and s.burst_start_s <= arrived[req.id] < end:
            row.waits.append(now - arrived[req.id])
        if req.cls == S.BATCH and s.burst_start_s <= now < end:
            row.batch_tokens_burst += dec.runtime_tokens
        if req.cls == S.BATCH and end <= now < end + s.burst_s:
            row.batch_tokens_after += dec.runtime_tokens

    def rejected(req: Request) -> None:
        if req.cls == S.ONLINE and s.burst_start_s <= arrived[req.id] < end:
            row.online_rejected += 1
            row.waits.append(core.settings.queue_timeout_s)

    while events:
        now, kind, _, payload = heapq.heappop(events)
        if kind == 1:
            req = payload
            arrived[req.id] = now
            row.online_offered += req.cls == S.ONLINE and s.burst_start_s <= now < end
            dec = core.evaluate(req, now)
            core.apply(req, dec, now)
            if dec.decision == ALLOW:
                admitted(req, dec, now)
            elif dec.decision != QUEUE:
                rejected(req)
            continue
        if kind == 0:
            req, tokens = payload
            core.release(Completion(request_id=req.id, tenant=req.tenant, status=CompletionStatus.OK,
                                    runtime_tokens=tokens, cls=req.cls, output_tokens=1, ts=now), now)
        picks = core.plan_dequeue(now)
        core.commit_dequeue(picks, now)
        for req, dec in picks:
            if dec.decision == ALLOW:
                admitted(req, dec, now)
            elif dec.decision == REJECT:
                rejected(req)
        loan = sum(core.usage.loans.values())
        row.max_loan = max(row.max_loan, loan)
        if now >= end and loan == 0 and row.repaid_after_s is None and row.max_loan:
            row.repaid_after_s = now - end
    row.online_wait_p50 = percentile(row.waits, 50) if row.waits else 0.0
    row.online_wait_p99 = percentile(row.waits, 99) if row.waits else 0.0
    return row


def run_priority_benchmark(s: PrioritySettings, bursts: tuple[float, ...]) -> list[PriorityRow]:
    """Every contender at every burst size, on the same arrivals per burst size (paired)."""
    return [run_priority(c, replace(s, burst=b)) for b in bursts for c in CONTENDERS]


def priority_table(rows: list[PriorityRow]) -> str:
    head = (f"{'burst':>6} {'contender':<10} {'online wait p50':>16} {'p99':>8} {'rejected':>12} "
            f"{'batch tok burst':>16} {'batch tok after':>16} {'max loan':>9} {'repaid after':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        repaid = "-" if r.repaid_after_s is None else f"{r.repaid_after_s:.1f}s"
        lines.append(f"{r.burst:>6g} {r.contender:<10} {r.online_wait_p50:>15.3f}s {r.online_wait_p99:>7.2f}s "
                     f"{f'{r.online_rejected}/{r.online_offered}':>12} {r.batch_tokens_burst:>16} "
                     f"{r.batch_tokens_after:>16} {r.max_loan:>9} {repaid:>13}")
    return "\n".join(lines)
