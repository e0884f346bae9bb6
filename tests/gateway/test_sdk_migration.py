"""A stream outlives its worker: the official ``openai`` SDK streams through the gateway while
the worker decoding it is killed with SIGKILL (real ``natsched worker`` processes, real-time sim
decode, a real nats-server).

The gateway's producer migrates the stream (``natsched.client.producer.Migration``): the SDK's
stream goes on from the other worker after the tokens it already has, none repeated, and ends
normally with the whole answer and its usage.
"""

from __future__ import annotations

import contextlib
import os
import signal

import openai
import pytest

from natsched.client.producer import Timeouts
from tests.factories.core import wait_for
from tests.factories.gateway import ALPHA, start_gateway
from tests.factories.stack import start_stack, start_worker, stop_workers

N = 600  # ~4 s of real-time decode: the kill lands mid-stream even when the reader lags


async def read_killing_after_25(stack, procs, gw):
    """Stream N tokens through the SDK; SIGKILL the worker running it after 25 chunks."""
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ALPHA, max_retries=0)
    stream = await client.completions.create(model="default", prompt="tell it all " * 6, max_tokens=N,
                                             stream=True, stream_options={"include_usage": True})
    texts, usage, killed = [], None, None
    async for chunk in stream:
        texts += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
        if len(texts) == 25 and killed is None:
            leases = stack.admitter.leases.workers
            assert await wait_for(lambda: any(lease.inflight for lease in leases.values()))
            killed = next(w for w, lease in leases.items() if lease.inflight)
            os.kill(procs[killed].pid, signal.SIGKILL)
    assert killed is not None
    return texts, usage, killed


@contextlib.asynccontextmanager
async def killable_cluster(nats_url, **gateway_settings):
    """A stack with two real worker processes, and a gateway that has seen both."""
    stack = await start_stack(nats_url, workers=0, timeouts=Timeouts(admission=20, idle=30))
    procs = {w: start_worker(nats_url, w) for w in ("wa", "wb")}
    gw = await start_gateway(nats_url, **gateway_settings)
    try:
        await gw.wait_for_workers(2)
        yield stack, procs, gw
    finally:
        await gw.close()
        stop_workers(procs.values())
        await stack.close()


def migrations_counted(gw):
    return gw.gateway.metrics.registry.get_sample_value("natsched_gateway_stream_migrations_total",
                                                        {"tenant": "alpha"})


async def test_an_sdk_stream_goes_on_when_its_worker_is_killed_mid_stream(bus, nats_url):
    async with killable_cluster(nats_url) as (stack, procs, gw):
        texts, usage, killed = await read_killing_after_25(stack, procs, gw)
        assert "".join(texts) == "".join(f" tok{i}" for i in range(N))  # every token once, in order
        assert usage is not None and usage.completion_tokens == N
        assert migrations_counted(gw) == 1
        assert procs["wb" if killed == "wa" else "wa"].poll() is None  # the survivor finished it
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0, timeout=10)  # nothing leaked


async def test_with_stream_migrations_off_the_sdk_stream_ends_with_an_error(bus, nats_url):
    """``--stream-migrations 0``: the stream cannot go on, and the SDK is told so, not given a
    restart of the answer it already has half of."""
    async with killable_cluster(nats_url, stream_migrations=0) as (stack, procs, gw):
        with pytest.raises(openai.APIError, match="worker_lost"):
            await read_killing_after_25(stack, procs, gw)
        assert migrations_counted(gw) is None
