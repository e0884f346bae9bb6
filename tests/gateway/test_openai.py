"""The official ``openai`` SDK against the gateway, in front of real sim workers on a real nats-server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest

from natsched.wire import subjects as S
from natsched.wire.schema import Decision
from tests.factories.gateway import ALPHA, start_gateway
from tests.factories.stack import start_stack

SYSTEM = "You are a meticulous assistant who answers about KV caches. " * 24  # ~1.4 kB: several prefix blocks


@pytest.fixture
async def cluster(bus, nats_url):
    stack = await start_stack(nats_url, workers=2, time_scale=1.0)  # real-time decode: a hog holds its tokens
    gw = await start_gateway(nats_url)
    await gw.wait_for_workers(2)
    try:
        yield stack, gw
    finally:
        await gw.close()
        await stack.close()


def sdk(gw, key: str = ALPHA, **kw) -> openai.AsyncOpenAI:
    kw.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, **kw)


async def decisions(bus, request_id: str) -> list[Decision]:
    return [d for d in (Decision.decode(data) for _, data in await bus.stream_messages(S.STREAM_DECISIONS))
            if d.request_id == request_id]


async def test_chat_completion_runs_as_the_keys_tenant_and_is_audited_under_x_request_id(cluster, bus):
    _, gw = cluster
    raw = await sdk(gw).chat.completions.with_raw_response.create(
        model="default", max_tokens=5, messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "What is a KV cache?"}])
    rid = raw.headers["x-request-id"]
    reply = raw.parse()
    assert reply.id == f"chatcmpl-{rid}" and reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content.split() == [f"tok{i}" for i in range(5)]
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5 and reply.usage.prompt_tokens > 0
    audit = await decisions(bus, rid)
    assert {(d.stage, d.decision, d.tenant) for d in audit} == {("admission", "allow", "alpha"),
                                                               ("routing", "assign", "alpha")}


async def test_text_and_token_id_completions(cluster):
    _, gw = cluster
    client = sdk(gw)
    text = await client.completions.create(model="default", prompt="Once upon a time", max_tokens=3)
    assert text.object == "text_completion" and text.choices[0].text.split() == ["tok0", "tok1", "tok2"]
    ids = await client.completions.create(model="default", prompt=list(range(100)), max_tokens=2)
    assert ids.usage.prompt_tokens == 100 and ids.usage.completion_tokens == 2


async def test_streaming_chat_sends_role_then_deltas_then_finish_and_usage(cluster):
    _, gw = cluster
    stream = await sdk(gw).chat.completions.create(
        model="default", max_tokens=6, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "stream please"}])
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == [f"tok{i}" for i in range(6)]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


async def test_streaming_completion(cluster):
    _, gw = cluster
    stream = await sdk(gw).completions.create(model="default", prompt="count", max_tokens=4, stream=True)
    texts = [c.choices[0].text async for c in stream]
    assert "".join(texts).split() == ["tok0", "tok1", "tok2", "tok3"]


async def test_system_prompt_is_the_stable_prefix_so_a_follow_up_hits_the_cache(bus, nats_url):
    stack = await start_stack(nats_url, workers=1)
    gw = await start_gateway(nats_url)
    try:
        await gw.wait_for_workers(1)
        client = sdk(gw)
        first = await client.chat.completions.create(model="default", max_tokens=2, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}])
        second = await client.chat.completions.create(model="default", max_tokens=2, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "another, different question"}])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens >= 10 * 32  # the system prompt's blocks
    finally:
        await gw.close()
        await stack.close()


async def test_quota_rejection_is_a_429_the_sdk_raises_with_retry_after(cluster, bus):
    stack, gw = cluster
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(300))
    await bus.kv(S.BUCKET_QUOTAS).put("class.online.queue", orjson.dumps(0))
    for _ in range(100):
        if stack.admitter.total == 300 and stack.admitter.core.quotas.queue_limit("online") == 0:
            break
        await asyncio.sleep(0.05)
    client = sdk(gw)
    hog = asyncio.create_task(client.completions.create(model="default", prompt=list(range(100)), max_tokens=50))
    for _ in range(100):
        if stack.admitter.shared.usage.used > 0:
            break
        await asyncio.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as err:
        await client.completions.create(model="default", prompt=list(range(100)), max_tokens=50)
    assert err.value.status_code == 429
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert err.value.response.headers["x-request-id"]
    assert err.value.code == "quota_exhausted" and err.value.type == "rate_limit_error"
    assert (await hog).choices[0].finish_reason == "length"


async def test_sdk_errors_for_bad_key_unknown_model_and_bad_role(cluster):
    _, gw = cluster
    with pytest.raises(openai.AuthenticationError) as err:
        await sdk(gw, key="sk-wrong").chat.completions.create(model="default", messages=[{"role": "user",
                                                                                          "content": "hi"}])
    assert err.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as err:
        await sdk(gw).chat.completions.create(model="gpt-imaginary", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(gw).chat.completions.create(model="default", messages=[{"role": "wizard", "content": "hi"}])
    assert err.value.code == "invalid_role" and err.value.param == "messages[0].role"


async def test_models_lists_what_workers_serve(cluster):
    _, gw = cluster
    models = await sdk(gw).models.list()
    assert [m.id for m in models.data] == ["default"]
    # every field vLLM's server lists (vllm bench serve reads root), with the engine's real limit
    entry = models.data[0].to_dict()
    assert {k: entry[k] for k in ("object", "owned_by", "root", "parent", "max_model_len")} == \
        {"object": "model", "owned_by": "natsched", "root": "default", "parent": None, "max_model_len": 131072}
    assert isinstance(entry["created"], int)


async def test_health_is_served_beside_healthz_as_vllm_clients_ask_for_it(cluster):
    _, gw = cluster
    async with httpx.AsyncClient(base_url=gw.url) as http:
        health, healthz = await http.get("/health"), await http.get("/healthz")
    assert health.status_code == healthz.status_code == 200  # guidellm and vLLM's probes ask /health
    assert health.json() == healthz.json() == {"status": "ok", "bus": "connected", "models": ["default"]}
