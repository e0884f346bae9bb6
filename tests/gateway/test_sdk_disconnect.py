"""Streams whose clients leave: the official ``openai`` SDK against the gateway, real sim workers
decoding in real time on a real nats-server.

The case that lost cancels: 40 concurrent SSE streams whose clients close after the first chunk
(and 20 clients that leave while their request is still queued in the admitter). Before the
cancel path was fixed, 2-98 % of such streams went on generating thousands of tokens for nobody
(Python 3.11's ``wait_for`` swallowed the gateway's one cancel) and queued ones had no cancel at
all. Now every one ends ``cancelled`` well short of its ``max_tokens``, and no reservation is left.
"""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest

from natsched.wire import subjects as S
from natsched.wire.schema import Completion, Decision
from tests.factories.core import wait_for
from tests.factories.gateway import ALPHA, gateway_over_stack

LONG = 3000
STREAMS = 40


@pytest.fixture
async def cluster(bus, nats_url):
    async with gateway_over_stack(nats_url, max_per_key=1000) as both:
        yield both


def sdk(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ALPHA, max_retries=0)


async def completions(bus) -> dict[str, Completion]:
    return {c.request_id: c for c in (Completion.decode(d) for _, d in
                                      await bus.stream_messages(S.STREAM_COMPLETIONS))}


async def first_chunk_then_leave(client: openai.AsyncOpenAI, i: int) -> str:
    raw = await client.chat.completions.with_streaming_response.create(
        model="default", max_tokens=LONG, stream=True,
        messages=[{"role": "user", "content": f"tell me a long story number {i}"}]).__aenter__()
    rid = raw.headers["x-request-id"]
    async for line in raw.iter_lines():
        if line.startswith("data: "):
            break  # the first chunk: the client is gone
    await raw.close()
    return rid


async def test_forty_streams_closed_after_their_first_chunk_all_stop(cluster, bus):
    stack, gw = cluster
    client = sdk(gw)
    rids = await asyncio.gather(*(first_chunk_then_leave(client, i) for i in range(STREAMS)))
    assert await wait_for(lambda: not any(w.inflight for w in stack.workers), timeout=60)
    assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)
    done = await completions(bus)
    outcomes = [(done[r].status, done[r].reason) for r in rids]
    assert outcomes == [("error", "cancelled")] * STREAMS
    wasted = sum(done[r].output_tokens for r in rids)
    assert all(done[r].output_tokens < LONG for r in rids), wasted
    assert gw.gateway.metrics.registry.get_sample_value("natsched_gateway_cancelled_total",
                                                        {"reason": "disconnect"}) == STREAMS


async def test_clients_that_leave_while_queued_never_run(cluster, bus):
    stack, gw = cluster
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(4000))  # one long request at a time
    assert await wait_for(lambda: stack.admitter.total == 4000)
    client = sdk(gw)
    hog = asyncio.create_task(client.completions.create(model="default", prompt="hog", max_tokens=LONG))
    assert await wait_for(lambda: any(w.inflight for w in stack.workers))
    waiting = [asyncio.create_task(client.completions.create(model="default", prompt=f"w{i}", max_tokens=LONG))
               for i in range(20)]
    assert await wait_for(lambda: len(stack.admitter.held) == 20)
    queued = set(stack.admitter.held)
    for task in waiting:  # the clients give up: their HTTP connections close
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert await wait_for(lambda: not stack.admitter.held and stack.admitter.core.queued() == 0)
    hog.cancel()
    await asyncio.gather(hog, return_exceptions=True)
    assert await wait_for(lambda: not any(w.inflight for w in stack.workers))
    assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)
    done = await completions(bus)
    assert not queued & set(done)  # none of them was ever admitted, so none ran
    last = {}
    for _, data in await bus.stream_messages(S.STREAM_DECISIONS):
        d = Decision.decode(data)
        if d.request_id in queued and d.stage == "admission":
            last[d.request_id] = (d.decision, d.reason)
    assert set(last.values()) == {("reject", "cancelled")} and len(last) == 20
