"""What is in flight, as every status reader sees it (``natsched status``, ``quota show``, the
gateway's ``/status``), whatever the partitioning.

Unpartitioned, the admitters keep one usage key, ``inflight/usage``. With partitioned admission
(:mod:`natsched.admitter.partition`) each partition keeps its own in its own bucket
(``inflight-p<k>/usage``) and ``inflight`` holds nothing: a reader of the one key would show an
idle cluster. So readers ask REQUESTS how many partitions it stores requests in (its subject
transform: the one truth of P), read every partition's key, and add them (exact: a tenant lives
in one partition), with each partition's own figures and its budget in the plan in force
(``budget/plan``) beside the sum, so an operator sees which partition is full.

:func:`decode_inflight` is pure (raw values in, the view out); :func:`read_inflight` does the reads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from natsched.admitter.coordinator import decode_plan
from natsched.admitter.errors import UsageError
from natsched.admitter.usage import Usage, sum_usage
from natsched.wire import subjects as S

if TYPE_CHECKING:
    from natsched.bus.connection import Bus


@dataclass(frozen=True)
class PartitionUsage:
    """One partition's figures: runtime tokens held, and its grant in the plan in force."""

    partition: int
    used: int
    budget: int | None  # None: no plan yet (a partition admits nothing before its first plan)


@dataclass
class Inflight:
    usage: Usage  # the cluster's: the one key, or the partitions' keys added
    partitions: list[PartitionUsage] = field(default_factory=list)  # empty when unpartitioned
    plan_epoch: int | None = None
    warnings: list[str] = field(default_factory=list)
    corrupt: bool = False  # a usage key could not be decoded (counted as empty in ``usage``)

    def to_json(self) -> dict:
        return {"partitions": [{"partition": p.partition, "used": p.used, "budget": p.budget}
                               for p in self.partitions], "plan_epoch": self.plan_epoch}


def decode_inflight(usage_raw: Mapping[int, bytes | None], plan_raw: bytes | None = None,
                    partitioned: bool = False) -> Inflight:
    """The view from the raw ``usage`` values (by partition; unpartitioned: ``{0: raw}``) and the
    raw plan. An unreadable key is a warning and counts as empty (the admitters overwrite it at
    their next commit); an unreadable plan leaves the budgets unknown."""
    warnings: list[str] = []
    usages: dict[int, Usage] = {}
    for k, raw in sorted(usage_raw.items()):
        where = f"{S.partition_bucket(k)}/{S.KEY_USAGE}" if partitioned else f"{S.BUCKET_INFLIGHT}/{S.KEY_USAGE}"
        try:
            usages[k] = Usage.from_json(raw) if raw else Usage()
        except UsageError as exc:
            warnings.append(f"{where} unreadable: {exc}")
            usages[k] = Usage()
    corrupt = bool(warnings)
    if not partitioned:
        return Inflight(sum_usage(list(usages.values())), warnings=warnings, corrupt=corrupt)
    plan = None
    if plan_raw:
        try:
            plan = decode_plan(plan_raw)
        except UsageError as exc:
            warnings.append(f"{S.BUCKET_BUDGET}/{S.KEY_PLAN} unreadable: {exc}")
    rows = [PartitionUsage(k, u.used, plan.grant(k) if plan else None) for k, u in usages.items()]
    if plan is None and not warnings:
        warnings.append("no budget plan yet (is a coordinator running?): the partitions admit nothing")
    return Inflight(sum_usage(list(usages.values())), rows, plan.epoch if plan else None, warnings, corrupt)


async def read_inflight(bus: Bus) -> Inflight:
    """Read the usage key(s) and, when partitioned, the plan (gets only: a status role needs no watch)."""
    partitions = await bus.partitions()
    if partitions == 1:
        got = await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE)
        return decode_inflight({0: got[0] if got else None})
    gets = await asyncio.gather(*(bus.kv(S.partition_bucket(k)).get(S.KEY_USAGE) for k in range(partitions)),
                                bus.kv(S.BUCKET_BUDGET).get(S.KEY_PLAN))
    *usages, plan = gets
    return decode_inflight({k: got[0] if got else None for k, got in enumerate(usages)},
                           plan[0] if plan else None, partitioned=True)
