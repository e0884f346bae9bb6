"""A client that goes away cancels its request on the worker: the engine stops, the tokens are released."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.wire.ids import scoped
from natsched.client.producer import make_request
from natsched.client.errors import Rejected
from natsched.wire.schema import Completion
from tests.factories.gateway import ALPHA, start_gateway
from tests.factories.stack import start_stack
from tests.factories.core import wait_for

LONG = 4000  # tokens: far longer than the test waits


@pytest.fixture
async def cluster(bus, nats_url):
    stack = await start_stack(nats_url, workers=1, time_scale=1.0)  # real-time decode: ~7 ms a token
    gw = await start_gateway(nats_url)
    await gw.wait_for_workers(1)
    try:
        yield stack, gw
    finally:
        await gw.close()
        await stack.close()


async def post(gw, path: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw HTTP/1.1 POST on its own socket, so the test can hang up whenever it wants."""
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = orjson.dumps(body)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ALPHA}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    return reader, writer


async def completions(bus) -> dict[str, Completion]:
    out = {}
    for _, data in await bus.stream_messages(S.STREAM_COMPLETIONS):
        c = Completion.decode(data)
        out[c.request_id] = c
    return out


def sample(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels or None) or 0.0


async def test_disconnect_mid_stream_cancels_the_request_on_its_worker(cluster, bus):
    stack, gw = cluster
    worker = stack.workers[0]
    reader, writer = await post(gw, "/v1/chat/completions", {
        "model": "default", "max_tokens": LONG, "stream": True, "messages": [{"role": "user", "content": "go on"}]})
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    rid = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
               if line.lower().startswith(b"x-request-id"))
    events = 0
    while events < 3:  # a few tokens arrive: it is running on the worker
        events += (await reader.readuntil(b"\n\n")).count(b"data: ")  # (chunked framing around each)
    assert rid in worker.inflight
    writer.close()  # the client hangs up
    assert await wait_for(lambda: rid not in worker.inflight)
    assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)  # its reservation was released
    done = (await completions(bus))[rid]
    assert (done.status, done.reason) == ("error", "cancelled")
    assert sample(worker.metrics.registry, "natsched_worker_cancelled_total") == 1
    assert sample(gw.gateway.metrics.registry, "natsched_gateway_cancelled_total", reason="disconnect") == 1


async def test_disconnect_while_waiting_for_a_non_streaming_answer_cancels_it_too(cluster, bus):
    stack, gw = cluster
    worker = stack.workers[0]
    _, writer = await post(gw, "/v1/completions", {"model": "default", "prompt": "a long one", "max_tokens": LONG})
    assert await wait_for(lambda: len(worker.inflight) == 1)
    rid = next(iter(worker.inflight))
    writer.close()
    assert await wait_for(lambda: rid not in worker.inflight)
    done = (await completions(bus))[rid]
    assert (done.status, done.reason) == ("error", "cancelled") and done.output_tokens < LONG


async def test_a_cancel_that_arrives_before_the_request_is_remembered(cluster):
    stack, _ = cluster
    await stack.client.cancel("t1", "early1")
    assert await wait_for(lambda: S.cancel("t1", scoped("t1", "early1")) in stack.workers[0].cancelled)  # every service heard it (the id in its scope)
    with pytest.raises(Rejected) as err:  # the admitter refuses it: it never holds a reservation
        await stack.client.submit(make_request("t1", "never run", id="early1", max_tokens=LONG))
    assert err.value.reason == "cancelled"
    assert not stack.workers[0].inflight


async def test_a_producer_that_stops_reading_a_stream_cancels_it(cluster, bus):
    stack, _ = cluster
    request = make_request("t1", "stream", max_tokens=LONG)
    chunks = stack.client.stream(request).__aiter__()
    for _ in range(3):
        await chunks.__anext__()
    await chunks.aclose()  # stopped at a yield: the exchange ends now and tells the worker
    assert await wait_for(lambda: S.cancel("t1", request.id) in stack.workers[0].cancelled)
    assert await wait_for(lambda: not stack.workers[0].inflight)
    done = (await completions(bus))[request.id]
    assert (done.status, done.reason) == ("error", "cancelled")
