"""Cancels under ``natsched auth init`` credentials, on a real nats-server: a producer cancels its
own requests (running, or queued in the admitter) and nobody else's; the gateway may cancel its
tenants' requests and touch nothing on the workers' control subjects.

Before, producers could not publish on ``worker.*.ctl`` at all, so under auth none of their
cancels arrived (30 of 30 disconnected streams ran to the end), while the gateway could drain any
worker and cancel any tenant's request.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from natsched.client.errors import Rejected
from natsched.wire import subjects as S
from natsched.wire.schema import Completion
from tests.factories.core import wait_for
from tests.ops.test_auth_permissions import (assert_no_violation, probe, provisioned, secured,  # noqa: F401
                                             start_role_stack, tenant_request)


async def test_a_producer_cancels_its_own_running_and_queued_requests(provisioned, caplog):
    server, files, admin = provisioned
    await admin.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(5000))
    stack = await start_role_stack(server.url, files)
    try:
        assert await wait_for(lambda: stack.admitter.total == 5000)
        a = stack.producers["A"]
        running = tenant_request("A", "a long one", max_tokens=4000)
        stream = a.stream(running).__aiter__()
        await stream.__anext__()  # it runs
        queued = tenant_request("A", "has to wait", max_tokens=4000)
        waiting = asyncio.create_task(a.submit(queued))
        assert await wait_for(lambda: queued.id in stack.admitter.held)
        await a.cancel("A", queued.id)
        with pytest.raises(Rejected) as err:
            await waiting
        assert err.value.reason == "cancelled"
        await stream.aclose()  # the producer leaves its stream: its cancel goes out on cancel.A.<id>
        assert await wait_for(lambda: not any(w.inflight for w in stack.workers))
        done = {c.request_id: c for c in (Completion.decode(d) for _, d in
                                          await admin.stream_messages(S.STREAM_COMPLETIONS))}
        assert done[running.id].reason == "cancelled" and done[running.id].output_tokens < 4000
        assert queued.id not in done
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)
    finally:
        await admin.kv(S.BUCKET_QUOTAS).delete(S.KEY_CLUSTER_TOTAL)
        await stack.close()
    assert_no_violation(caplog)


async def test_the_server_lets_each_producer_cancel_its_own_tenant_only(probe):
    a = await probe("producer-A")
    assert not await a.publish(S.cancel("A", "r1"))
    assert await a.publish(S.cancel("B", "r1")), "producer A cancelling B's request was not refused"
    assert await a.publish(S.control("w1")), "producer A on a worker's control subject was not refused"
    assert await a.subscribe(S.CANCELS_ALL), "producer A reading everyone's cancels was not refused"


async def test_the_gateway_cancels_for_its_tenants_and_cannot_drain_a_worker(probe):
    gw = await probe("gateway")
    assert not await gw.publish(S.cancel("A", "r1")) and not await gw.publish(S.cancel("B", "r1"))
    assert await gw.publish(S.cancel("C", "r1")), "the gateway cancelling a tenant it does not serve was not refused"
    assert await gw.publish(S.control("w1")), "the gateway on a worker's control subject was not refused"
