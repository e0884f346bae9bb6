"""Client retries (full jitter, retry_after, deadline) and the three timeout tiers: the pure policy,
then against a real nats-server with the real services (sim workers)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from natsched.client.errors import ClientSettingsError, Rejected, RequestFailed, RequestTimeout
from natsched.client.producer import Client, Timeouts, make_request
from natsched.client.retry import Retry
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.profiles import H100_LLAMA8B
from natsched.workers.simengine import SimEngine
from natsched.bus.connection import Bus
from tests.factories.core import wait_for
from tests.factories.stack import start_stack


def rejected(retry_after=None, reason="quota_exhausted"):
    return Rejected("no", "r1", reason, retry_after)


def test_full_jitter_never_below_retry_after_and_within_the_growing_window():
    retry = Retry(attempts=10, base_s=0.5, cap_s=4.0, rng=random.Random(7))
    for attempt in range(1, 8):
        window = min(4.0, 0.5 * 2 ** (attempt - 1))
        draws = [retry.delay(attempt, 2.0) for _ in range(200)]
        assert all(2.0 <= d <= 2.0 + window for d in draws)
        assert max(draws) - min(draws) > window / 2  # spread, not a fixed interval


def test_what_is_retried_and_what_is_not():
    retry = Retry(attempts=3)
    now = 1000.0
    assert retry.next_delay(rejected(1.0), 1, False, now, None) is not None
    assert retry.next_delay(rejected(None, "invalid_class"), 1, False, now, None) is None  # refused as sent
    assert retry.next_delay(RequestFailed("x", "r1", "no_worker"), 1, False, now, None) is not None
    assert retry.next_delay(RequestFailed("x", "r1", "server_unavailable"), 1, False, now, None) is not None
    assert retry.next_delay(RequestFailed("x", "r1", "engine_error"), 1, False, now, None) is None
    assert retry.next_delay(RequestTimeout("x", "r1", "total"), 1, False, now, None) is None
    assert retry.next_delay(rejected(1.0), 3, False, now, None) is None  # attempts spent
    assert retry.next_delay(rejected(5.0), 1, False, now, now + 4.0) is None  # it would start past the deadline
    failed = RequestFailed("x", "r1", "worker_lost")
    assert retry.next_delay(failed, 1, True, now, None) is None  # a stream that produced output
    assert Retry(after_output=True).next_delay(failed, 1, True, now, None) is not None


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"attempts": 1.5}, {"base_s": 0}, {"cap_s": float("nan")},
                                 {"base_s": 2.0, "cap_s": 1.0}, {"attempts": True}])
def test_bad_retry_values_are_refused(bad):
    with pytest.raises(ClientSettingsError):
        Retry(**bad)


@pytest.mark.parametrize("bad", [{"ttft": 0}, {"total": -1}, {"stream_idle": float("inf")}, {"idle": None},
                                 {"publish": "10"}, {"ttft": True}])
def test_bad_timeouts_are_refused(bad):
    with pytest.raises(ClientSettingsError):
        Timeouts(**bad)


def test_the_limits_travel_with_the_request():
    req = make_request("t1", "hi", deadline=1010.0, stream=True)
    Timeouts(ttft=2, total=30, stream_idle=0.5).apply(req, now=1000.0)
    assert (req.ttft_deadline, req.deadline, req.idle_timeout) == (1002.0, 1010.0, 0.5)  # the earlier deadline kept


async def add_worker(url: str, stack, wid: str) -> WorkerAgent:
    bus = await Bus.connect(url, name=wid)
    stack.buses.append(bus)
    agent = WorkerAgent(bus, SimEngine(H100_LLAMA8B, block_size=32, time_scale=0.05),
                        WorkerSettings(id=wid, heartbeat_interval_s=0.2))
    await agent.start()
    stack.workers.append(agent)
    return agent


async def test_a_retry_outlives_no_worker_and_runs_under_a_fresh_id(bus, nats_url):
    stack = await start_stack(nats_url, workers=0, no_worker_wait_s=0.2)
    try:
        request = make_request("t1", "hello", max_tokens=3)
        task = asyncio.ensure_future(stack.client.submit(request, retry=Retry(attempts=50, base_s=0.1, cap_s=0.3)))
        # the first try failed with no_worker: the router recorded it
        assert await wait_for(lambda: sum(
            s.value for m in stack.router.metrics.decisions.collect() for s in m.samples
            if s.name.endswith("_total") and s.labels["decision"] == "fail") >= 1)
        await add_worker(nats_url, stack, "w1")
        result = await task
        assert result.attempts >= 2 and result.output_tokens == 3
        assert result.request_id.startswith(f"{request.id}-r")
    finally:
        await stack.close()


async def test_a_stream_retries_through_no_worker_and_streams_its_output(bus, nats_url):
    stack = await start_stack(nats_url, workers=0, no_worker_wait_s=0.2)
    try:
        stream = stack.client.stream(make_request("t1", "hello", max_tokens=3),
                                     retry=Retry(attempts=50, base_s=0.1, cap_s=0.3))

        async def read() -> list[str]:
            return [chunk.text async for chunk in stream]

        task = asyncio.ensure_future(read())
        assert await wait_for(lambda: sum(
            s.value for m in stack.router.metrics.decisions.collect() for s in m.samples
            if s.name.endswith("_total") and s.labels["decision"] == "fail") >= 1)  # a try failed: no worker
        assert not task.done()  # retried, not raised
        await add_worker(nats_url, stack, "w1")
        assert "".join(await task).split() == ["tok0", "tok1", "tok2"]
        assert stream.result.attempts >= 2 and stream.produced == 3
    finally:
        await stack.close()


async def test_a_stream_that_streamed_output_is_retried_only_with_after_output(bus):
    """Its worker dies after a token went out (the admitter re-admits it: ``rerouted``), and the
    token came without its id, so the stream cannot be migrated: a default policy raises
    ``worker_lost`` (the consumer already has output), ``after_output`` tries again. The
    services' replies are scripted on the real bus, answering each try as it is published."""
    tries: list = []
    half = [("token", "half ", None, None, "wa"), ("status", None, None, None, "wa")]
    whole = [("token", "whole", None, None, "wb"), ("result", None, [1], None, "wb")]
    scripts = [half, whole]  # each stream's first try, then its second
    sub = await _scripted(bus, "t-retry", scripts, tries)
    client = Client(bus, Timeouts(admission=5, idle=5), retry=Retry(attempts=3, base_s=0.05, cap_s=0.1))
    try:
        with pytest.raises(RequestFailed) as err:
            _ = [c.text async for c in client.stream(make_request("t-retry", "x"))]
        assert err.value.reason == "worker_lost" and len(tries) == 1  # raised, not retried
        tries.clear()
        request = make_request("t-retry", "x")
        stream = client.stream(request, retry=Retry(attempts=3, base_s=0.05, cap_s=0.1, after_output=True))
        assert [c.text async for c in stream] == ["half ", "whole"]  # the consumer sees the output again
        assert [t.id for t in tries] == [request.id, f"{request.id}-r1"] and stream.result.attempts == 2
    finally:
        await sub.unsubscribe()


def _scripted(bus, tenant, scripts, tries):
    """Answer each try of ``tenant``'s request with the next script of (kind, text, ids, index,
    worker) replies, on the real bus; record every try's decoded Request."""
    from natsched.wire import fence
    from natsched.wire import subjects as S
    from natsched.wire.schema import Reply, Request

    async def on_request(subject, data, headers):
        req = Request.decode(data)
        if req.tenant != tenant:
            return
        tries.append(req)
        for kind, text, ids, index, worker in scripts[len(tries) - 1]:
            if kind == "reject":  # the admitter's answer, on the reply subject itself
                await bus.publish(headers[S.HDR_REPLY], Reply(request_id=req.id, kind="error", status="rejected",
                                                              reason="tenant_quota", retry_after=0.01))
                continue
            reply = Reply(request_id=req.id, kind=kind, text=text, token_ids=ids, index=index, worker=worker,
                          status="rerouted" if kind == "status" else None,
                          output_tokens=len(ids or ()) if kind == "result" else None,
                          prompt_tokens=7 + len(req.resume_token_ids or ()) if kind == "result" else None)
            if kind == "status":  # the services' news, on the reply subject itself
                await bus.publish(headers[S.HDR_REPLY], reply)
            else:  # a worker's output: on its own sub-subject with its reply fence
                reply.fence = fence.reply_sign(fence.reply_key(None, req.tenant), req.id, worker, 0)
                await bus.publish(S.worker_reply(headers[S.HDR_REPLY], worker), reply)

    return bus.subscribe(S.REQUESTS_ALL, on_request)


async def test_a_stream_whose_worker_dies_goes_on_after_its_output_on_another(bus):
    """Two tokens out, then ``rerouted``: the next try carries their ids (resume_token_ids), and
    the consumer's stream goes on — no output repeated, indexes continuing, the result whole."""
    tries: list = []
    scripts = [[("token", " a", [11], 0, "wa"), ("token", " b", [12], 1, "wa"), ("status", None, None, None, "wa")],
               [("token", " c", [13], 0, "wb"), ("result", " c", [13], None, "wb")]]
    sub = await _scripted(bus, "t-move", scripts, tries)
    client = Client(bus, Timeouts(admission=5, idle=5))  # no retry policy: a migration is not a retry
    try:
        request = make_request("t-move", "x", max_tokens=8)
        stream = client.stream(request)
        chunks = [c async for c in stream]
        assert [(c.text, c.index) for c in chunks] == [(" a", 0), (" b", 1), (" c", 2)]
        assert [t.resume_token_ids for t in tries] == [None, [11, 12]]
        assert tries[1].id == f"{request.id}-r1" and tries[1].max_tokens == 8
        r = stream.result
        assert (r.text, r.output_tokens, r.prompt_tokens, r.migrations, r.attempts) == (" a b c", 3, 7, 1, 2)
    finally:
        await sub.unsubscribe()


async def test_a_continuation_refused_before_new_output_is_retried_as_a_continuation(bus):
    """The migrated try is rejected with ``retry_after`` (the tenant's quota): a plain retry policy
    (no ``after_output``) tries it again carrying the same output ids, and nothing is repeated."""
    tries: list = []
    scripts = [[("token", " a", [11], 0, "wa"), ("status", None, None, None, "wa")],
               [("reject", None, None, None, None)],
               [("token", " b", [12], 0, "wb"), ("result", " b", [12], None, "wb")]]
    sub = await _scripted(bus, "t-again", scripts, tries)
    client = Client(bus, Timeouts(admission=5, idle=5), retry=Retry(attempts=3, base_s=0.01, cap_s=0.02))
    try:
        stream = client.stream(make_request("t-again", "x", max_tokens=4))
        assert [(c.text, c.index) for c in [c async for c in stream]] == [(" a", 0), (" b", 1)]
        assert [t.resume_token_ids for t in tries] == [None, [11], [11]]
        assert (stream.result.text, stream.result.output_tokens, stream.result.attempts) == (" a b", 2, 3)
    finally:
        await sub.unsubscribe()


@pytest.mark.parametrize("first", [
    [("token", " a", [11], 0, "wa"), ("token", " b", [12], 2, "wa")],  # index 1 never came: output unknown
    [("token", " a", None, 0, "wa")],  # a chunk without token ids
])
async def test_a_stream_whose_output_is_not_known_whole_is_not_migrated(bus, first):
    tries: list = []
    scripts = [first + [("status", None, None, None, "wa")], [("result", "never", [1], None, "wb")]]
    sub = await _scripted(bus, "t-nomove", scripts, tries)
    try:
        with pytest.raises(RequestFailed) as err:
            _ = [c async for c in Client(bus, Timeouts(admission=5, idle=5)).stream(make_request("t-nomove", "x"))]
        assert err.value.reason == "worker_lost" and len(tries) == 1
        tries.clear()  # nor with migrations off
        scripts[0] = [("token", " a", [11], 0, "wa"), ("status", None, None, None, "wa")]
        with pytest.raises(RequestFailed):
            _ = [c async for c in Client(bus, Timeouts(admission=5, idle=5), migrations=0).stream(
                make_request("t-nomove", "x"))]
        assert len(tries) == 1
    finally:
        await sub.unsubscribe()


async def test_without_retry_no_worker_fails_at_once(bus, nats_url):
    stack = await start_stack(nats_url, workers=0, no_worker_wait_s=0.2)
    try:
        with pytest.raises(RequestFailed) as err:
            await stack.client.submit(make_request("t1", "hello", max_tokens=3))
        assert err.value.reason == "no_worker"
    finally:
        await stack.close()


async def test_client_ttft_and_stream_idle_limits_cancel_on_the_worker(bus, nats_url):
    stack = await start_stack(nats_url, workers=1, time_scale=40.0)  # ~0.3 s a token
    try:
        request = make_request("t1", "slow stream", max_tokens=50)
        stream = stack.client.stream(request, timeouts=Timeouts(admission=10, stream_idle=0.05))
        with pytest.raises(RequestTimeout) as err:
            async for _ in stream:
                pass
        assert err.value.reason == "stream_idle" and stream.produced >= 1
        assert await wait_for(lambda: not stack.workers[0].inflight)  # cancelled (or stopped by its own limit)
        started = time.time()
        with pytest.raises(RequestTimeout) as err:
            async for _ in stack.client.stream(make_request("t1", "x" * 20000, max_tokens=5),
                                               timeouts=Timeouts(admission=10, ttft=0.01)):
                pass
        assert err.value.reason == "ttft" and time.time() - started < 10
        assert await wait_for(lambda: not stack.workers[0].inflight)  # cancelled there too (or never ran)
    finally:
        await stack.close()


async def test_the_worker_stops_a_run_past_its_idle_limit_when_no_client_does(bus, nats_url):
    stack = await start_stack(nats_url, workers=1, time_scale=40.0)
    try:
        request = make_request("t1", "nobody enforces it here", max_tokens=50, idle_timeout=0.05)
        with pytest.raises(RequestFailed) as err:  # a non-streaming submit: the client sees no tokens
            await stack.client.submit(request)
        assert err.value.reason == "idle_timeout"
        worker = stack.workers[0]
        assert worker.metrics.registry.get_sample_value("natsched_worker_timeouts_total",
                                                        {"reason": "idle_timeout"}) == 1
    finally:
        await stack.close()
