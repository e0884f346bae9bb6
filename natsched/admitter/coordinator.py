"""The budget coordinator: one active per deployment (by lease), it turns the partitions' reports
into the next hierarchical-budget plan (:func:`natsched.admitter.budget.next_plan`) and publishes it.

Where things live (bucket ``budget``, only when admission is partitioned):
- ``plan``: the plan in force, written by compare-and-swap on its revision, so two coordinators
  (one paused past its lease, one that took over) can never both grant the same headroom: the
  loser re-reads and plans again from the winner's plan;
- ``coordinator``: the lease, ``{"holder", "until"}``: taken by create (or by compare-and-swap once
  it expired), renewed by compare-and-swap; a second coordinator stands by until it expires;
- ``report.<partition>.<replica>``: what each partition replica enforces (``applied``, from plan
  ``epoch``), holds (``reserved``) and has waiting (``queued``), refreshed every half second.

Why a plan waits for the reports (the part of the safety argument that is the coordinator's):
``next_plan`` counts a partition's *potential* as ``max(reserved, applied, grant in the current
plan)``, which covers every plan the partition may be applying only if it applies the current
one or the one before it. A partition reads plans in epoch order and never goes back, so that
holds once its freshest report names epoch ``current - 1`` or later. Until every partition's does
(a partition slow to read, or with no live replica), the coordinator publishes nothing: budgets
stay as they are, which is always safe. A replica silent for ``report_ttl_s`` is taken as dead (its
reservations are in its partition's usage, which the live replicas report). With no live replica
at all, a partition keeps its grant and blocks raises until one is back.

Pure parts first (the codecs, :func:`aggregate`, :func:`plan_step`), the thin service after.
Errors: :class:`natsched.admitter.errors.UsageError` for a plan or report that is not one this
package wrote.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Mapping

import orjson

from natsched.admitter.budget import BudgetPlan, PartitionState, next_plan
from natsched.admitter.errors import UsageError
from natsched.admitter.quotas import Quotas
from natsched.bus.connection import Bus
from natsched.bus.errors import ConflictError
from natsched.errors import NatschedError
from natsched.wire import subjects as S

log = logging.getLogger(__name__)


# --- codecs ---------------------------------------------------------------------------------
def _count(d: dict, key: str, what: str) -> int:
    value = d.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UsageError(f"{what}: {key} must be an integer >= 0, got {value!r}")
    return value


def encode_plan(plan: BudgetPlan) -> bytes:
    return orjson.dumps({"epoch": plan.epoch, "total": plan.total,
                         "grants": {str(p): n for p, n in sorted(plan.grants.items())}})


def decode_plan(raw: bytes) -> BudgetPlan:
    """Strict: a plan with a field missing, negative or unknown is refused, never read as zeros."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"budget plan is not JSON: {exc}") from None
    if not isinstance(d, dict) or set(d) != {"epoch", "total", "grants"} or not isinstance(d["grants"], dict):
        raise UsageError(f"budget plan is not one a coordinator wrote: {bytes(raw[:80])!r}")
    grants = {}
    for key in d["grants"]:
        if not key.isdigit():
            raise UsageError(f"budget plan: partition {key!r} is not a number")
        grants[int(key)] = _count(d["grants"], key, "budget plan grant")
    return BudgetPlan(epoch=_count(d, "epoch", "budget plan"), total=_count(d, "total", "budget plan"),
                      grants=grants)


@dataclass(frozen=True)
class Report:
    """One partition replica's report: its state and when it wrote it (wall clock)."""

    state: PartitionState
    at: float

    def encode(self) -> bytes:
        s = self.state
        return orjson.dumps({"applied": s.applied, "epoch": s.epoch, "reserved": s.reserved, "queued": s.queued,
                             "at": self.at})

    @classmethod
    def decode(cls, raw: bytes) -> "Report":
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise UsageError(f"partition report is not JSON: {exc}") from None
        if not isinstance(d, dict) or set(d) != {"applied", "epoch", "reserved", "queued", "at"}:
            raise UsageError(f"partition report is not one an admitter wrote: {bytes(raw[:80])!r}")
        at = d["at"]
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            raise UsageError(f"partition report: at must be a time, got {at!r}")
        state = PartitionState(**{k: _count(d, k, "partition report") for k in ("applied", "epoch", "reserved",
                                                                               "queued")})
        return cls(state, float(at))


# --- pure planning ----------------------------------------------------------------------------
def aggregate(reports: Mapping[tuple[int, str], Report], now: float, ttl_s: float) -> dict[int, PartitionState]:
    """Each partition's state from its live replicas' reports: the most any of them applies or
    holds (they share the partition's usage), the sum of what they have queued, and the oldest
    plan epoch any of them runs (what the wait rule checks)."""
    out: dict[int, PartitionState] = {}
    for (partition, _replica), r in reports.items():
        if now - r.at > ttl_s:
            continue
        s, prev = r.state, out.get(partition)
        if prev is None:
            out[partition] = s
        else:
            out[partition] = PartitionState(applied=max(prev.applied, s.applied), epoch=min(prev.epoch, s.epoch),
                                            reserved=max(prev.reserved, s.reserved), queued=prev.queued + s.queued)
    return out


def plan_step(quotas: Quotas, states: Mapping[int, PartitionState], current: BudgetPlan | None,
              partitions: int) -> tuple[BudgetPlan | None, str]:
    """The plan to publish now, or (None, why not). See the module docstring for the wait rule."""
    if current is not None:
        behind = sorted(p for p in range(partitions)
                        if p not in states or states[p].epoch < current.epoch - 1)
        if behind:
            return None, f"partition(s) {', '.join(map(str, behind))} not yet on plan {current.epoch - 1} or later"
    total = quotas.ceiling()
    plan = next_plan(quotas, total, states, current, partitions)
    if current is not None and dict(plan.grants) == dict(current.grants) and plan.total == current.total:
        return None, "unchanged"
    if current is None and states:  # the plan key was lost: above every epoch a partition runs,
        # or they would ignore it as older than theirs (next_plan counted what they apply)
        plan = replace(plan, epoch=max(plan.epoch, max(s.epoch for s in states.values()) + 1))
    return plan, ""


# --- the service --------------------------------------------------------------------------------
@dataclass
class CoordinatorSettings:
    name: str = "coordinator"
    partitions: int = 2
    interval_s: float = 1.0  # how often the plan is recomputed ("every few seconds" at most)
    lease_s: float = 5.0  # a coordinator silent this long is replaced
    report_ttl_s: float = 30.0  # a partition replica silent this long is taken as dead


class Coordinator:
    """One candidate: it plans while it holds the lease, and stands by otherwise."""

    def __init__(self, bus: Bus, settings: CoordinatorSettings | None = None) -> None:
        self.bus = bus
        self.settings = settings or CoordinatorSettings()
        if self.settings.partitions < 2:
            raise NatschedError("a coordinator needs 2 partitions or more (one partition has no budget to split)")
        self.active = False
        self.lease_until = 0.0  # the lease this candidate wrote last (wall clock)
        self._lease_rev = 0
        self.plans_written = 0
        self.last_plan: BudgetPlan | None = None
        self.waiting = ""  # why the last tick published nothing
        self.quotas: Quotas | None = None  # as last read (a bad entry keeps its value from here)

    async def start(self) -> None:
        self.bus.spawn(self._loop(), "budget-coordinator")
        log.info("coordinator %s standing by for %d partitions", self.settings.name, self.settings.partitions)

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a server away, a lost race: the next tick tries again
                if self.bus.closed:
                    return
                log.warning("coordinator %s: tick deferred: %r", self.settings.name, exc)
            await asyncio.sleep(self.settings.interval_s)

    async def tick(self, now: float | None = None) -> BudgetPlan | None:
        """Renew or take the lease; while held, publish the next plan if one is due."""
        now = time.time() if now is None else now
        if not await self.hold_lease(now):
            return None
        kv = self.bus.kv(S.BUCKET_BUDGET)
        current_raw = await kv.get(S.KEY_PLAN)
        current = decode_plan(current_raw[0]) if current_raw else None
        entries = await self.bus.kv(S.BUCKET_QUOTAS).snapshot()
        # a bad entry keeps its last good value, as in the admitters (which log and count it)
        quotas, _errors = Quotas.from_kv({k: v for k, (v, _r) in entries.items() if k != S.KEY_DYNAMIC_TOTAL},
                                         previous=self.quotas)
        self.quotas = quotas
        states = aggregate(await self.reports(), now, self.settings.report_ttl_s)
        plan, why = plan_step(quotas, states, current, self.settings.partitions)
        if plan is None:
            if why != self.waiting and why != "unchanged":
                log.info("coordinator %s: no new plan: %s", self.settings.name, why)
            self.waiting = why
            return None
        self.waiting = ""
        try:
            if current_raw is None:
                await kv.create(S.KEY_PLAN, encode_plan(plan))
            else:
                await kv.update(S.KEY_PLAN, encode_plan(plan), current_raw[1])
        except ConflictError:  # another coordinator wrote first: plan again from its plan
            log.warning("coordinator %s: plan %d lost to another coordinator's", self.settings.name, plan.epoch)
            return None
        self.plans_written += 1
        self.last_plan = plan
        log.info("budget plan %d: %s (total %d)", plan.epoch,
                 ", ".join(f"p{p}={n}" for p, n in sorted(plan.grants.items())), plan.total)
        return plan

    async def reports(self) -> dict[tuple[int, str], Report]:
        out = {}
        for key, (raw, _rev) in (await self.bus.kv(S.BUCKET_BUDGET).snapshot(S.REPORTS_ALL)).items():
            _, partition, replica = key.split(".", 2)
            try:
                out[(int(partition), replica)] = Report.decode(raw)
            except (UsageError, ValueError) as exc:
                log.error("partition report %s refused: %s", key, exc)
        return out

    async def hold_lease(self, now: float) -> bool:
        """Renew our lease, or take one that expired; False while another holds it."""
        s, kv = self.settings, self.bus.kv(S.BUCKET_BUDGET)
        mine = orjson.dumps({"holder": s.name, "until": now + s.lease_s})
        current = await kv.get(S.KEY_COORDINATOR)
        try:
            if current is None:
                self._lease_rev = await kv.create(S.KEY_COORDINATOR, mine)
            else:
                holder, until = _lease(current[0])
                if holder != s.name and until > now:
                    self._stand_by(holder)
                    return False
                self._lease_rev = await kv.update(S.KEY_COORDINATOR, mine, current[1])
        except ConflictError:  # another candidate took or renewed it at the same moment
            self._stand_by("another candidate")
            return False
        if not self.active:
            log.warning("coordinator %s is now the active budget coordinator", s.name)
        self.active, self.lease_until = True, now + s.lease_s
        return True

    def _stand_by(self, holder: str) -> None:
        if self.active:
            log.warning("coordinator %s lost the lease to %s; standing by", self.settings.name, holder)
        self.active = False

    async def resign(self) -> None:
        """At a clean stop: give the lease up so the standby takes over at once."""
        if not self.active:
            return
        self.active = False
        try:
            await self.bus.kv(S.BUCKET_BUDGET).update(S.KEY_COORDINATOR, orjson.dumps({"holder": "", "until": 0}),
                                                      self._lease_rev)
        except (ConflictError, NatschedError) as exc:
            log.info("coordinator %s: lease not given back (%s); it expires", self.settings.name, exc)


def _lease(raw: bytes) -> tuple[str, float]:
    """(holder, until); a value that is not a lease counts as expired (the next write replaces it)."""
    try:
        d = orjson.loads(raw)
        return str(d["holder"]), float(d["until"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        log.error("coordinator lease value refused: %r", bytes(raw[:80]))
        return "", 0.0
