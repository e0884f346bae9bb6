"""Partitioned admission on a real nats-server: requests stored by the server's own partition()
transform, one admitter per partition with its own consumer and usage key, the total split by a
budget coordinator, and a coordinator failover that never lets the partitions jointly over-admit."""

from __future__ import annotations

import asyncio

import orjson

from natsched.admitter.budget import partition_of
from natsched.admitter.coordinator import Coordinator, CoordinatorSettings, Report, decode_plan
from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.admitter.usage import Usage
from natsched.bus.connection import Bus
from natsched.wire import subjects as S
from tests.admitter.test_service import decisions, publish, request, set_quotas, stop
from tests.factories.core import completion_subject, make_completion
from tests.factories.core import wait_for as until

P0, P1 = "globex", "acme"  # partition_of(.., 2): 0 and 1
assert (partition_of(P0, 2), partition_of(P1, 2)) == (0, 1)


async def start_partition(url, k: int, name: str | None = None, coordinate: bool = False, **kw) -> AdmitterService:
    name = name or f"adm-p{k}"
    kw.setdefault("ack_wait_s", 5.0)
    kw.setdefault("keepalive_s", 1.0)
    kw.setdefault("reconcile_interval_s", 3600)
    service = AdmitterService(await Bus.connect(url, name=name), AdmitterServiceSettings(
        name=name, partition=k, partitions=2, coordinate=coordinate, **kw))
    await service.start()
    return service


async def start_coordinator(url, name: str, lease_s: float = 1.0) -> Coordinator:
    c = Coordinator(await Bus.connect(url, name=name),
                    CoordinatorSettings(name=name, partitions=2, interval_s=0.1, lease_s=lease_s))
    await c.start()
    return c


async def usage_of(bus, bucket: str) -> Usage:
    got = await bus.kv(bucket).get(S.KEY_USAGE)
    return Usage.from_json(got[0]) if got else Usage()


async def test_the_stream_stores_each_tenant_under_the_servers_partition(bus):
    assert await bus.set_partitions(2) is True
    assert await bus.set_partitions(2) is False  # idempotent
    await bus.provision()  # a service provisioning with its defaults keeps the transform
    tenants = [f"tenant-{i}" for i in range(12)] + [P0, P1]
    for t in tenants:
        await publish(bus, request(t))
    stored = {subject for subject, _ in await bus.stream_messages(S.STREAM_REQUESTS)}
    assert stored == {f"reqp.{partition_of(t, 2)}.online.{t}" for t in tenants}
    assert await bus.set_partitions(1) is True  # undone: stored as published again
    await publish(bus, request("tenant-0"))
    assert (await bus.stream_messages(S.STREAM_REQUESTS))[-1][0] == "req.online.tenant-0"


async def test_two_partitions_admit_their_own_tenants_in_their_own_buckets_within_the_total(bus, nats_url):
    await set_quotas(bus, cluster__total=3000, class__online__queue=100)
    a0 = await start_partition(nats_url, 0, coordinate=True)
    a1 = await start_partition(nats_url, 1, coordinate=True)  # a second candidate: stands by
    try:
        assert {a0.coordinator.active, a1.coordinator.active} == {True, False}
        reqs = [request(t) for t in (P0, P1) for _ in range(8)]  # 16 x 300 asked, 10 fit
        await asyncio.gather(*(publish(bus, r) for r in reqs))

        async def ten_allowed():
            return sum(d.decision == "allow" for d in await decisions(bus)) == 10
        assert await until(ten_allowed)
        ds = await decisions(bus)
        by = {d.request_id: d for d in ds if d.decision == "allow"}
        for d in by.values():  # each tenant decided by its own partition's admitter
            assert d.by == ("adm-p0" if d.tenant == P0 else "adm-p1")
        u0, u1 = await usage_of(bus, S.partition_bucket(0)), await usage_of(bus, S.partition_bucket(1))
        assert set(u0.tenants) <= {P0} and set(u1.tenants) <= {P1}
        assert u0.used + u1.used == 3000 and u0.used <= a0.budget and u1.used <= a1.budget
        assert await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE) is None  # the one shared key is not used
        assert not [k for k in await bus.kv(S.BUCKET_INFLIGHT).keys()]  # nor its records: each in its partition's
        assert a0.budget + a1.budget <= 3000
        # a completion is released by its tenant's partition only, which admits a queued request of its own
        rid = next(r for r, d in by.items() if d.tenant == P1)
        c = make_completion(rid, tenant=P1, runtime_tokens=300)
        await bus.jpublish(completion_subject(c), c, msg_id="c-p1")

        async def eleven_allowed():
            return sum(d.decision == "allow" for d in await decisions(bus)) == 11
        assert await until(eleven_allowed)
        new = [d for d in await decisions(bus) if d.decision == "allow" and d.request_id not in by]
        assert [d.tenant for d in new] == [P1] and await a1.shared.lookup(rid) is None
        assert a0.shared.usage.used == u0.used and a1.shared.usage.used == u1.used
    finally:
        await stop(a0, a1)


async def test_a_floor_in_one_partition_holds_against_a_flood_in_the_other(bus, nats_url):
    """P0 has half the total as its floor: P1's flood cannot take it, P0 gets it when it asks."""
    await set_quotas(bus, cluster__total=3000, class__online__queue=100, tenant__globex={"floor": 0.5})
    a0 = await start_partition(nats_url, 0, coordinate=True)
    a1 = await start_partition(nats_url, 1, coordinate=True)
    try:
        await asyncio.gather(*(publish(bus, request(P1)) for _ in range(10)))  # 3000 asked
        async def flood_decided():
            return a1.shared.usage.used >= 1500 and len(a1.held) == 5
        assert await until(flood_decided)
        assert a1.shared.usage.used == 1500  # the other half is the floor's, idle or not
        await asyncio.gather(*(publish(bus, request(P0)) for _ in range(5)))
        assert await until(lambda: a0.shared.usage.used == 1500)
        assert a1.shared.usage.used == 1500
    finally:
        await stop(a0, a1)


async def test_a_request_larger_than_its_budget_waits_for_it_instead_of_being_refused(bus, nats_url):
    await set_quotas(bus, cluster__total=3000, class__online__queue=100)
    coord = await start_coordinator(nats_url, "coord")
    a0 = await start_partition(nats_url, 0)
    a1 = await start_partition(nats_url, 1)
    try:
        assert await until(lambda: a0.budget == 1500)  # no demand anywhere: split evenly
        big = request(P0, tokens=800)  # 2400 runtime tokens: more than the budget, less than the total
        await publish(bus, big)
        assert await until(lambda: a0.shared.usage.used == 2400)
        async def its_decisions():  # (the record is stored after the usage: publishes are not ordered)
            return [x.decision for x in await decisions(bus) if x.request_id == big.id]
        assert await until(its_decisions)
        assert await its_decisions() == ["allow"]  # never refused as too_large on the way
        assert a0.budget + a1.budget <= 3000
    finally:
        await stop(a0, a1, coord)


async def test_budget_moves_between_partitions_through_a_coordinator_failover_never_over_total(bus, nats_url):
    """Demand moves from partition 0 to partition 1 while the active coordinator is killed and the
    standby takes over: the partitions' joint usage and their applied budgets never exceed the
    total at any observed moment, and the capacity does move."""
    total = 3000
    await set_quotas(bus, cluster__total=total, class__online__queue=100)
    first = await start_coordinator(nats_url, "coord-a")
    a0 = await start_partition(nats_url, 0)
    a1 = await start_partition(nats_url, 1)
    second = await start_coordinator(nats_url, "coord-b")
    seen: list[int] = []
    over: list[tuple] = []
    watching = True

    async def watch():  # every report and usage value as the coordinator would see it
        while watching:
            u = [await usage_of(bus, S.partition_bucket(k)) for k in (0, 1)]
            reps = [Report.decode(v) for v, _ in (await bus.kv(S.BUCKET_BUDGET).snapshot(S.REPORTS_ALL)).values()]
            joint, applied = u[0].used + u[1].used, sum(r.state.applied for r in reps)
            seen.append(joint)
            if joint > total or applied > total or a0.budget + a1.budget > total:
                over.append((joint, applied, a0.budget, a1.budget))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        assert first.active and not second.active
        phase1 = [request(P0) for _ in range(9)]  # 2700 asked by partition 0
        await asyncio.gather(*(publish(bus, r) for r in phase1))
        assert await until(lambda: a0.shared.usage.used == 2700)  # the budget moved to partition 0
        await first.bus.close()  # the active coordinator dies (its lease is left to expire)
        for i, r in enumerate(phase1):  # partition 0's work finishes ...
            c = make_completion(r.id, tenant=P0, runtime_tokens=300)
            await bus.jpublish(completion_subject(c), c, msg_id=f"c{i}")
        await asyncio.gather(*(publish(bus, request(P1)) for _ in range(9)))  # ... and partition 1 asks
        assert await until(lambda: a1.shared.usage.used == 2700)  # moved back, by the standby
        assert second.active and second.plans_written >= 1
    finally:
        watching = False
        await watcher
        await stop(a0, a1, second)
    assert not over, over[:5]
    assert max(seen) <= total


async def test_a_malformed_plan_is_refused_and_the_plan_in_force_kept(bus, nats_url):
    await set_quotas(bus, cluster__total=3000)
    coord = await start_coordinator(nats_url, "coord")
    a0 = await start_partition(nats_url, 0)
    try:
        assert await until(lambda: a0.budget_plan is not None)
        before = a0.budget
        await coord.bus.close()
        plan_raw, rev = await bus.kv(S.BUCKET_BUDGET).get(S.KEY_PLAN)
        epoch = decode_plan(plan_raw).epoch
        for bad in (b"not json", orjson.dumps({"epoch": epoch + 1, "total": 3000, "grants": {"0": -5}}),
                    orjson.dumps({"epoch": epoch + 1, "total": 3000, "grants": {"0": 99999}, "extra": 1})):
            await bus.kv(S.BUCKET_BUDGET).put(S.KEY_PLAN, bad)
        good = orjson.dumps({"epoch": epoch + 1, "total": 3000, "grants": {"0": 100, "1": 100}})
        await bus.kv(S.BUCKET_BUDGET).put(S.KEY_PLAN, good)  # a marker: the watch got past the bad ones
        assert await until(lambda: a0.budget == 100)
        assert before != 100
    finally:
        await stop(a0)


async def test_partition_decisions_name_the_subject_the_producer_published_on(bus, nats_url):
    """The core checks the body against ``req.<class>.<tenant>`` also when stored as ``reqp.``:
    a body claiming another tenant than its subject is refused as before."""
    await set_quotas(bus, cluster__total=3000)
    coord = await start_coordinator(nats_url, "coord")
    a0 = await start_partition(nats_url, 0)
    try:
        lie = request(P1)  # the body says acme (partition 1) ...
        await bus.jpublish(S.request("online", P0), lie, msg_id=lie.id)  # ... the subject globex (0)

        async def refused():
            return [(d.decision, d.reason) for d in await decisions(bus) if d.request_id == lie.id]
        assert await until(refused)
        assert await refused() == [("reject", "subject_mismatch")]
    finally:
        await stop(a0, coord)


async def test_a_dead_workers_work_is_rescued_once_each_by_its_tenants_partition(bus, nats_url):
    """Both partitions sweep the same dead worker: each re-admits its own tenant's request and
    leaves the other's alone, so nothing is lost (deleted by the wrong partition) or run twice."""
    from tests.admitter.test_rescue import admitted, make_assignment, reserve

    await set_quotas(bus, cluster__total=3000)
    coord = await start_coordinator(nats_url, "coord")
    a0 = await start_partition(nats_url, 0, rescue_grace_s=0.0)
    a1 = await start_partition(nats_url, 1, rescue_grace_s=0.0)
    try:
        mine0, mine1 = make_assignment(tenant=P0), make_assignment(tenant=P1)
        await reserve(a0, mine0)
        await reserve(a1, mine1)
        for a in (mine0, mine1):
            await bus.jpublish(S.work(a.worker), a, msg_id=f"{a.request.id}:work")
        first = await a0.reclaim({})
        assert first.rescued == {mine0.request.id: "wdead"} and not first.finished  # the other left alone
        assert [a.request.id for a in await admitted(bus)] == [mine0.request.id]
        second = await a1.reclaim({})
        assert second.rescued == {mine1.request.id: "wdead"} and not second.finished
        assert sorted(a.request.id for a in await admitted(bus)) == sorted([mine0.request.id, mine1.request.id])
        assert await bus.stream_messages(S.STREAM_WORK) == []
        assert not (await a0.reclaim({})).rescued and not (await a1.reclaim({})).rescued
    finally:
        await stop(a0, a1, coord)


async def test_a_lease_reclaim_releases_each_reservation_in_its_own_partition_only(bus, nats_url):
    await set_quotas(bus, cluster__total=3000)
    coord = await start_coordinator(nats_url, "coord")
    a0 = await start_partition(nats_url, 0)
    a1 = await start_partition(nats_url, 1)
    try:
        r0, r1 = request(P0), request(P1)
        await publish(bus, r0)
        await publish(bus, r1)
        assert await until(lambda: a0.shared.usage.used == 300 and a1.shared.usage.used == 300)
        expired = {"w1": {r0.id, r1.id}}  # a worker held both and missed its heartbeats
        await a0.reclaim(expired)
        assert a0.shared.usage.used == 0 and await until(lambda: a1.shared.usage.used == 300)
        await a1.reclaim(expired)
        assert a1.shared.usage.used == 0
        assert (await usage_of(bus, S.partition_bucket(0))).used == 0  # not below zero either
    finally:
        await stop(a0, a1, coord)


async def test_a_tenants_cap_holds_in_its_partition_as_without_partitions(bus, nats_url):
    """The cap is the tenant's own, not the partition's: past it, refused as with one partition
    (and not held as budget demand: the budget is not what stands in its way)."""
    await set_quotas(bus, cluster__total=3000, class__online__queue=100, tenant__acme={"cap": 900})
    coord = await start_coordinator(nats_url, "coord")
    a0 = await start_partition(nats_url, 0)
    a1 = await start_partition(nats_url, 1)
    try:
        reqs = [request(P1) for _ in range(6)]
        await asyncio.gather(*(publish(bus, r) for r in reqs))

        async def all_decided():
            return len(await decisions(bus)) == 6
        assert await until(all_decided)
        got = sorted((d.decision, d.reason or "") for d in await decisions(bus))
        assert got == [("allow", "")] * 3 + [("reject", "tenant_cap")] * 3
        assert a1.shared.usage.used == 900 and not a1.budget_held
    finally:
        await stop(a0, a1, coord)


async def test_a_clean_stop_removes_the_replicas_report_and_gives_the_lease_back(bus, nats_url):
    await set_quotas(bus, cluster__total=3000)
    a0 = await start_partition(nats_url, 0, coordinate=True)
    try:
        key = S.partition_report_key(0, "adm-p0")
        assert await bus.kv(S.BUCKET_BUDGET).get(key) is not None and a0.coordinator.active
        await a0.stop()
        assert await bus.kv(S.BUCKET_BUDGET).get(key) is None
        lease = orjson.loads((await bus.kv(S.BUCKET_BUDGET).get(S.KEY_COORDINATOR))[0])
        assert lease["holder"] == "" and not a0.coordinator.active
    finally:
        await stop(a0)
