"""What third-party OpenAI clients meet at the gateway: a degraded request as an error they
handle (and its job fetched with the caller's key), the estimated queue wait, the tokens a
cancelled stream really produced, SSE keep-alives and the three timeout tiers. Real nats-server,
real sim workers, the official openai SDK and httpx."""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest

from natsched.wire import subjects as S
from tests.admitter.test_offline_runner import jobs_stack
from tests.factories.core import wait_for
from tests.factories.gateway import ALPHA, BETA, gateway_over_stack, start_gateway
from tests.gateway.test_cancel import completions, post, sample

LONG = 4000
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "tell me a long story"}]


def sdk(gw, key: str = ALPHA, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, **kw)


async def test_a_degraded_request_is_an_error_the_sdk_raises_and_its_job_is_fetched_with_the_key(bus, nats_url):
    stack, _ = await jobs_stack(nats_url, workers=1)
    gw = await start_gateway(nats_url)
    try:
        await gw.wait_for_workers(1)
        with pytest.raises(openai.UnprocessableEntityError) as caught:  # not a ChatCompletion with choices=None
            await sdk(gw, BETA, max_retries=3).chat.completions.create(model="default", max_tokens=4,
                                                                       messages=MESSAGES)
        err = caught.value
        assert err.code == "degraded_to_job" and err.body["job_id"]
        job_id = err.body["job_id"]
        assert err.response.headers["location"] == f"/v1/natsched/jobs/{job_id}"
        # the SDK did not retry it (a retry would start a second job)
        assert sample(gw.gateway.metrics.registry, "natsched_gateway_requests_total",
                      endpoint=CHAT, code="422") == 1
        async with httpx.AsyncClient(base_url=gw.url) as http:
            async def done():
                r = await http.get(f"/v1/natsched/jobs/{job_id}", headers={"Authorization": f"Bearer {BETA}"})
                return r.json() if r.status_code == 200 and r.json()["done"] else None
            assert await wait_for(done)
            job = await done()
            assert job["object"] == "natsched.job" and job["status"] == "completed" and job["output"]
            assert job["usage"]["completion_tokens"] == 4 and "choices" not in job
            other = await http.get(f"/v1/natsched/jobs/{job_id}", headers={"Authorization": f"Bearer {ALPHA}"})
            assert other.status_code == 404 and other.json()["error"]["code"] == "job_not_found"  # not alpha's
            bad = await http.get("/v1/natsched/jobs/a.b", headers={"Authorization": f"Bearer {BETA}"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_job_id"
            assert (await http.get(f"/v1/natsched/jobs/{job_id}")).status_code == 401
    finally:
        await gw.close()
        await stack.close()


@pytest.fixture
async def slow_cluster(bus, nats_url):
    """One real-time worker in a cluster of 6000 runtime tokens: a long request fills it."""
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(6000))
    try:
        async with gateway_over_stack(nats_url, workers=1, keepalive_s=0.05) as (stack, gw):
            await wait_for(lambda: stack.admitter.total == 6000)
            yield stack, gw
    finally:
        await bus.kv(S.BUCKET_QUOTAS).delete(S.KEY_CLUSTER_TOTAL)


async def test_a_queued_request_says_its_estimated_wait_and_a_cancelled_stream_meters_what_it_sent(
        slow_cluster, bus):
    stack, gw = slow_cluster
    client = sdk(gw, max_retries=0)
    hog = await client.chat.completions.with_raw_response.create(model="default", max_tokens=LONG, stream=True,
                                                                 messages=MESSAGES)
    assert "x-natsched-queue-wait" not in hog.headers  # it ran at once
    hog_stream = hog.parse()
    got = 0
    async for chunk in hog_stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 5:
            break
    waiting = asyncio.ensure_future(client.chat.completions.with_raw_response.create(
        model="default", max_tokens=LONG, stream=True, messages=MESSAGES))
    assert await wait_for(lambda: len(stack.admitter.held) == 1)  # queued behind the hog
    await hog_stream.close()  # the client leaves mid-stream: the hog is cancelled, the queued one runs
    queued = await waiting
    assert float(queued.headers["x-natsched-queue-wait"]) >= 0
    await queued.parse().close()
    hog_id = hog.headers["x-request-id"]
    assert await wait_for(lambda: not stack.workers[0].inflight)
    done = (await completions(bus))[hog_id]
    assert done.reason == "cancelled" and done.output_tokens >= 5 and done.prompt_tokens > 0  # the audit counts them
    registry = gw.gateway.metrics.registry
    metered = sample(registry, "natsched_gateway_tokens_total", tenant="alpha", kind="output")
    assert 5 <= metered <= 2 * done.output_tokens  # both cancelled streams, each what it really sent
    assert sample(registry, "natsched_gateway_tokens_total", tenant="alpha", kind="prompt") > 0


async def test_a_quiet_stream_gets_keepalive_comments_the_sdk_ignores(bus, nats_url):
    # ~0.3 s a token: quiet between them
    async with gateway_over_stack(nats_url, workers=1, time_scale=40.0, keepalive_s=0.05) as (_, gw):
        reader, writer = await post(gw, CHAT, {"model": "default", "max_tokens": 3, "stream": True,
                                               "messages": MESSAGES})
        raw = b""
        while b"[DONE]" not in raw:
            raw += await reader.read(65536)
        writer.close()
        assert b": keep-alive\n\n" in raw and raw.count(b"data: ") >= 4
        assert sample(gw.gateway.metrics.registry, "natsched_gateway_sse_keepalives_total") >= 1
        stream = await sdk(gw, max_retries=0).chat.completions.create(model="default", max_tokens=3, stream=True,
                                                                      messages=MESSAGES)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text.split() == ["tok0", "tok1", "tok2"]


async def test_ttft_limit_of_a_queued_request_is_a_504_and_cancels_it(slow_cluster):
    stack, gw = slow_cluster
    client = sdk(gw, max_retries=0)
    hog = await client.chat.completions.create(model="default", max_tokens=LONG, stream=True, messages=MESSAGES)
    await hog.__anext__()
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model="default", max_tokens=LONG, stream=True, messages=MESSAGES,
                                             extra_headers={"x-natsched-ttft-timeout": "0.5"})
    assert caught.value.status_code == 504 and caught.value.code == "ttft_timeout"
    assert await wait_for(lambda: len(stack.admitter.held) == 0)  # the cancel took it out of the queue
    assert sample(gw.gateway.metrics.registry, "natsched_gateway_cancelled_total", reason="ttft_timeout") == 1
    await hog.close()


async def test_stream_idle_limit_ends_the_stream_with_an_error_event_and_stops_the_run(bus, nats_url):
    async with gateway_over_stack(nats_url, workers=1, time_scale=40.0) as (stack, gw):  # ~0.3 s a token
        stream = await sdk(gw, max_retries=0).chat.completions.create(
            model="default", max_tokens=50, stream=True, messages=MESSAGES,
            extra_headers={"x-natsched-stream-idle-timeout": "0.05"})
        with pytest.raises(openai.APIError) as caught:
            async for _ in stream:
                pass
        assert "stream-idle" in str(caught.value) or "idle_timeout" in str(caught.value)
        assert await wait_for(lambda: not stack.workers[0].inflight)
        assert sample(gw.gateway.metrics.registry, "natsched_gateway_cancelled_total", reason="idle_timeout") == 1


async def test_total_limit_of_a_running_request_is_a_504_and_stops_the_run(bus, nats_url):
    async with gateway_over_stack(nats_url, workers=1, time_scale=40.0) as (stack, gw):  # ~0.3 s a token: 15 s
        with pytest.raises(openai.APIStatusError) as caught:
            await sdk(gw, max_retries=0, timeout=60).chat.completions.create(
                model="default", max_tokens=50, messages=MESSAGES, extra_headers={"x-natsched-timeout": "1"})
        assert caught.value.status_code == 504 and caught.value.code == "timeout"
        assert await wait_for(lambda: not stack.workers[0].inflight)  # not left running for the other 14 s
        assert sample(gw.gateway.metrics.registry, "natsched_gateway_cancelled_total", reason="timeout") == 1


async def test_bad_timeout_headers_and_settings_are_refused(slow_cluster):
    _, gw = slow_cluster
    async with httpx.AsyncClient(base_url=gw.url) as http:
        for header in ("x-natsched-ttft-timeout", "x-natsched-stream-idle-timeout"):
            for value in ("soon", "-1", "nan", "0"):
                r = await http.post(CHAT, headers={"Authorization": f"Bearer {ALPHA}", header: value},
                                    json={"model": "default", "messages": MESSAGES})
                assert r.status_code == 400 and r.json()["error"]["param"] == header, (header, value)
    from natsched.gateway.errors import ConfigError
    from natsched.gateway.service import GatewaySettings
    for bad in ({"keepalive_s": 0}, {"ttft_timeout_s": -1.0}, {"stream_idle_timeout_s": float("inf")},
                {"max_wait_s": "x"}):
        with pytest.raises(ConfigError):
            GatewaySettings(**bad)


@pytest.mark.parametrize("flag", ["--ttft-timeout", "--stream-idle-timeout", "--keepalive"])
@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf"])
def test_bad_timeout_flags_are_refused(flag, value):
    from natsched.cli.gateway import settings_from_args
    from natsched.gateway.errors import ConfigError
    from tests.gateway.test_input import gateway_args

    with pytest.raises(ConfigError) as err:
        settings_from_args(gateway_args("--insecure-open", flag, value))
    assert flag in str(err.value)
    settings, _ = settings_from_args(gateway_args("--insecure-open", "--ttft-timeout", "2",
                                                  "--stream-idle-timeout", "0.5"))
    assert (settings.ttft_timeout_s, settings.stream_idle_timeout_s, settings.keepalive_s) == (2.0, 0.5, 15.0)
