"""The gateway in front of a real vLLM worker (CPU, the tiny dummy-weights model): one engine start."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from natsched.wire import subjects as S
from natsched.wire.schema import Completion
from tests.factories.gateway import ALPHA, start_gateway
from tests.gateway.test_cancel import post
from tests.factories.stack import start_stack
from natsched.workers.tiny_model import LIVE_LAYERS, write_tiny_model
from natsched.hosting.vllm_worker import VllmWorkerProcess

# no skip when vLLM is missing: CI installs the cpu extra, and a missing engine must fail loudly
pytestmark = pytest.mark.vllm

MODEL = "tiny-gw"
#: the request the client hangs up on: long enough that the worker is still generating it well
#: after the gateway noticed (this VM has kept the test process from running for up to 30 s); on
#: the LIVE_LAYERS model 6,000 tokens take ~90 s (2 layers made 4,000 before a cancel arrived)
LONG = 6_000


async def test_openai_sdk_through_the_gateway_to_a_vllm_worker(bus, nats_url, tmp_path):
    # before the stack: training the tokenizer holds this process's loop (the admitter saw a 10.6 s
    # pause beside two CPU hogs, and the router called the new worker stale)
    # a tokenizer for text prompts (the chat template's output); LIVE_LAYERS, as with 2 layers a
    # loaded machine saw the worker's heartbeats stop for 101 s while it generated
    path = write_tiny_model(tmp_path / "tiny", tokenizer=True, layers=LIVE_LAYERS)
    stack = await start_stack(nats_url, workers=0)
    proc = VllmWorkerProcess(nats_url, "gv1", path, model=MODEL, max_model_len=LONG + 64, kv_cache_blocks=LONG // 16 + 64,
                             concurrency=4, heartbeat=1.0).start()
    gw = None
    try:
        await proc.await_ready(240)
        gw = await start_gateway(nats_url)
        await gw.wait_for_workers(1)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ALPHA, max_retries=0)
        (entry,) = [m.to_dict() for m in (await client.models.list()).data]
        assert entry["id"] == MODEL and entry["max_model_len"] == LONG + 64  # the engine's, as vllm serve lists it
        assert entry["root"] == str(path) and entry["owned_by"] == "vllm" and entry["parent"] is None

        system = "You answer questions about the routing cache of this knowledge base. " * 3
        reply = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "which worker holds the prefix?"}])
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        assert reply.system_fingerprint == "gv1" and reply.choices[0].message.content

        stream = await client.chat.completions.create(model=MODEL, max_tokens=6, stream=True,
                                                      stream_options={"include_usage": True}, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "and the next question?"}])
        chunks = [c async for c in stream]
        assert chunks[-1].usage.completion_tokens == 6
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 32  # the system prompt's blocks, reused

        # a client that hangs up mid-stream: vLLM stops generating it. Completions are watched with
        # a subscription, not stream reads: on this 2-core machine a busy vLLM engine can keep the
        # test process from running for seconds, after which a pending read times out at once
        done: list[Completion] = []

        async def on_done(subject: str, data: bytes, headers: dict) -> None:
            done.append(Completion.decode(data))

        await bus.subscribe(S.COMPLETIONS_ALL, on_done)
        reader, writer = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "tell me everything",
                                                             "max_tokens": LONG, "stream": True})
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        await reader.readuntil(b"data: ")  # it is generating
        writer.close()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(c.reason == "cancelled" or c.output_tokens == LONG for c in done):
            await asyncio.sleep(0.2)
        cancelled = [c for c in done if c.reason == "cancelled"]
        assert len(cancelled) == 1 and cancelled[0].worker == "gv1", (
            [(c.status, c.reason, c.output_tokens) for c in done], proc.tail())
    finally:
        if gw is not None:
            await gw.close()
        proc.stop()
        await stack.close()
