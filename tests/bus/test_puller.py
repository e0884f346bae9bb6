"""The continuous pull reader (bus/puller.py) on a real nats-server: few pull requests, batches,
and it keeps reading when the server forgets its requests (expiry, a deleted consumer, a restart)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from nats.js import api

from natsched.bus.connection import Bus, ConsumerSpec
from natsched.bus.puller import Puller
from natsched.bus.server import EmbeddedServer, free_port

STREAM = "PULLTEST"


async def make_consumer(bus: Bus, durable: str = "reader") -> None:
    await bus.js.add_stream(api.StreamConfig(name=STREAM, subjects=["pulltest.>"], storage=api.StorageType.MEMORY))
    await bus.js.add_consumer(STREAM, api.ConsumerConfig(durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT))


@asynccontextmanager
async def reading(bus: Bus, **kw):
    """A fresh stream and durable consumer, a started Puller on it; all removed afterwards."""
    await make_consumer(bus)
    puller = Puller(bus.nc, STREAM, "reader", **kw)
    await puller.start()
    try:
        yield puller
    finally:
        await puller.stop()
        await bus.js.delete_stream(STREAM)


async def read(puller: Puller, n: int, timeout: float = 10.0) -> list:
    got: list = []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(got) < n:
        left = deadline - asyncio.get_running_loop().time()
        assert left > 0, f"only {len(got)} of {n} messages arrived"
        batch = await puller.next_batch(timeout=left)
        for m in batch:
            await m.ack()
        got += batch
    return got


async def test_a_busy_consumer_sends_one_pull_request_per_half_batch(bus):
    async with reading(bus, batch=64) as puller:
        for i in range(300):
            await bus.js.publish(f"pulltest.{i % 3}", str(i).encode())
        got = await read(puller, 300)
        assert [int(m.data) for m in got] == list(range(300))  # in order, none twice
        assert puller.pull_requests <= 300 // 32 + 2  # not one per message (or per fetch)


async def test_batches_never_exceed_the_batch_size(bus):
    async with reading(bus, batch=8) as puller:
        for i in range(50):
            await bus.js.publish("pulltest.x", str(i).encode())
        sizes = []
        while sum(sizes) < 50:
            batch = await puller.next_batch(timeout=5)
            assert batch
            sizes.append(len(batch))
            for m in batch:
                await m.ack()
        assert max(sizes) <= 8 and sum(sizes) == 50


async def test_an_idle_reader_asks_again_after_its_requests_expire(bus):
    async with reading(bus, batch=4, expires_s=0.5, heartbeat_s=0.2) as puller:
        assert await puller.next_batch(timeout=1.6) == []  # nothing to read: [] after the timeout
        assert puller.pull_requests >= 2  # expired requests (408) were replaced
        await bus.js.publish("pulltest.x", b"late")
        got = await read(puller, 1)
        assert got[0].data == b"late"


async def test_reading_goes_on_after_the_consumer_is_deleted_and_created_again(bus):
    async with reading(bus, batch=16, heartbeat_s=0.2) as puller:
        await bus.js.publish("pulltest.x", b"1")
        await read(puller, 1)
        await bus.js.delete_consumer(STREAM, "reader")  # its waiting requests end with a 409
        await bus.js.add_consumer(STREAM, api.ConsumerConfig(durable_name="reader",
                                                             ack_policy=api.AckPolicy.EXPLICIT,
                                                             deliver_policy=api.DeliverPolicy.NEW))
        await bus.js.publish("pulltest.x", b"2")
        got = await read(puller, 1)
        assert got[0].data == b"2"


async def test_reading_goes_on_across_a_server_crash_and_restart(tmp_path):
    """The restarted server has forgotten every pull request: the reader notices the silence
    (no message, no heartbeat for two heartbeat periods) and asks again."""
    server = EmbeddedServer(port=free_port(), data_dir=tmp_path / "data").start()
    bus = await Bus.connect(server.url, name="puller-restart")
    try:
        await bus.js.add_stream(api.StreamConfig(name=STREAM, subjects=["pulltest.>"]))  # file: survives
        await bus.js.add_consumer(STREAM, api.ConsumerConfig(durable_name="reader", ack_policy=api.AckPolicy.EXPLICIT))
        puller = Puller(bus.nc, STREAM, "reader", batch=16, heartbeat_s=0.3)
        await puller.start()
        await bus.js.publish("pulltest.x", b"before")
        assert (await read(puller, 1))[0].data == b"before"
        loop = asyncio.get_running_loop()
        server.proc.kill()  # a crash: nothing tells the reader its requests are gone
        await loop.run_in_executor(None, server.proc.wait)
        await loop.run_in_executor(None, server.start)
        await bus.jpublish("pulltest.x", b"after")  # retried until the server is back
        # the crash may have lost the ack of "before" (acks are not awaited): then it comes again
        # first, as at-least-once delivery allows; "after" must come too
        seen = [m.data for m in await read(puller, 1, timeout=15)]  # a batch: one message or both
        if b"after" not in seen:
            seen += [m.data for m in await read(puller, 1, timeout=15)]
        assert seen[-1] == b"after" and set(seen[:-1]) <= {b"before"}, seen
        await puller.stop()
    finally:
        await bus.close()
        server.stop()


async def test_a_consumer_started_while_the_server_is_down_binds_once_it_is_back(tmp_path):
    """A service starting while its cluster elects leaders gets timeouts on the consumer's
    creation: ``Bus.consume`` retries them instead of failing the service's start (a router once
    exited this way in the chaos run). The outage is longer than one JetStream API timeout (5 s)."""
    server = EmbeddedServer(port=free_port(), data_dir=tmp_path / "data").start()
    bus = await Bus.connect(server.url, name="bind-retry")
    got: list[bytes] = []

    async def handler(d) -> None:
        got.append(d.data)
        await d.ack()

    try:
        await bus.js.add_stream(api.StreamConfig(name=STREAM, subjects=["pulltest.>"]))  # file: survives
        loop = asyncio.get_running_loop()
        server.proc.kill()
        await loop.run_in_executor(None, server.proc.wait)
        starting = asyncio.create_task(bus.consume(ConsumerSpec(STREAM, "late"), handler, "test"))
        await asyncio.sleep(6.5)
        assert not starting.done()  # still retrying, not failed
        await loop.run_in_executor(None, server.start)
        await asyncio.wait_for(starting, 30)
        await bus.jpublish("pulltest.x", b"after")
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.1)
        assert got == [b"after"]
    finally:
        await bus.close()
        server.stop()
