"""A tenant moved between partitions (issue 27): changing P moves tenants (their partition is the
server's partition(P, tenant) hash), so the change is refused while the partitions it leaves hold
a queued, held or running request, and once they are drained it loses and duplicates nothing.
Real nats-server, real admitter services and coordinators; waits on events, never on sleeps."""

from __future__ import annotations

import asyncio

import pytest

from natsched.admitter.budget import partition_of
from natsched.admitter.coordinator import Coordinator, CoordinatorSettings
from natsched.admitter.move import PartitionMoveError, change_partitions, pending_in
from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.bus.connection import Bus
from natsched.wire import subjects as S
from tests.admitter.test_partitions import usage_of
from tests.admitter.test_service import decisions, publish, request, set_quotas, stop
from tests.factories.core import completion_subject, make_completion
from tests.factories.core import wait_for as until

#: four tenants in four distinct partitions of 4: two of them (those at 2 and 3) move when P goes 2 -> 4
TENANTS = []
for _i in range(200):
    _t = f"tenant-{_i}"
    if partition_of(_t, 4) not in {partition_of(t, 4) for t in TENANTS}:
        TENANTS.append(_t)
    if len(TENANTS) == 4:
        break
MOVED = [t for t in TENANTS if partition_of(t, 2) != partition_of(t, 4)]
assert len(MOVED) == 2


async def start_set(url, partitions: int) -> list:
    """A coordinator and one admitter per partition of ``partitions``."""
    coord = Coordinator(await Bus.connect(url, name=f"coord-{partitions}"),
                        CoordinatorSettings(name=f"coord-{partitions}", partitions=partitions, interval_s=0.1))
    await coord.start()
    admitters = []
    for k in range(partitions):
        name = f"adm-{partitions}-p{k}"
        a = AdmitterService(await Bus.connect(url, name=name), AdmitterServiceSettings(
            name=name, partition=k, partitions=partitions, ack_wait_s=5.0, keepalive_s=1.0,
            reconcile_interval_s=3600))
        await a.start()
        admitters.append(a)
    return [coord, *admitters]


async def allowed(bus) -> dict[str, list]:
    out: dict[str, list] = {}
    for d in await decisions(bus):
        if d.decision == "allow":
            out.setdefault(d.request_id, []).append(d)
    return out


async def complete(bus, ids_tenants) -> None:
    for rid, tenant in ids_tenants:
        c = make_completion(rid, tenant=tenant, runtime_tokens=300)
        await bus.jpublish(completion_subject(c), c, msg_id=f"c-{rid}")


async def test_a_tenant_moved_by_a_partition_change_loses_and_duplicates_nothing(bus, nats_url):
    await set_quotas(bus, cluster__total=3000, class__online__queue=100)
    assert await bus.set_partitions(2) is True
    old = await start_set(nats_url, 2)
    first = [request(t) for t in TENANTS for _ in range(3)]  # 12 x 300: 10 fit, 2 wait un-acked
    tenant_of = {r.id: r.tenant for r in first}
    try:
        await asyncio.gather(*(publish(bus, r) for r in first))

        async def ten_allowed():
            return len(await allowed(bus)) == 10
        assert await until(ten_allowed)
        with pytest.raises(PartitionMoveError) as refused:  # running and waiting requests: refused
            await change_partitions(bus, 4)
        msg = str(refused.value)
        assert "cannot change partitions 2 -> 4" in msg and "runtime tokens reserved" in msg
        assert "delivered and not decided" in msg or "not delivered" in msg
        assert await bus.partitions() == 2  # nothing changed
        done: set[str] = set()
        while len(done) < len(first):  # complete what runs until every request ran
            running = [rid for rid in await allowed(bus) if rid not in done]
            await complete(bus, [(rid, tenant_of[rid]) for rid in running])
            done |= set(running)

            n = len(done)

            async def more_or_all(n=n):
                return len(await allowed(bus)) > n or n == len(first)
            assert await until(more_or_all)

        async def drained():
            return await pending_in(bus, 2) == []
        assert await until(drained)
    finally:
        await stop(*old)
    assert await change_partitions(bus, 4) is True  # drained: the move goes through
    new = await start_set(nats_url, 4)
    try:
        second = [request(t) for t in TENANTS]
        tenant_of.update({r.id: r.tenant for r in second})
        await asyncio.gather(*(publish(bus, r) for r in second))

        async def all_allowed():
            return len(await allowed(bus)) == len(first) + len(second)
        assert await until(all_allowed)
        by = await allowed(bus)
        assert all(len(ds) == 1 for ds in by.values())  # nothing decided twice, old or new
        for r in second:  # each by its tenant's new partition, the moved ones included
            assert by[r.id][0].by == f"adm-4-p{partition_of(r.tenant, 4)}"
        for k in range(4):  # each tenant counted in one partition only: its new one
            u = await usage_of(bus, S.partition_bucket(k))
            assert set(u.tenants) == {t for t in TENANTS if partition_of(t, 4) == k} and u.used == 300
        assert sum(new[1 + k].shared.usage.used for k in range(4)) == 1200  # within the total, 3000
    finally:
        await stop(*new)


async def test_a_plain_up_after_a_partitioned_one_is_refused_while_requests_wait_there(bus):
    """Stored under reqp.<k> and never consumed (no admitter ran): undoing P would strand them."""
    assert await change_partitions(bus, 2) is True  # (fresh: nothing to drain)
    await publish(bus, request(TENANTS[0]))
    with pytest.raises(PartitionMoveError, match=r"1 request\(s\) stored under reqp\.\d\.> and no consumer"):
        await change_partitions(bus, 1)
    with pytest.raises(PartitionMoveError, match="2 -> 4"):
        await change_partitions(bus, 4)
    assert await bus.partitions() == 2
    assert await change_partitions(bus, 2) is False  # the same P is always fine
