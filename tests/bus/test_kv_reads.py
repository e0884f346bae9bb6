"""The KV handle's whole-bucket reads (keys, history, watch) end where the bucket ends, not where
the client happens to be: through a proxy that holds every JetStream delivery back behind the
server's later answers (tests/factories/late.py), as a busy server or machine can, they still
return every key, every revision, and set ``ready`` only after the current values.

nats-py's own ``kv.keys()`` returned nothing for a bucket holding a key once in CI (``natsched
quota show`` lost a tenant: nats-io/nats.py#842), and an error of that read passed for an empty
bucket.
"""

from __future__ import annotations

import asyncio

import pytest

from natsched.bus.connection import Bus
from natsched.bus.errors import SnapshotError, StreamNotFound
from natsched.bus.snapshot import read_records
from natsched.wire import subjects as S
from tests.factories.late import LateDeliveries


async def late_bus(url: str) -> Bus:
    return await Bus.connect(url, name="late")


async def test_keys_and_history_wait_for_deliveries_that_come_after_the_servers_answer(bus, nats_url):
    kv = bus.kv(S.BUCKET_QUOTAS)
    await kv.put("tenant.acme", b"1")
    await kv.put("tenant.acme", b"2")
    await kv.put("tenant.beta", b"3")
    await kv.put("gone", b"4")
    await kv.delete("gone")
    async with LateDeliveries(nats_url, delay_s=0.3) as url:
        other = await late_bus(url)
        try:
            late = other.kv(S.BUCKET_QUOTAS)
            assert sorted(await late.keys()) == ["tenant.acme", "tenant.beta"]
            rows = await late.history()
            assert [(k, v, op) for k, v, _rev, op in rows] == [
                ("tenant.acme", b"1", "PUT"), ("tenant.acme", b"2", "PUT"), ("tenant.beta", b"3", "PUT"),
                ("gone", b"4", "PUT"), ("gone", None, "DEL")]
            assert [rev for *_, rev, _op in rows] == sorted(rev for *_, rev, _op in rows)
            assert [k for k, *_ in await late.history("tenant.beta")] == ["tenant.beta"]
        finally:
            await other.close()


async def test_a_watch_is_ready_only_after_every_current_value(bus, nats_url):
    kv = bus.kv(S.BUCKET_QUOTAS)
    for i in range(5):
        await kv.put(f"tenant.t{i}", str(i).encode())
    async with LateDeliveries(nats_url, delay_s=0.3) as url:
        other = await late_bus(url)
        ready, before, changes = asyncio.Event(), [], asyncio.Queue()

        async def watch():
            async for key, value, _rev in other.kv(S.BUCKET_QUOTAS).watch(ready=ready):
                (changes.put_nowait if ready.is_set() else before.append)((key, value))

        task = asyncio.create_task(watch())
        try:
            await asyncio.wait_for(ready.wait(), 30)
            assert sorted(before) == [(f"tenant.t{i}", str(i).encode()) for i in range(5)]
            await kv.delete("tenant.t0")
            assert await asyncio.wait_for(changes.get(), 30) == ("tenant.t0", None)
        finally:
            task.cancel()
            await other.close()


async def test_an_empty_bucket_reads_empty_and_its_watch_is_ready_at_once(bus):
    kv = bus.kv(S.BUCKET_CONFIG)
    assert await kv.keys() == [] and await kv.history() == []
    await kv.put("k", b"v")
    await kv.delete("k")
    assert await kv.keys() == []
    ready = asyncio.Event()

    async def watch():
        async for _ in kv.watch("nothing.>", ready=ready):
            pass

    task = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(ready.wait(), 30)
    finally:
        task.cancel()


async def test_a_read_that_gets_nothing_fails_instead_of_passing_for_an_empty_bucket(bus, nats_url):
    with pytest.raises(StreamNotFound, match="bucket nope does not exist"):
        await bus.kv("nope").keys()
    with pytest.raises(StreamNotFound, match="bucket nope does not exist"):
        await bus.kv("nope").history()
    await bus.kv(S.BUCKET_QUOTAS).put("tenant.acme", b"1")
    async with LateDeliveries(nats_url, delay_s=None) as url:  # deliveries never arrive
        other = await late_bus(url)
        try:
            with pytest.raises(SnapshotError, match="nothing for 1s with 1 pending"):
                await read_records(other.nc, other.js, S.BUCKET_QUOTAS, headers_only=True, stall_s=1)
        finally:
            await other.close()
