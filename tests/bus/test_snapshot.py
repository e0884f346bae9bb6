"""The paced KV read (bus/snapshot.py) on a real nats-server: every live key once, deleted and
purged keys left out, over many windows; and the server holding back what the reader has not
acknowledged, which is what keeps a long read from stalling the reader's other messages."""

from __future__ import annotations

import asyncio

from natsched.bus.snapshot import read_kv, windowed_consumer

BUCKET = "snaptest"


async def fill(bus, live: int, deleted: int, purged: int) -> dict[str, int]:
    """``live`` keys written (some twice), ``deleted`` deleted and ``purged`` purged ones; returns
    each live key's revision."""
    kv = await bus.js.create_key_value(bucket=BUCKET, history=1)
    revisions = {}
    for i in range(live):
        revisions[f"k.{i}"] = await kv.put(f"k.{i}", f"v{i}".encode())
        if i % 3 == 0:  # rewritten: its last value counts
            revisions[f"k.{i}"] = await kv.put(f"k.{i}", f"w{i}".encode())
    for i in range(deleted):
        await kv.put(f"d.{i}", b"x")
        await kv.delete(f"d.{i}")
    for i in range(purged):
        await kv.put(f"p.{i}", b"x")
        await kv.purge(f"p.{i}")
    return revisions


async def test_every_live_key_once_with_its_revision_across_many_windows(bus):
    revisions = await fill(bus, live=70, deleted=25, purged=25)
    try:
        got = await read_kv(bus.nc, bus.js, BUCKET, window=8)
        assert {k: rev for k, (_, rev) in got.items()} == revisions
        assert got["k.3"][0] == b"w3" and got["k.4"][0] == b"v4"
        assert set(await read_kv(bus.nc, bus.js, BUCKET, "k.1", window=8)) == {"k.1"}
        assert await read_kv(bus.nc, bus.js, BUCKET, "nothing.>", window=8) == {}
        # nothing left behind on the server: each read removes its consumer
        assert [c async for c in _consumers(bus)] == []
    finally:
        await bus.js.delete_key_value(BUCKET)


async def test_the_server_sends_no_more_than_a_window_ahead_of_the_readers_acks(bus):
    await fill(bus, live=40, deleted=0, purged=0)
    got: list = []

    async def on(msg):
        got.append(msg)

    sub = await bus.nc.subscribe(bus.nc.new_inbox(), cb=on)
    config = windowed_consumer(BUCKET, ">", sub.subject, window=8)
    try:
        await bus.js.add_consumer(f"KV_{BUCKET}", config)
        await asyncio.sleep(0.5)
        assert len(got) == 8  # 32 more are pending, held back until an ack
        await got[3].ack()  # "all": the first four are acknowledged, four more may come
        await asyncio.sleep(0.5)
        assert len(got) == 12
    finally:
        await sub.unsubscribe()
        await bus.js.delete_key_value(BUCKET)


async def _consumers(bus):
    for info in await bus.js.consumers_info(f"KV_{BUCKET}"):
        yield info.name
