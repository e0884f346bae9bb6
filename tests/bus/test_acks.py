"""Publish acks on one shared inbox (bus/acks.py) and Bus.jpublish_batch, on a real nats-server."""

from __future__ import annotations

import asyncio

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from prometheus_client import CollectorRegistry, generate_latest

from natsched.bus.acks import AckInbox
from natsched.bus import connection
from natsched.bus.connection import Bus, Stored
from natsched.bus.errors import BusTimeout, PublishRefused
from natsched.bus.metrics import watch
from tests.factories.core import wait_for

STREAM = "ACKTEST"


@pytest.fixture
async def stream(bus):
    await bus.js.add_stream(api.StreamConfig(name=STREAM, subjects=["acktest.>"], storage=api.StorageType.MEMORY))
    try:
        yield STREAM
    finally:
        await bus.js.delete_stream(STREAM)


async def test_a_batch_is_stored_in_order_and_each_publish_gets_its_own_ack(bus, stream):
    items = [(f"acktest.{i % 2}", str(i).encode(), f"id-{i}", None) for i in range(50)]
    acks = await bus.jpublish_batch(items)
    assert [a.seq for a in acks] == list(range(1, 51))
    assert not any(a.duplicate for a in acks)
    stored = await bus.stream_messages(STREAM)
    assert [int(data) for _, data in stored] == list(range(50))


async def test_a_batch_sent_again_is_deduplicated_by_msg_id(bus, stream):
    items = [("acktest.x", b"a", "same-1", None), ("acktest.x", b"b", "same-2", {"X-Extra": "1"})]
    await bus.jpublish_batch(items)
    again = await bus.jpublish_batch(items)
    assert all(a.duplicate for a in again)
    assert len(await bus.stream_messages(STREAM)) == 2


async def test_a_refused_publish_in_a_batch_raises_the_servers_error(bus, stream):
    await bus.jpublish("acktest.k", b"v1")
    wrong = {"Nats-Expected-Last-Subject-Sequence": "999"}
    with pytest.raises(PublishRefused) as refused:  # the transport's own error, with the server's code
        await bus.jpublish_batch([("acktest.ok", b"fine", None, None), ("acktest.k", b"v2", None, wrong)])
    assert refused.value.err_code == 10071 and "acktest.k" in str(refused.value)
    subjects = [s for s, _ in await bus.stream_messages(STREAM)]
    assert subjects == ["acktest.k", "acktest.ok"]  # the good one is stored, the refused one is not


async def test_a_publish_nothing_stores_fails_after_the_budget(nats_url):
    bus = await Bus.connect(nats_url, name="acks-budget", publish_budget_s=0.6)
    try:
        with pytest.raises(BusTimeout, match="nostream.anywhere"):  # retried until the budget is spent
            await bus.jpublish_batch([("nostream.anywhere", b"x", "n-1", None)])
    finally:
        await bus.close()


async def test_a_record_is_retried_past_the_publish_budget_until_a_stream_can_store_it(nats_url):
    """An audit record sent while nothing can store it (a leader election, here: no stream yet)
    is retried in the background beyond the publish budget, and stored once, not lost."""
    bus = await Bus.connect(nats_url, name="acks-record", publish_budget_s=0.3)
    bus.record_budget_s = 60
    try:
        await bus.jpublish_nowait("acklate.x", b"record", msg_id="late-1")
        await asyncio.sleep(1.0)  # the outage outlasts the publish budget (the condition, not a check)
        await bus.js.add_stream(api.StreamConfig(name="ACKLATE", subjects=["acklate.>"],
                                                 storage=api.StorageType.MEMORY))
        try:
            assert await wait_for(lambda: bus.records_retrying == 0, timeout=30)
            assert await bus.stream_messages("ACKLATE") == [("acklate.x", b"record")]
            assert bus.lost_publishes == 0
        finally:
            await bus.js.delete_stream("ACKLATE")
    finally:
        await bus.close()


async def test_a_record_nothing_stores_within_its_budget_is_counted_lost(nats_url, caplog):
    bus = await Bus.connect(nats_url, name="acks-record-lost", publish_budget_s=0.3)
    bus.record_budget_s = 0.5
    try:
        await bus.jpublish_nowait("nostream.record", b"record", msg_id="lost-1")
        assert await wait_for(lambda: bus.lost_publishes == 1, timeout=30)
        assert "publish to nostream.record lost" in caplog.text
        registry = CollectorRegistry()
        watch(registry, bus)
        watch(registry, bus)  # idempotent: an admitter and its inline router share both
        text = generate_latest(registry).decode()
        assert 'natsched_bus_records_lost_total{connection="acks-record-lost"} 1.0' in text
        assert 'natsched_bus_records_retrying{connection="acks-record-lost"} 0.0' in text
    finally:
        await bus.close()


async def test_records_beyond_the_retry_cap_are_counted_lost_at_once(nats_url, monkeypatch):
    monkeypatch.setattr(connection, "MAX_RECORD_RETRIES", 1)
    bus = await Bus.connect(nats_url, name="acks-record-cap", publish_budget_s=0.3)
    bus.record_budget_s = 60
    try:
        await bus.jpublish_nowait("nostream.capped", b"a", msg_id="cap-1")
        await bus.jpublish_nowait("nostream.capped", b"b", msg_id="cap-2")
        assert await wait_for(lambda: bus.lost_publishes == 1, timeout=30)  # the second, at once
        assert bus.records_retrying == 1  # the first is still being retried
        registry = CollectorRegistry()
        watch(registry, bus)
        assert registry.get_sample_value("natsched_bus_records_retrying", {"connection": "acks-record-cap"}) == 1
        assert registry.get_sample_value("natsched_bus_records_lost_total", {"connection": "acks-record-cap"}) == 1
    finally:
        await bus.close()


async def test_acks_that_never_come_fail_at_the_sweep_and_nothing_is_kept(bus):
    silent = await bus.nc.subscribe("acktest-silent.x")  # takes the message, never answers
    inbox = AckInbox(bus.nc, timeout_s=0.2)
    await inbox.start()
    try:
        futures = [await inbox.publish("acktest-silent.x", b"x", None) for _ in range(3)]
        assert inbox.sweep() == 0  # too young
        await asyncio.sleep(0.3)
        assert inbox.sweep() == 3
        for f in futures:
            with pytest.raises(NatsTimeout):
                f.result()
        assert not inbox._waiting  # bounded: nothing waits forever
    finally:
        await silent.unsubscribe()


async def test_no_responders_is_reported_at_once(bus):
    inbox = AckInbox(bus.nc, timeout_s=5.0)
    await inbox.start()
    future = await inbox.publish("nobody.listens.here", b"x", None)
    with pytest.raises(NoRespondersError):
        await asyncio.wait_for(future, 2.0)


async def test_an_ack_with_more_than_a_plain_publishs_fields_is_read_whole(bus):
    """The common ack (stream, seq, duplicate) is built directly; any other field a server adds
    (counters' ``val``, batches) goes through nats-py's own reader, so nothing is dropped."""
    inbox = AckInbox(bus.nc)
    await inbox.start()
    sink = await bus.nc.subscribe("acktest.sink")  # someone listens, so the server says nothing itself
    plain = await inbox.publish("acktest.sink", b"x", None)
    other = await inbox.publish("acktest.sink", b"x", None)
    token = lambda f: next(t for t, (fut, _) in inbox._waiting.items() if fut is f)  # noqa: E731
    for future, body in ((plain, b'{"stream":"S","seq":7,"duplicate":true}'),
                         (other, b'{"stream":"S","seq":8,"val":"12"}')):
        await bus.nc.publish(inbox._prefix + token(future), body)
    assert (await plain).seq == 7 and (await plain).duplicate is True
    assert (await other).seq == 8 and (await other).val == "12"
    await sink.unsubscribe()


async def test_a_create_only_publish_in_a_batch_on_a_taken_subject_gets_none(bus, stream):
    from natsched.bus.connection import CREATE_ONLY

    await bus.jpublish("acktest.k", b"v1")
    acks = await bus.jpublish_batch([("acktest.new", b"a", None, CREATE_ONLY), ("acktest.k", b"v2", None, CREATE_ONLY)])
    assert acks[0] is not None and acks[1] is None
    assert sorted(s for s, _ in await bus.stream_messages(STREAM)) == ["acktest.k", "acktest.new"]


async def test_jpublish_answers_with_the_transports_own_ack(bus, stream):
    first = await bus.jpublish("acktest.own", b"v", msg_id="own-1")
    again = await bus.jpublish("acktest.own", b"v", msg_id="own-1")
    assert isinstance(first, Stored) and (first.stream, first.duplicate) == (STREAM, False)
    assert (again.seq, again.duplicate) == (first.seq, True)  # someone else's copy: the same message
