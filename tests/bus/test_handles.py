"""The handles the transport gives services (bus.kv, bus.stream, bus.inbox): natsched errors, not nats ones."""

import asyncio
import time

import pytest

from natsched.bus.errors import BusTimeout, ConflictError, ReadError, StreamNotFound
from natsched.wire import subjects as S


async def test_a_kv_handle_reads_writes_and_compares_and_swaps(bus):
    kv = bus.kv(S.BUCKET_QUOTAS)
    assert kv is bus.kv(S.BUCKET_QUOTAS)  # one per bucket and connection
    assert await kv.get("t1") is None
    rev = await kv.create("t1", b"a")
    with pytest.raises(ConflictError, match="already exists"):
        await kv.create("t1", b"b")
    with pytest.raises(ConflictError, match="changed since revision"):
        await kv.update("t1", b"c", rev + 100)
    rev2 = await kv.update("t1", b"c", rev)
    assert await kv.get("t1") == (b"c", rev2)
    assert await kv.keys() == ["t1"] and await kv.last_operation("t1") == "PUT"
    await kv.put("t2", b"x")
    assert {k: v for k, v in [e async for e in kv.entries()]} == {"t1": b"c", "t2": b"x"}
    assert await kv.snapshot() == {"t1": (b"c", rev2), "t2": (b"x", rev2 + 1)}
    await kv.delete("t1", last=rev2)
    assert await kv.get("t1") is None and await kv.last_operation("t1") == "DEL"
    assert [k async for k, _ in kv.entries()] == ["t2"]


async def test_a_kv_watch_gives_the_current_values_then_changes(bus):
    kv = bus.kv(S.BUCKET_CONFIG)
    await kv.put("a", b"1")
    ready = asyncio.Event()
    seen: asyncio.Queue = asyncio.Queue()

    async def watch():
        async for change in kv.watch(ready=ready):
            await seen.put(change)

    task = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(ready.wait(), 10)
        await kv.delete("a")
        first, second = await asyncio.wait_for(seen.get(), 10), await asyncio.wait_for(seen.get(), 10)
        assert (first[0], first[1], second[0], second[1]) == ("a", b"1", "a", None)
    finally:
        task.cancel()


async def test_a_missing_bucket_or_stream_is_a_natsched_error(bus):
    with pytest.raises(StreamNotFound, match="bucket nope does not exist"):
        await bus.kv("nope").get("k")
    for read in (bus.stream("NOPE").info(), bus.stream("NOPE").retention(), bus.stream("NOPE").tail(5)):
        with pytest.raises(StreamNotFound, match="stream NOPE does not exist"):
            await read
    with pytest.raises(StreamNotFound):
        [m async for m in bus.stream("NOPE").window(time.time() - 60)]
    with pytest.raises(StreamNotFound):
        [m async for m in bus.stream("NOPE").filtered("x.>")]
    with pytest.raises(StreamNotFound, match="no consumer"):
        await bus.stream(S.STREAM_REQUESTS).consumer("nobody")
    assert issubclass(StreamNotFound, ReadError)


async def test_a_stream_reads_by_window_sequence_subject_and_tail(bus):
    before = time.time() - 1
    for i in range(5):
        await bus.jpublish(S.request(S.ONLINE, "t1" if i % 2 else "t2"), f"m{i}".encode(), msg_id=f"r{i}:adm")
    reader = bus.stream(S.STREAM_REQUESTS)
    info = await reader.info()
    assert (info.name, info.messages, info.first_seq, info.last_seq, info.replicas) == (S.STREAM_REQUESTS, 5, 1, 5, 1)
    assert [m.data async for m in reader.window(before)] == [b"m0", b"m1", b"m2", b"m3", b"m4"]
    assert [m.data async for m in reader.window(before, subject=S.request(S.ONLINE, "t1"))] == [b"m1", b"m3"]
    assert [m.data async for m in reader.window(before, headers_only=True)] == [b""] * 5
    assert (await reader.get(3)).data == b"m2" and await reader.get(99) is None
    found = await reader.find(lambda msg_id: msg_id in ("r1:adm", "r4:adm"), before)
    assert [(m.data, m.msg_id, m.seq) for m in found] == [(b"m1", "r1:adm", 2), (b"m4", "r4:adm", 5)]
    assert [m.data async for m in reader.filtered(S.request(S.ONLINE, "t2"))] == [b"m0", b"m2", b"m4"]
    last = [m.data async for m in reader.filtered(S.REQUESTS_ALL, last_per_subject=True)]
    assert sorted(last) == [b"m3", b"m4"]  # the newest of each tenant's subject
    assert await reader.tail(2) == [b"m3", b"m4"] and await reader.tail(0) == []
    kept = await reader.retention()
    assert (kept.messages, kept.first_seq, kept.lost_some) == (5, 1, False) and kept.first_ts >= before
    assert kept.describe() == "REQUESTS keeps messages for 7d and at most 1 GiB"


async def test_an_inbox_and_a_request_time_out_with_a_natsched_error(bus):
    inbox = await bus.inbox("resp.handles-test")
    try:
        with pytest.raises(BusTimeout, match="nothing on resp.handles-test"):
            await inbox.next_msg(timeout=0.2)
        await bus.publish("resp.handles-test", b"hi", headers={"k": "v"})
        got = await inbox.next_msg(timeout=5)
        assert (got.subject, got.data, got.headers) == ("resp.handles-test", b"hi", {"k": "v"})
    finally:
        await inbox.unsubscribe()

    async def upper(data: bytes) -> bytes:
        return data.upper()

    echo = await bus.respond("handles.echo", upper)
    try:
        assert await bus.request("handles.echo", b"abc", timeout=5) == b"ABC"
    finally:
        await echo.unsubscribe()
    await bus.flush()
    with pytest.raises(BusTimeout):  # nobody answers: nats says "no responders", we say no answer
        await bus.request("handles.nobody", b"", timeout=0.5)
    assert isinstance(BusTimeout("x"), TimeoutError) and bus.connected and not bus.closed
