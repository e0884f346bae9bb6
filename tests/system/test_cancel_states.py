"""A cancel reaches a request in every state it can be in, and only its own tenant's cancel does.

Real nats-server, admitter, router and sim workers (``tests.factories.stack``); the cancel is the
producer's ``cancel.<tenant>.<id>``. States: queued in the admitter, cancelled before the admitter
saw it, admitted but waiting for a worker (not routed), running. Each ends with reason
``cancelled`` and holds no reservation afterwards; a cancel by another tenant changes nothing.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from natsched.client.errors import Rejected, RequestFailed
from natsched.client.producer import make_request
from natsched.wire import subjects as S
from natsched.wire.schema import Completion, Control, Decision, Reply
from tests.factories.core import wait_for
from tests.factories.stack import start_stack

LONG = 4000


async def set_quotas(bus, **entries):
    for key, value in entries.items():
        await bus.kv(S.BUCKET_QUOTAS).put(key.replace("__", "."), orjson.dumps(value))


async def records(bus, stream, schema):
    return [schema.decode(d) for _, d in await bus.stream_messages(stream)]


async def test_a_queued_request_leaves_the_queue_on_cancel_and_never_runs(bus, nats_url):
    await set_quotas(bus, cluster__total=6_000)
    stack = await start_stack(nats_url, workers=1, time_scale=1.0)
    try:
        running = make_request("t1", "fills the cluster", max_tokens=LONG)
        first = asyncio.create_task(stack.client.submit(running))
        assert await wait_for(lambda: running.id in stack.workers[0].inflight)
        queued = make_request("t1", "has to wait", max_tokens=LONG)
        second = asyncio.create_task(stack.client.submit(queued))
        assert await wait_for(lambda: queued.id in stack.admitter.held)
        await stack.client.cancel("t1", queued.id)
        with pytest.raises(Rejected) as err:
            await second
        assert err.value.reason == "cancelled"
        assert queued.id not in stack.admitter.held and stack.admitter.core.queued() == 0
        first.cancel()  # leaving the submit cancels the running one too (the producer's finally)
        assert await wait_for(lambda: not stack.workers[0].inflight)
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)
        dec = [d for d in await records(bus, S.STREAM_DECISIONS, Decision) if d.request_id == queued.id]
        assert [(d.decision, d.reason) for d in dec if d.stage == "admission"][-1] == ("reject", "cancelled")
        assert not [d for d in dec if d.stage == "routing"]  # it never reached a router
        done = {c.request_id: c for c in await records(bus, S.STREAM_COMPLETIONS, Completion)}
        assert queued.id not in done  # never admitted: nothing to release
        assert (done[running.id].status, done[running.id].reason) == ("error", "cancelled")
    finally:
        await stack.close()


async def test_a_cancel_that_overtakes_its_request_refuses_it_at_the_admitter(bus, nats_url):
    stack = await start_stack(nats_url, workers=1)
    try:
        req = make_request("t1", "never wanted", max_tokens=LONG)
        await stack.client.cancel("t1", req.id)
        assert await wait_for(lambda: S.cancel("t1", req.id) in stack.admitter.cancelled)
        with pytest.raises(Rejected) as err:
            await stack.client.submit(req)
        assert err.value.reason == "cancelled"
        assert stack.admitter.shared.usage.used == 0 and not stack.workers[0].inflight
    finally:
        await stack.close()


async def test_an_admitted_request_waiting_for_a_worker_is_failed_by_the_router(bus, nats_url):
    stack = await start_stack(nats_url, workers=1, no_worker_wait_s=60)
    try:
        await stack.client.bus.publish(S.control("w1"), Control(kind="drain", by="test"))  # no healthy worker
        assert await wait_for(lambda: str(stack.router.core.registry.state("w1", time.time())) != "healthy")
        req = make_request("t1", "nobody can take it", max_tokens=LONG)
        sub = await stack.client.bus.inbox(S.tenant_reply("t1", req.id))
        task = asyncio.create_task(stack.client.submit(req))
        admitted = None
        while admitted is None:  # admitted, then held by the router (no healthy worker)
            reply = Reply.decode((await sub.next_msg(timeout=10)).data)
            admitted = reply if reply.status == "admitted" else None
        assert stack.admitter.shared.usage.used > 0
        await stack.client.cancel("t1", req.id)
        with pytest.raises(RequestFailed) as err:
            await task
        assert err.value.reason == "cancelled"
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)  # the router's completion released it
        done = {c.request_id: c for c in await records(bus, S.STREAM_COMPLETIONS, Completion)}
        assert (done[req.id].reason, done[req.id].worker) == ("cancelled", S.ROUTER_SOURCE)  # the router fails it: its own completion subject
        await sub.unsubscribe()
    finally:
        await stack.close()


async def test_another_tenants_cancel_changes_nothing(bus, nats_url):
    stack = await start_stack(nats_url, workers=1, time_scale=1.0)
    try:
        req = make_request("t1", "mine", max_tokens=40)
        stream = stack.client.stream(req).__aiter__()
        await stream.__anext__()  # running
        # t1's very id under t2's subject (a client would scope it into t2's own: another id)
        for _ in range(2):
            await stack.client.bus.publish(S.cancel("t2", req.id), Control(kind="cancel", ts=time.time(),
                                                                            request_id=req.id))
        chunks = [c async for c in stream]
        assert len(chunks) >= 1
        done = {c.request_id: c for c in await records(bus, S.STREAM_COMPLETIONS, Completion)}
        assert done[req.id].status == "ok" and done[req.id].output_tokens == 40
        assert stack.workers[0].metrics.cancels_refused._value.get() == 2
    finally:
        await stack.close()


async def test_a_cancelled_stream_records_the_tokens_it_really_produced(bus, nats_url):
    stack = await start_stack(nats_url, workers=1, time_scale=1.0)
    try:
        req = make_request("t1", "stream a while", max_tokens=LONG)
        stream = stack.client.stream(req).__aiter__()
        got = 0
        while got < 5:
            await stream.__anext__()
            got += 1
        await stream.aclose()
        assert await wait_for(lambda: not stack.workers[0].inflight)
        done = {c.request_id: c for c in await records(bus, S.STREAM_COMPLETIONS, Completion)}
        c = done[req.id]
        assert c.reason == "cancelled"
        assert 5 <= c.output_tokens < LONG and c.prompt_tokens > 0
    finally:
        await stack.close()
