"""The hierarchical budget: tenants' partitions as the server maps them, and plans that never
hand out more than the total, whatever mix of old and new plans the partitions apply."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from natsched.admitter.budget import (
    BudgetPlan,
    PartitionState,
    floor_tokens,
    fnv1a32,
    next_plan,
    partition_mapping,
    partition_of,
    partition_quotas,
    targets,
    worst_case_held,
)
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.bus.connection import Bus
from natsched.bus.server import EmbeddedServer, free_port


def quotas(**floors: float) -> Quotas:
    return Quotas(total=1000, tenants={t: TenantQuota(floor=f) for t, f in floors.items()})


def test_fnv1a_matches_the_published_test_vectors():
    assert fnv1a32(b"") == 0x811C9DC5
    assert fnv1a32(b"a") == 0xE40C292C
    assert fnv1a32(b"foobar") == 0xBF9CF968


def test_partition_of_refuses_no_partitions_and_is_stable():
    with pytest.raises(ValueError, match="partitions"):
        partition_of("acme", 0)
    assert partition_of("acme", 1) == 0
    assert {partition_of("acme", 8) for _ in range(3)} == {partition_of("acme", 8)}


async def test_the_server_maps_each_tenant_to_the_partition_we_compute(tmp_path):
    """The real nats-server's partition() transform, so the coordinator knows where floors live."""
    p = 4
    (src, dst), = partition_mapping(p).items()
    conf = tmp_path / "nats.conf"
    conf.write_text(f'mappings: {{ "{src}": "{dst}" }}\n')
    server = EmbeddedServer(port=free_port(), data_dir=str(tmp_path / "data"), extra_args=["-c", str(conf)])
    server.start()
    try:
        bus = await Bus.connect(server.url, name="partition-test")
        got: list[str] = []
        done = asyncio.Event()
        tenants = [f"tenant-{i}" for i in range(24)] + ["acme", "globex", "x_y-z"]

        async def seen(subject: str, _data: bytes, _headers: dict) -> None:
            got.append(subject)
            if len(got) == 2 * len(tenants):
                done.set()

        sub = await bus.subscribe("reqp.>", seen)
        for t in tenants:
            for cls in ("online", "batch"):
                await bus.publish(f"req.{cls}.{t}", b"")
        await asyncio.wait_for(done.wait(), 10)
        await sub.unsubscribe()
        await bus.close()
    finally:
        server.stop()
    expected = {f"reqp.{partition_of(t, p)}.{cls}.{t}" for t in tenants for cls in ("online", "batch")}
    assert set(got) == expected  # one tenant, one partition, whatever its class


def test_floors_land_in_their_tenants_partitions_and_the_default_floor_is_split():
    q = quotas(acme=0.3, globex=0.2)
    q.default_tenant = TenantQuota(floor=0.1)
    floors = floor_tokens(q, 1000, 4)
    assert sum(floors) == 600
    assert floors[partition_of("acme", 4)] >= 300 + 25 and floors[partition_of("globex", 4)] >= 200 + 25


def test_targets_cover_floors_then_follow_demand_and_use_the_whole_total():
    q = quotas(acme=0.3)
    a = partition_of("acme", 2)
    b = 1 - a
    goal = targets(q, 1000, {b: PartitionState(reserved=500, queued=300)}, 2)
    assert sum(goal) == 1000
    assert goal[a] >= 300  # acme's floor, though it is idle now
    assert goal[b] >= 650  # the busy partition gets what nobody else asks for


def test_a_move_of_budget_takes_two_plans_and_never_exceeds_the_total():
    q = Quotas(total=1000)
    first = next_plan(q, 1000, {}, None, 2)
    assert sum(first.grants.values()) <= 1000
    applied = {p: PartitionState(applied=first.grant(p), epoch=1) for p in range(2)}
    # partition 1 fills its budget and queues more; partition 0 is idle
    busy = {0: applied[0], 1: replace_state(applied[1], reserved=first.grant(1), queued=400)}
    second = next_plan(q, 1000, busy, first, 2)
    assert second.grant(0) < first.grant(0)  # lowered at once
    assert second.grant(1) == first.grant(1)  # no headroom until partition 0 applies its lower budget
    assert worst_case_held([first, second], busy, 2) <= 1000
    busy[0] = PartitionState(applied=second.grant(0), epoch=2)
    third = next_plan(q, 1000, busy, second, 2)
    assert third.grant(1) > second.grant(1)
    assert worst_case_held([second, third], busy, 2) <= 1000


def replace_state(s: PartitionState, **kw) -> PartitionState:
    from dataclasses import replace

    return replace(s, **kw)


def test_bad_partition_states_and_arguments_are_refused():
    with pytest.raises(ValueError, match="queued"):
        PartitionState(queued=-1)
    with pytest.raises(ValueError, match="applied"):
        PartitionState(applied=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="partitions"):
        next_plan(Quotas(), 10, {}, None, 0)
    with pytest.raises(ValueError, match="total"):
        next_plan(Quotas(), -1, {}, None, 2)


def test_partition_quotas_keep_a_floor_worth_the_same_tokens():
    q = quotas(acme=0.2)
    a = partition_of("acme", 4)
    local = partition_quotas(q, 400, 1000, a, 4)
    assert local.total == 400 and local.tenants["acme"].floor == pytest.approx(0.5)  # 200 of 400
    other = partition_quotas(q, 400, 1000, (a + 1) % 4, 4)
    assert "acme" not in other.tenants
    local.validate()
    # a budget below the floors (being raised) keeps them valid: proportions kept, sum <= 1
    squeezed = partition_quotas(quotas(acme=0.6), 100, 1000, partition_of("acme", 4), 4)
    squeezed.validate()


def test_model_limits_are_split_within_the_limit():
    q = Quotas(total=1000, models={"m": 301})
    plans = [partition_quotas(q, g, 1000, p, 3) for p, g in enumerate([500, 300, 200])]
    assert sum(pq.models["m"] for pq in plans) <= 301


def test_class_limits_are_cluster_wide_split_within_the_limit():
    """A class limit (natsched.admitter.classes) holds for the cluster: partitions share it in
    proportion to their budgets instead of each enforcing the whole limit."""
    q = Quotas(total=1000, class_limits={"batch": 601, "online": 400})
    plans = [partition_quotas(q, g, 1000, p, 3) for p, g in enumerate([500, 300, 200])]
    assert sum(pq.class_limits["batch"] for pq in plans) <= 601
    assert [pq.class_limits["online"] for pq in plans] == [200, 120, 80]


@settings(max_examples=300)
@given(
    partitions=st.integers(1, 6),
    total=st.integers(0, 5000),
    steps=st.lists(st.tuples(st.lists(st.integers(0, 3000), min_size=6, max_size=6),
                             st.lists(st.sampled_from(['none', 'latest', 'previous']), min_size=6, max_size=6),
                             st.integers(0, 5000)), min_size=1, max_size=8),
)
def test_whatever_plans_the_partitions_run_they_never_jointly_exceed_the_total(partitions, total, steps):
    """Demand changes; each partition reads the latest plan, a stale one (the plan before it) or
    none: what they hold together never exceeds the total."""
    q = Quotas(total=total)
    plan: BudgetPlan | None = None
    prev: BudgetPlan | None = None
    states = {p: PartitionState() for p in range(partitions)}
    for demand, reads, _ in steps:
        plan, prev = next_plan(q, total, states, plan, partitions), plan
        assert worst_case_held([x for x in (prev, plan) if x], states, partitions) <= max(
            total, sum(max(s.reserved, s.applied) for s in states.values()))
        for p in range(partitions):
            s = states[p]
            read = {"latest": plan, "previous": prev}.get(reads[p])
            if read is not None and read.epoch > s.epoch:  # plans apply in epoch order
                s = PartitionState(applied=read.grant(p), epoch=read.epoch, reserved=s.reserved, queued=s.queued)
            # admit up to the applied budget; what is held above it only drains (requests finish)
            reserved = min(demand[p], s.applied) if s.applied >= s.reserved else min(s.reserved, demand[p])
            states[p] = replace_state(s, reserved=reserved, queued=max(0, demand[p] - reserved))
        assert sum(s.reserved for s in states.values()) <= total
