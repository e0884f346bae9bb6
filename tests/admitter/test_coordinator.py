"""The budget coordinator: strict codecs, the reports it trusts, the plans it waits with, and its
lease on a real nats-server (one active, a standby that takes over once the lease expires)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from natsched.admitter.budget import BudgetPlan, PartitionState
from natsched.admitter.coordinator import (Coordinator, CoordinatorSettings, Report, aggregate, decode_plan,
                                           encode_plan, plan_step)
from natsched.admitter.errors import UsageError
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.bus.connection import Bus
from natsched.errors import NatschedError
from natsched.wire import subjects as S


def test_a_plan_round_trips_and_anything_else_is_refused():
    plan = BudgetPlan(epoch=3, total=1000, grants={0: 600, 1: 400})
    assert decode_plan(encode_plan(plan)) == plan
    for bad in (b"{", b"[]", orjson.dumps({"epoch": 1, "total": 10}),
                orjson.dumps({"epoch": 1, "total": 10, "grants": {"0": -1}}),
                orjson.dumps({"epoch": 1, "total": 10, "grants": {"x": 1}}),
                orjson.dumps({"epoch": True, "total": 10, "grants": {}}),
                orjson.dumps({"epoch": 1, "total": 10, "grants": {}, "more": 1})):
        with pytest.raises(UsageError):
            decode_plan(bad)


def test_a_report_round_trips_and_a_forged_one_is_refused():
    r = Report(PartitionState(applied=5, epoch=2, reserved=3, queued=1), at=12.5)
    assert Report.decode(r.encode()) == r
    for bad in (b"x", orjson.dumps({"applied": 1}), orjson.dumps({"applied": -1, "epoch": 0, "reserved": 0,
                                                                   "queued": 0, "at": 1.0}),
                orjson.dumps({"applied": 1, "epoch": 0, "reserved": 0, "queued": 0, "at": "now"})):
        with pytest.raises((UsageError, ValueError)):
            Report.decode(bad)


def test_aggregate_takes_the_most_held_the_oldest_epoch_and_drops_silent_replicas():
    now = 100.0
    reports = {(0, "a"): Report(PartitionState(applied=500, epoch=4, reserved=300, queued=10), now - 1),
               (0, "b"): Report(PartitionState(applied=700, epoch=3, reserved=200, queued=5), now - 2),
               (1, "c"): Report(PartitionState(applied=900, epoch=1, reserved=900, queued=0), now - 60)}
    got = aggregate(reports, now, ttl_s=30)
    assert got == {0: PartitionState(applied=700, epoch=3, reserved=300, queued=15)}


def test_no_plan_while_a_partition_may_still_run_a_plan_older_than_the_one_before():
    q = Quotas(total=1000)
    current = BudgetPlan(epoch=5, total=1000, grants={0: 500, 1: 500})
    fresh = {0: PartitionState(applied=500, epoch=5, reserved=500, queued=400),
             1: PartitionState(applied=500, epoch=4, reserved=0)}
    plan, why = plan_step(q, fresh, current, 2)
    # one behind is covered; a move takes two plans: partition 1 lowered at once ...
    assert plan == BudgetPlan(epoch=6, total=1000, grants={0: 500, 1: 50})
    applied = {0: fresh[0], 1: PartitionState(applied=50, epoch=6)}
    raised, _ = plan_step(q, applied, plan, 2)  # ... partition 0 raised once 1 applies it
    assert raised == BudgetPlan(epoch=7, total=1000, grants={0: 950, 1: 50})
    lagging = {**fresh, 1: PartitionState(applied=500, epoch=3)}
    assert plan_step(q, lagging, current, 2) == (None, "partition(s) 1 not yet on plan 4 or later")
    assert plan_step(q, {0: fresh[0]}, current, 2)[0] is None  # no live replica: nothing moves
    idle = {p: PartitionState(applied=500, epoch=5) for p in (0, 1)}
    assert plan_step(q, idle, current, 2) == (None, "unchanged")  # no epoch spent on the same grants


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1200), st.integers(0, 1500)), min_size=1, max_size=30),
       st.integers(0, 2))
def test_whatever_plan_each_partition_still_runs_the_grants_never_sum_over_the_total(steps, lag):
    """A coordinator loop where each partition applies the newest plan only some of the time: the
    most any mix of plans it may still run (those since its report) never sums over the total."""
    q = Quotas(total=1000, tenants={"globex": TenantQuota(floor=0.2)})
    plans: list[BudgetPlan] = []
    running = {0: 0, 1: 0}  # epoch each partition enforces (0: none)
    reserved = {0: 0, 1: 0}
    for who, demand, _ in steps:
        current = plans[-1] if plans else None
        states = {p: PartitionState(applied=(plans[running[p] - 1].grant(p) if running[p] else 0),
                                    epoch=running[p], reserved=reserved[p],
                                    queued=demand if p == who else 0) for p in (0, 1)}
        plan, _why = plan_step(q, states, current, 2)
        if plan is not None:
            plans.append(plan)
        if plans and (lag == 0 or (demand + who) % (lag + 1) == 0):  # this one reads the newest plan
            running[who] = plans[-1].epoch
        grant = plans[running[who] - 1].grant(who) if running[who] else 0
        old = reserved[who]  # admits up to its grant; holds what it has until completions free it
        reserved[who] = max(old, min(demand, grant)) if demand >= old else demand
        # what partition p may hold or apply: what it holds, its plan or any newer one
        worst = sum(max([reserved[p]] + [pl.grant(p) for pl in plans[max(running[p] - 1, 0):]]) for p in (0, 1))
        assert worst <= 1000


def test_one_partition_is_no_coordinators_business():
    with pytest.raises(NatschedError, match="2 partitions"):
        Coordinator(None, CoordinatorSettings(partitions=1))


async def test_one_candidate_holds_the_lease_and_the_standby_takes_it_once_expired(bus, nats_url):
    a = Coordinator(await Bus.connect(nats_url, name="a"), CoordinatorSettings(name="a", lease_s=5))
    b = Coordinator(await Bus.connect(nats_url, name="b"), CoordinatorSettings(name="b", lease_s=5))
    await bus.set_partitions(2)
    try:
        t = 1_000_000.0
        assert await a.hold_lease(t) and not await b.hold_lease(t + 1)
        assert await a.hold_lease(t + 4)  # renewed: good until t + 9
        assert not await b.hold_lease(t + 8)
        assert await b.hold_lease(t + 9.5) and b.active  # a went silent: b takes over
        assert not await a.hold_lease(t + 10) and not a.active
        plan = await b.tick(t + 10)  # the first plan: no demand, the total split evenly
        assert plan is not None and plan.grants == {0: 200_000, 1: 200_000}
        assert decode_plan((await bus.kv(S.BUCKET_BUDGET).get(S.KEY_PLAN))[0]) == plan
        assert await b.tick(t + 10.5) is None and "not yet on plan" in b.waiting  # nobody applied it yet
        await b.resign()
        assert await a.hold_lease(t + 11)  # given back: no wait for the expiry
    finally:
        await a.bus.close()
        await b.bus.close()


async def test_a_corrupted_total_keeps_the_last_good_one_in_the_plan(bus, nats_url):
    c = Coordinator(await Bus.connect(nats_url, name="c"), CoordinatorSettings(name="c"))
    await bus.set_partitions(2)
    try:
        await bus.kv(S.BUCKET_QUOTAS).put("cluster.total", orjson.dumps(1000))
        t = 2_000_000.0
        first = await c.tick(t)
        assert first is not None and first.total == 1000
        for p in (0, 1):  # both partitions run it, so a new plan may follow
            await bus.kv(S.BUCKET_BUDGET).put(S.partition_report_key(p, "r"), Report(
                PartitionState(applied=first.grant(p), epoch=first.epoch, queued=900 * p), t).encode())
        await bus.kv(S.BUCKET_QUOTAS).put("cluster.total", b"not a number")
        second = await c.tick(t + 1)
        assert second is not None and second.total == 1000 and sum(second.grants.values()) <= 1000
    finally:
        await c.bus.close()


def test_a_lost_plan_is_replaced_above_every_epoch_the_partitions_run():
    q = Quotas(total=1000)
    states = {0: PartitionState(applied=400, epoch=7, reserved=400), 1: PartitionState(applied=600, epoch=6)}
    plan, _ = plan_step(q, states, None, 2)
    assert plan.epoch == 8 and sum(plan.grants.values()) <= 1000
    assert plan_step(q, {}, None, 2)[0].epoch == 1
