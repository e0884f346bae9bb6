"""Partitioned admission: which partition a tenant lives in, and the hierarchical budget that
splits the cluster total between partitions without ever handing out more than the total.

Why partitions: every admitter replica commits to one compare-and-swap key (``inflight/usage``),
and one key serialises every commit of the cluster (3,295 commits/s with one replica, fewer with
more: docs/pipeline-notes.md). With P partitions, requests are spread by tenant with NATS's own
deterministic subject mapping (``req.*.*`` -> ``reqp.{{partition(P,2)}}.{{wildcard(1)}}.{{wildcard(2)}}``),
each partition has its own admitter group and its own usage key, and the keys commit in parallel.

A tenant lives in exactly one partition (:func:`partition_of` is the server's hash), so its floor,
weight and cap are enforced by one admitter group, as exactly as with one partition. What must be
shared is the cluster total: a **coordinator** (any admitter, by lease) turns each partition's
demand into a *budget*, the share of the total that partition may hold. Each partition's admitter
core then runs with ``total = budget`` and its tenants' floors rescaled (:func:`partition_quotas`).

The safety rule (why the total is exact at all times, also while budgets move and while the
coordinator fails over). Partitions apply a new plan whenever they read it, at different times,
and a partition that read an older plan may still apply that one; a partition whose budget was
lowered keeps what it already reserved until those requests finish. So the coordinator counts,
for each partition, its *potential*: the most it may be holding or about to apply,
``max(reserved, applied, granted in the current plan)``. A new plan lowers budgets at once (a decrease is
safe to apply at any time) but raises a budget only out of the headroom
``total - sum(potentials)``. Then ``sum(max(potential, new grant)) <= total``: whatever mix of
old and new plans the partitions run, they never jointly hold more than the total. A lowered
budget frees its headroom once the partition has *applied* it (it reports what it applies with
its usage), so a move of capacity from one partition to another takes two plans. Plans are
written with compare-and-swap on one key, so two coordinators (a failover) cannot both grant the
same headroom. Pure module: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from natsched.admitter.quotas import Quotas, TenantQuota

_FNV_OFFSET, _FNV_PRIME = 0x811C9DC5, 0x01000193


def fnv1a32(data: bytes) -> int:
    """FNV-1a, 32 bits: the hash nats-server's ``partition()`` subject transform uses."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h


def partition_of(tenant: str, partitions: int) -> int:
    """The partition nats-server maps ``req.<class>.<tenant>`` to with ``{{partition(P,2)}}``
    (the hash of the tenant token alone, so a tenant's classes share its partition)."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return fnv1a32(tenant.encode()) % partitions


def partition_mapping(partitions: int) -> dict[str, str]:
    """The server ``mappings`` entry that spreads requests over ``partitions`` partitions."""
    return {"req.*.*": f"reqp.{{{{partition({partitions},2)}}}}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}"}


@dataclass(frozen=True)
class PartitionState:
    """What one partition's admitters report with their usage (and the coordinator reads).

    ``applied``: the budget they enforce now (from plan ``epoch``); ``reserved``: runtime tokens
    held; ``queued``: runtime tokens waiting in their queue (demand the budget does not cover)."""

    applied: int = 0
    epoch: int = 0
    reserved: int = 0
    queued: int = 0

    def __post_init__(self) -> None:
        for name in ("applied", "epoch", "reserved", "queued"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"partition state: {name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class BudgetPlan:
    """A coordinator's plan: the budget each partition may apply, and the epoch that orders plans."""

    epoch: int
    total: int
    grants: Mapping[int, int] = field(default_factory=dict)

    def grant(self, partition: int) -> int:
        return self.grants.get(partition, 0)


def floor_tokens(quotas: Quotas, total: int, partitions: int) -> list[int]:
    """Runtime tokens each partition must be able to hold for its tenants' floors.

    A named tenant's floor goes to its partition. The default tenant's floor (unknown tenants,
    which may hash anywhere) is split evenly: with partitions an unknown tenant is guaranteed
    only its partition's share of it until the next rebalance (docs/fleet.md says so)."""
    floors = [0.0] * partitions
    for tenant, q in quotas.tenants.items():
        floors[partition_of(tenant, partitions)] += q.floor * total
    if quotas.unknown_tenant == "default" and quotas.default_tenant.floor:
        for p in range(partitions):
            floors[p] += quotas.default_tenant.floor * total / partitions
    return [math.ceil(f) for f in floors]


def targets(quotas: Quotas, total: int, states: Mapping[int, PartitionState], partitions: int) -> list[int]:
    """The budgets the coordinator aims at: floors first, then the rest of the total by demand.

    Demand is what a partition holds plus what it has queued, beyond its floor. The rest is
    water-filled in proportion to unmet demand, and what no partition asks for is spread evenly,
    so an idle partition can still absorb a burst before the next rebalance."""
    floors = floor_tokens(quotas, total, partitions)
    scale = min(1.0, total / sum(floors)) if sum(floors) else 1.0  # floors never sum over the total
    out = [int(f * scale) for f in floors]
    need = []
    for p in range(partitions):
        s = states.get(p, PartitionState())
        need.append(max(0, s.reserved + s.queued - out[p]))
    rest = total - sum(out)
    while rest > 0 and any(need):
        asking = [p for p in range(partitions) if need[p] > 0]
        weight = sum(need[p] for p in asking)
        given = 0
        for p in asking:
            share = min(need[p], rest * need[p] // weight)
            out[p] += share
            need[p] -= share
            given += share
        rest -= given
        if given == 0:  # rounding: hand the last tokens out one by one, largest need first
            for p in sorted(asking, key=lambda q: -need[q])[:rest]:
                out[p] += 1
                rest -= 1
    for p in range(partitions):
        out[p] += rest // partitions + (1 if p < rest % partitions else 0)
    return out


def next_plan(quotas: Quotas, total: int, states: Mapping[int, PartitionState], current: BudgetPlan | None,
              partitions: int) -> BudgetPlan:
    """The next plan: decreases at once, increases only from the headroom (module docstring).

    ``total`` is the cluster total in force (quotas' ceiling, or the dynamic total). ``states``
    holds what each partition reported; a partition that reported nothing counts as applying
    its grant of the current plan (the worst case)."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    goal = targets(quotas, total, states, partitions)
    potential = []
    for p in range(partitions):
        s = states.get(p)
        old = current.grant(p) if current else 0
        potential.append(max(s.reserved, s.applied, old) if s else old)
    grants = {p: min(goal[p], potential[p]) for p in range(partitions)}
    headroom = total - sum(potential)
    for p in sorted(range(partitions), key=lambda q: goal[q] - potential[q], reverse=True):
        if headroom <= 0:
            break
        if goal[p] > potential[p]:
            extra = min(goal[p] - potential[p], headroom)
            grants[p] = potential[p] + extra
            headroom -= extra
    epoch = (current.epoch if current else 0) + 1
    return BudgetPlan(epoch=epoch, total=total, grants=grants)


def worst_case_held(plans: Iterable[BudgetPlan], states: Mapping[int, PartitionState], partitions: int) -> int:
    """The most the partitions could jointly hold if each applied the largest of the given plans'
    grants, or kept what it applies or holds now: what the safety rule keeps within the total."""
    plans = list(plans)
    out = 0
    for p in range(partitions):
        s = states.get(p, PartitionState())
        out += max([s.reserved, s.applied] + [pl.grant(p) for pl in plans])
    return out


def partition_quotas(quotas: Quotas, budget: int, total: int, partition: int, partitions: int) -> Quotas:
    """The quotas one partition's admitter core runs with: its budget as the total, its tenants'
    floors rescaled so a floor still means the same runtime tokens, model limits split in
    proportion to the budget, and so are the class limits (the sum over partitions stays within
    each limit)."""
    if budget <= 0 or total <= 0:
        factor = 0.0
    else:
        factor = total / budget
    tenants = {t: replace(q, floor=min(1.0, q.floor * factor))
               for t, q in quotas.tenants.items() if partition_of(t, partitions) == partition}
    share = budget / total if total else 0.0
    models = {m: int(limit * share) for m, limit in quotas.models.items()}
    # class limits are cluster-wide too: each partition holds its budget's share of each
    classes = {c: int(limit * share) for c, limit in quotas.class_limits.items()}
    d = quotas.default_tenant
    default = TenantQuota(floor=min(1.0, d.floor * factor / partitions), weight=d.weight, cap=d.cap)
    floors = sum(q.floor for q in tenants.values()) + default.floor
    if floors > 1.0:  # a budget below the floors (it is still being raised): keep their proportions
        tenants = {t: replace(q, floor=q.floor / floors) for t, q in tenants.items()}
        default = replace(default, floor=default.floor / floors)
    return replace(quotas, total=budget, hard_cap=None, tenants=tenants, models=models, default_tenant=default,
                   class_limits=classes)
