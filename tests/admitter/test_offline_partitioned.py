"""The offline runner under partitioned admission, against a real nats-server and two real
partition admitters with their coordinator: each job is admitted through its tenant's partition
(that partition's usage key and bucket, within the low watermark of that partition's budget),
and the partition's admitter releases it on the completion as its own."""

from __future__ import annotations

import asyncio

import orjson

from natsched.admitter.budget import BudgetPlan, partition_of
from natsched.admitter.coordinator import decode_plan
from natsched.admitter.offline import OfflineRunner, OfflineSettings
from natsched.bus.connection import Bus
from natsched.wire import subjects as S
from natsched.wire.schema import Admitted
from tests.admitter.test_partitions import start_partition, usage_of
from tests.admitter.test_service import publish, request, set_quotas, stop
from tests.factories.core import completion_subject, make_completion
from tests.factories.core import wait_for as until

A, B = "globex", "acme"  # partitions 0 and 1 of 2
assert (partition_of(A, 2), partition_of(B, 2)) == (0, 1)


async def admitted(bus) -> list[Admitted]:
    return [Admitted.decode(data) for _, data in await bus.stream_messages(S.STREAM_ADMITTED)]


async def test_offline_jobs_run_through_their_tenants_partition_within_its_budget(bus, nats_url):
    await set_quotas(bus, cluster__total=3000)
    a0 = await start_partition(nats_url, 0, coordinate=True)
    a1 = await start_partition(nats_url, 1)
    runner = OfflineRunner(await Bus.connect(nats_url, name="offline"),
                           OfflineSettings(poll_s=0.02, partitions=None))  # P read from REQUESTS
    await runner.start()
    try:
        assert runner.partitions == 2
        # idle: each partition is granted half the total, so half of that (the low watermark) is
        # offline room: 750 runtime tokens per partition, two jobs of 300 each
        assert await until(lambda: a0.budget == a1.budget == 1500)
        jobs = [request(A, cls=S.OFFLINE) for _ in range(3)] + [request(B, cls=S.OFFLINE) for _ in range(2)]
        await asyncio.gather(*(publish(bus, r) for r in jobs))

        async def four_taken():
            return len(await admitted(bus)) == 4
        assert await until(four_taken)
        taken = await admitted(bus)
        assert sorted(a.request.tenant for a in taken) == sorted([A, A, B, B])
        u0, u1 = await usage_of(bus, S.partition_bucket(0)), await usage_of(bus, S.partition_bucket(1))
        assert (u0.tenants, u1.tenants) == ({A: 600}, {B: 600}) and u0.classes == {S.OFFLINE: 600}
        plan = decode_plan((await bus.kv(S.BUCKET_BUDGET).get(S.KEY_PLAN))[0])
        assert u0.used <= 0.5 * plan.grant(0) and u1.used <= 0.5 * plan.grant(1)
        for a in taken:  # each reservation record is in its tenant's partition bucket, none in inflight
            k = partition_of(a.request.tenant, 2)
            assert await bus.kv(S.partition_bucket(k)).get(S.reservation_key(a.request.id)) is not None
        assert await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE) is None
        assert len(runner.held) == 1 and runner.held[0].request.tenant == A  # the third of A waits for room

        # a completion is released by the tenant's partition admitter, which frees room for A's third job
        first_a = next(a for a in taken if a.request.tenant == A)
        c = make_completion(first_a.request.id, tenant=A, runtime_tokens=300)
        await bus.jpublish(completion_subject(c), c, msg_id="c-offline-a")

        async def five_taken():
            return len(await admitted(bus)) == 5
        assert await until(five_taken)
        assert (await usage_of(bus, S.partition_bucket(0))).tenants == {A: 600}
        assert await bus.kv(S.partition_bucket(0)).get(S.reservation_key(first_a.request.id)) is None
        assert not runner.held
    finally:
        await stop(a0, a1)
        await runner.bus.close()


async def test_without_a_plan_nothing_runs_and_a_take_on_a_stale_plan_is_given_back(bus, nats_url):
    """Before the coordinator's first plan every partition's budget is 0: nothing is taken. A take
    committed on a plan that a newer one replaced meanwhile is given back, and taken again under
    the new plan."""
    await bus.set_partitions(2)
    await set_quotas(bus, cluster__total=3000)
    # the test drives every take itself: the runner's own loop (poll_s) would race it for the same
    # held jobs once the plan is there (it failed that way on a loaded machine: 0 taken, both gone)
    runner = OfflineRunner(await Bus.connect(nats_url, name="offline"), OfflineSettings(poll_s=3600, partitions=2))
    await runner.start()
    try:
        for _ in range(2):  # the runner holds it, takes nothing, and keeps it for a plan
            await bus.jpublish(S.offline(A), request(A, cls=S.OFFLINE), msg_id=f"off-{_}")
        assert await until(lambda: len(runner.held) == 2)
        assert await runner.take_once() == 0 and len(runner.held) == 2
        assert await admitted(bus) == []
        await bus.kv(S.BUCKET_BUDGET).put(S.KEY_PLAN, orjson.dumps({"epoch": 2, "total": 3000,
                                                                     "grants": {"0": 1500, "1": 1500}}))
        stale = BudgetPlan(epoch=1, total=3000, grants={0: 1500, 1: 1500})  # read before epoch 2 came
        assert await runner._take(runner.by_partition[0], list(runner.held), 1500, None, stale, 0) == 0
        assert (await usage_of(bus, S.partition_bucket(0))).used == 0 and len(runner.held) == 2
        assert await runner.take_once() == 2 and not runner.held
        assert (await usage_of(bus, S.partition_bucket(0))).tenants == {A: 600}
        assert len(await admitted(bus)) == 2
    finally:
        await runner.bus.close()
