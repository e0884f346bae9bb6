"""One partition's side of partitioned admission (issue 27): a mixin of the admitter service.

With ``--partitions P`` (P > 1) REQUESTS stores ``req.<class>.<tenant>`` as
``reqp.<k>.<class>.<tenant>``, ``k`` = nats-server's ``partition(P, tenant)``
(:func:`natsched.admitter.budget.partition_of`). An admitter replica of partition ``k``:

- consumes ``reqp.<k>.>`` with its own durable consumer (``admitter-p<k>``) and keeps its usage
  key and reservation records in its own bucket (``inflight-p<k>``): partitions never contend on
  one compare-and-swap key, nor on one stream;
- releases, reclaims, rescues and reconciles only its own tenants' reservations (a completion
  or a stranded assignment names its tenant, hence its partition; the others' records are not
  in its bucket);
- enforces the budget of the plan in force (``budget/plan``, :mod:`natsched.admitter.coordinator`)
  as its total (:func:`natsched.admitter.budget.partition_quotas`), and reports what it applies,
  holds and has waiting; before the first plan its budget is 0 (nothing is admitted);
- holds a request that fits the cluster but not its budget now (``too_large`` against the
  budget) un-acked, as demand, and decides it again when a larger budget arrives, instead of
  refusing it for good.

Credit blocks are off in a partition (they exist to spread one key's commits; partitions do
that) and the total follows the configured ceiling (the coordinator plans over it), not the
workers' measured capacity. With P = 1 none of this runs: the service is exactly as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from natsched.admitter.budget import BudgetPlan, PartitionState, partition_of, partition_quotas
from natsched.admitter.coordinator import Coordinator, CoordinatorSettings, Report, decode_plan
from natsched.admitter.errors import QuotaError, UsageError
from natsched.admitter.move import change_partitions
from natsched.admitter.planner import never_fits
from natsched.admitter.policy import REJECT
from natsched.admitter.quotas import Quotas
from natsched.bus.errors import ProvisionError
from natsched.errors import NatschedError
from natsched.wire import subjects as S

if TYPE_CHECKING:
    from natsched.admitter.policy import AdmissionDecision, AdmitterCore
    from natsched.admitter.shared import SharedState
    from natsched.bus.connection import Bus, Delivery
    from natsched.wire.schema import Request

log = logging.getLogger(__name__)

REPORT_S = 0.5  # how often a partition replica reports (and a plan change is reported at once)
FIRST_PLAN_WAIT_S = 10.0  # at start: how long to wait for a plan before consuming anyway (budget 0)
#: the core's refusals that, in a partition, may only mean "not within this budget yet"
BUDGET_BOUND = frozenset({"too_large", "model_limit"})


class PartitionMember:
    """The attributes below are the service's (``AdmitterService.__init__``)."""

    bus: Bus
    settings: Any  # AdmitterServiceSettings: partition, partitions, coordinate
    core: AdmitterCore
    shared: SharedState
    total: int
    _lock: asyncio.Lock
    _wake: asyncio.Event
    _on_requests: Any  # the service's request handler: held requests are decided again through it

    def init_partition(self) -> None:
        self.partitioned = self.settings.partitions > 1
        self.budget_plan: BudgetPlan | None = None
        self.budget = 0  # the runtime tokens this partition may hold (its grant in the plan)
        self.cluster_quotas: Quotas = self.core.quotas  # the quotas bucket's, before the split
        self.budget_held: dict[str, tuple[Delivery, Request, int]] = {}  # id -> waiting for budget
        self.plan_applied = asyncio.Event()
        self.coordinator: Coordinator | None = None
        self.reporting = True  # False once stopping: no report written after it is removed

    def owns(self, tenant: str) -> bool:
        s = self.settings
        return not self.partitioned or partition_of(tenant, s.partitions) == s.partition

    def owns_completion(self, subject: str) -> bool:
        """``done.<tenant>.<worker>``: judged on the subject, before any decoding."""
        parts = subject.split(".")
        return not self.partitioned or (len(parts) == 3 and self.owns(parts[1]))

    @staticmethod
    def request_subject(subject: str) -> str:
        """The subject the producer published on (what the core checks the body against)."""
        parsed = S.parse_partitioned_subject(subject)
        return parsed[1] if parsed is not None else subject

    def core_quotas(self, quotas: Quotas) -> Quotas:
        """What the core runs with: the bucket's quotas, or this partition's share of them."""
        self.cluster_quotas = quotas
        if not self.partitioned:
            return quotas
        s = self.settings
        return partition_quotas(quotas, self.budget, quotas.ceiling(), s.partition, s.partitions)

    async def provision_partition(self) -> None:
        """After provisioning: REQUESTS partitioned as this replica expects, the buckets there."""
        if not self.partitioned:
            return
        s = self.settings
        if not 0 <= s.partition < s.partitions:
            raise ProvisionError(f"partition {s.partition} is not one of 0..{s.partitions - 1}")
        if await change_partitions(self.bus, s.partitions):  # (refused while the old P holds work)
            log.warning("REQUESTS now stores requests in %d partitions (requests stored before keep their subject)",
                        s.partitions)

    async def start_partition(self) -> None:
        """Before consuming: the coordinator candidate (if this replica hosts one), the plan
        watch, and (bounded) the first plan applied."""
        if not self.partitioned:
            return
        s = self.settings
        if s.coordinate:
            self.coordinator = Coordinator(self.bus, CoordinatorSettings(name=s.name, partitions=s.partitions))
            await self.coordinator.start()
        self.bus.spawn(self._watch_plans(), "budget-plan-watch")
        self.bus.spawn(self._report_loop(), "budget-report")
        try:
            await asyncio.wait_for(self.plan_applied.wait(), FIRST_PLAN_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("partition %d: no budget plan after %.0fs (is a coordinator running?): admitting nothing "
                        "until one arrives", s.partition, FIRST_PLAN_WAIT_S)

    async def stop_partition(self) -> None:
        """A clean stop: the coordinator lease given back, and this replica's report removed (a
        report left behind would hold raises back until it ages out)."""
        if not self.partitioned:
            return
        self.reporting = False
        if self.coordinator is not None:
            await self.coordinator.resign()
        try:
            await self.bus.kv(S.BUCKET_BUDGET).delete(S.partition_report_key(self.settings.partition,
                                                                              self.settings.name))
        except NatschedError as exc:
            log.info("partition %d: report not removed at stop (%s): it ages out", self.settings.partition, exc)

    # --- plans ---------------------------------------------------------------------------
    async def _watch_plans(self) -> None:
        async for key, value, _rev in self.bus.kv(S.BUCKET_BUDGET).watch(S.KEY_PLAN):
            if value is None:
                continue
            try:
                plan = decode_plan(value)
            except UsageError as exc:  # the last good plan stays in force
                log.error("budget plan refused, the one in force kept: %s", exc)
                continue
            try:
                await self.apply_plan(plan)
            except NatschedError as exc:  # applied; its report waits for the next tick
                log.warning("partition %d: plan %d applied, report deferred: %s", self.settings.partition,
                            plan.epoch, exc)

    async def apply_plan(self, plan: BudgetPlan) -> bool:
        """Enforce ``plan`` (a newer one than in force) and report it. Under the service lock: no
        commit decided on the old budget lands after the report that says the new one applies."""
        if self.budget_plan is not None and plan.epoch <= self.budget_plan.epoch:
            return False
        k = self.settings.partition
        async with self._lock:
            old = self.budget
            self.budget_plan, self.budget = plan, plan.grant(k)
            try:
                self.core.set_quotas(self.core_quotas(self.cluster_quotas))
            except QuotaError as exc:  # partition_quotas keeps floors <= 1: not expected
                log.error("partition %d: plan %d not applicable to the quotas: %s", k, plan.epoch, exc)
            self.total = self.core.total
        log.info("partition %d applies budget plan %d: %d -> %d runtime tokens", k, plan.epoch, old, self.budget)
        self.plan_applied.set()
        self._wake.set()
        if self.budget > old and self.budget_held:  # (before the report, which may fail: a retry must not)
            self.bus.spawn(self._retry_held(), "budget-retry")
        await self.report()
        return True

    def state(self) -> PartitionState:
        queued = sum(e.cost for e in self.core.queue.oldest()) + sum(c for _, _, c in self.budget_held.values())
        plan = self.budget_plan
        return PartitionState(applied=self.budget, epoch=plan.epoch if plan else 0,
                              reserved=self.shared.usage.used, queued=queued)

    async def report(self) -> None:
        if not self.reporting:
            return
        key = S.partition_report_key(self.settings.partition, self.settings.name)
        await self.bus.kv(S.BUCKET_BUDGET).put(key, Report(self.state(), time.time()).encode())

    async def _report_loop(self) -> None:
        keepalive_at = time.monotonic()
        while True:
            await asyncio.sleep(REPORT_S)
            try:
                if any(cost <= self.budget for _, _, cost in self.budget_held.values()):
                    await self._retry_held()  # (a safety net: a raise retries them at once)
                await self.report()
                if time.monotonic() - keepalive_at >= self.settings.keepalive_s:
                    keepalive_at = time.monotonic()
                    await asyncio.gather(*(d.in_progress() for d, _, _ in list(self.budget_held.values())))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next tick reports again: this loop must not stop for good
                if self.bus.closed:
                    return
                log.warning("partition %d: report deferred: %r", self.settings.partition, exc)

    # --- requests that fit the cluster but not this budget ---------------------------------
    def hold_for_budget(self, items: list, decisions: list[AdmissionDecision]) -> tuple[list, list]:
        """Take out of a decided batch the refusals that only the budget caused: they are held
        (un-acked, kept alive, counted as demand) and decided again under a larger budget."""
        if not self.partitioned:
            return items, decisions
        kept_items, kept = [], []
        q = self.cluster_quotas
        for (d, request), dec in zip(items, decisions):
            if (dec.decision == REJECT and dec.reason in BUDGET_BOUND
                    and never_fits(q, q.ceiling(), request.tenant, request.model, dec.runtime_tokens) is None):
                if request.id not in self.budget_held:
                    log.info("request %s waits for a larger partition budget (%d runtime tokens, budget %d)",
                             request.id, dec.runtime_tokens, self.budget)
                self.budget_held[request.id] = (d, request, dec.runtime_tokens)
                continue
            self.budget_held.pop(request.id, None)
            kept_items.append((d, request))
            kept.append(dec)
        return kept_items, kept

    async def _retry_held(self) -> None:
        held, self.budget_held = self.budget_held, {}
        await self._on_requests([d for d, _, _ in held.values()])
