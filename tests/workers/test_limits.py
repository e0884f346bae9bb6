"""A run's three time limits on the worker (issue 25, item 3): the pure choice of the binding
limit, then each limit stopping a real run on its own — no client enforcing it — counted in
``natsched_worker_timeouts_total{reason}``. Real nats-server, the real services, sim workers at
~0.3 s a token."""

from __future__ import annotations

import asyncio
import time

import pytest

from natsched.bus.connection import Bus
from natsched.wire import subjects as S
from natsched.client.errors import RequestFailed
from natsched.client.producer import Client, Timeouts, make_request
from natsched.workers.limits import DEADLINE_EXCEEDED, IDLE_TIMEOUT, TTFT_TIMEOUT, next_limit
from tests.factories.core import wait_for
from tests.factories.stack import start_stack


def timeouts_of(worker, reason: str) -> float:
    return worker.metrics.registry.get_sample_value("natsched_worker_timeouts_total", {"reason": reason}) or 0.0


def test_the_binding_limit_is_the_one_that_ends_first():
    now = 1000.0
    req = make_request("t", "x", deadline=now + 10, ttft_deadline=now + 2, idle_timeout=0.5)
    assert next_limit(req, first_seen=False, now=now) == (2.0, TTFT_TIMEOUT)  # no token yet: TTFT, not idle
    assert next_limit(req, first_seen=True, now=now) == (0.5, IDLE_TIMEOUT)  # tokens flow: TTFT no longer binds
    assert next_limit(req, first_seen=True, now=now + 9.8) == pytest.approx((0.2, DEADLINE_EXCEEDED))
    assert next_limit(req, first_seen=False, now=now + 3)[1] == TTFT_TIMEOUT  # passed: waits of <= 0
    assert next_limit(make_request("t", "x"), first_seen=False, now=now) is None  # no limits: none


@pytest.fixture
async def slow(bus, nats_url):
    stack = await start_stack(nats_url, workers=1, time_scale=40.0)  # ~0.3 s a token
    try:
        yield stack
    finally:
        await stack.close()


async def test_the_worker_stops_a_run_past_its_ttft_limit(slow):
    # a non-streaming caller sees no tokens: only the worker can enforce its first-token limit
    worker = slow.workers[0]
    with pytest.raises(RequestFailed) as err:
        await slow.client.submit(make_request("t1", "no first token in time", max_tokens=50),
                                 timeouts=Timeouts(ttft=0.05))
    assert err.value.reason == "ttft_timeout"
    assert timeouts_of(worker, TTFT_TIMEOUT) == 1 and not worker.inflight
    assert (await slow.client.submit(make_request("t1", "no limit", max_tokens=2))).output_tokens == 2  # it serves on


async def test_the_worker_stops_a_run_past_its_deadline_when_its_producer_is_gone(slow, nats_url):
    # the producer vanishes mid-run (its connection closed: it cancels nothing); the run would take
    # ~15 s, its deadline ends it on the worker
    worker = slow.workers[0]
    gone = await Bus.connect(nats_url, name="gone-producer")
    request = make_request("t1", "abandoned", max_tokens=50, deadline=time.time() + 1.5)
    task = asyncio.ensure_future(Client(gone, Timeouts(admission=10, idle=60)).submit(request))
    try:
        assert await wait_for(lambda: request.id in worker.inflight)
        await gone.close()
        assert await wait_for(lambda: timeouts_of(worker, DEADLINE_EXCEEDED) == 1, timeout=30)
        assert await wait_for(lambda: not worker.inflight)
        assert timeouts_of(worker, IDLE_TIMEOUT) == timeouts_of(worker, TTFT_TIMEOUT) == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_run_whose_deadline_passed_before_it_started_is_not_run_and_counted(bus):
    from natsched.workers.agent import WorkerAgent, WorkerSettings
    from natsched.workers.profiles import H100_LLAMA8B
    from natsched.workers.simengine import SimEngine
    from natsched.wire.schema import Completion
    from tests.workers.test_agent_states import assign, collect

    done = await collect(bus, S.COMPLETIONS_ALL, Completion)
    agent = WorkerAgent(bus, SimEngine(H100_LLAMA8B, block_size=32, time_scale=0.05),
                        WorkerSettings(id="wlate", heartbeat_interval_s=0.2))
    await agent.start()
    try:
        req = await assign(bus, "wlate", tenant="t1", prompt="too late", max_tokens=4, deadline=time.time() - 1)
        assert await wait_for(lambda: any(c.request_id == req.id for c in done))
        (c,) = [c for c in done if c.request_id == req.id]
        assert c.reason == DEADLINE_EXCEEDED and c.output_tokens == 0  # dropped, not run
        assert timeouts_of(agent, DEADLINE_EXCEEDED) == 1
    finally:
        await agent.stop()
