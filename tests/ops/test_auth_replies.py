"""Fenced replies against a real nats-server with ``auth init``'s credentials (issue 26).

A worker answers on its own ``<reply>.<worker>`` only (the server refuses the producer's reply
subject itself and every other worker's sub-subject), and the producer takes output only when
the reply's fence is the router's reply token for (request, that worker, attempt), signed with
the tenant's reply key that no worker holds. A worker that was not assigned the request cannot
deliver a result to it; a rerouted attempt's old worker is stale.
"""

from __future__ import annotations

import asyncio

import pytest

from natsched.bus.connection import Bus, Credentials
from natsched.client.producer import Client, Timeouts
from natsched.wire import fence
from natsched.wire import subjects as S
from natsched.wire.schema import Reply, ReplyKind, ReplyStatus, Request
from tests.factories.core import wait_for
from tests.ops.test_auth_permissions import probe, provisioned, secured, tenant_request  # noqa: F401 (fixtures)


async def test_a_worker_may_answer_on_its_own_reply_sub_subject_only(probe):  # noqa: F811
    w2 = await probe("worker-w2")
    assert not await w2.publish(S.tenant_worker_reply("A", "r1", "w2"))
    for subject in (S.tenant_reply("A", "r1"), S.tenant_worker_reply("A", "r1", "w1"), S.reply("r1"),
                    S.tenant_worker_reply("B", "r1", "w1")):
        assert await w2.publish(subject), f"worker-w2 publishing to {subject} was not refused"


def test_reply_keys_go_to_producers_and_the_gateway_never_to_workers(provisioned):  # noqa: F811
    _, files, _ = provisioned
    key = Credentials.load(files.creds("router")).fence_key
    producer = Credentials.load(files.creds("producer-A"))
    assert producer.reply_keys == {"A": fence.reply_key(key, "A")} and not producer.fence_key
    assert set(Credentials.load(files.creds("gateway")).reply_keys) == {"A", "B"}
    worker = Credentials.load(files.creds("worker-w2"))
    assert not worker.reply_keys and not worker.fence_key


def _result(rid: str, worker: str, token: str | None, text: str, attempt: int = 0) -> Reply:
    return Reply(request_id=rid, kind=ReplyKind.RESULT, text=text, worker=worker, fence=token, attempt=attempt,
                 output_tokens=3)


async def _connect(server, files, user: str) -> Bus:
    return await Bus.connect(server.url, name=user, credentials=files.creds(user))


@pytest.fixture
async def parties(provisioned):  # noqa: F811
    """Producer A's client, and connections as the router, w1 and w2 (no services run: the test
    plays them, each with its own credentials)."""
    server, files, admin = provisioned
    buses = [await _connect(server, files, u) for u in ("producer-A", "router", "worker-w1", "worker-w2")]
    key = Credentials.load(files.creds("router")).fence_key
    client = Client(buses[0], Timeouts(admission=30, idle=30))

    async def stored(req) -> bool:
        """Whether REQUESTS holds ``req``: the client's publish was acked, so its reply
        subscriptions, made before it on the same connection, are in place at the server. (A core
        subscription as the signal missed the request twice in CI although it was stored: a core
        subscriber has no delivery guarantee, the stream does.)"""
        msgs = await admin.stream_messages(S.STREAM_REQUESTS, S.request(S.ONLINE, "A"))
        return any(Request.decode(data).id == req.id for _, data in msgs)

    async def submit(req) -> asyncio.Task:
        """The client's call, once its request is stored; a call that ends first says why."""
        call = asyncio.create_task(client.submit(req))
        if not await wait_for(lambda: call.done() or stored(req), timeout=60) or call.done():
            ended = call.done() and (call.exception() or call.result())
            call.cancel()
            log = server.log_file.read_text(errors="replace").splitlines()[-20:] if server.log_file else []
            raise AssertionError(f"request {req.id} was not stored within 60 s; the call: {ended or 'running'!r}; "
                                 f"the server's log ends: {log}")
        return call

    try:
        yield submit, client, buses[1], buses[2], buses[3], key
    finally:
        for b in buses:
            await b.close()


def _refused(client: Client) -> int:
    return sum(client.refused_replies.values())


async def test_a_worker_not_assigned_cannot_deliver_a_result(parties):
    """A's request is assigned to w1. w2, with its own credentials, sends results on its own
    sub-subject: without a token, with one signed by the public default key (all a worker can
    compute), and naming w1 in the body. Each is refused and counted, none is returned; w1's
    real result is."""
    submit, client, router, w1, w2, key = parties
    req = tenant_request("A", "who answers me?", max_tokens=3)
    call = await submit(req)
    await router.publish(req.reply, Reply(request_id=req.id, kind=ReplyKind.STATUS, status=ReplyStatus.ASSIGNED,
                                          worker="w1"))
    own = S.worker_reply(req.reply, "w2")
    forged = [_result(req.id, "w2", None, "forged"),
              _result(req.id, "w2", fence.reply_sign(fence.reply_key(None, "A"), req.id, "w2", 0), "forged"),
              _result(req.id, "w1", fence.reply_sign(fence.reply_key(key, "A"), req.id, "w1", 0), "forged")]
    for reply in forged:
        await w2.publish(own, reply)
    assert await wait_for(lambda: _refused(client) == 3, timeout=20)
    assert client.refused_replies == {fence.REPLY_BAD_FENCE: 2, fence.REPLY_WRONG_WORKER: 1}
    assert not call.done()
    real = fence.reply_sign(fence.reply_key(key, "A"), req.id, "w1", 0)
    await w1.publish(S.worker_reply(req.reply, "w1"), _result(req.id, "w1", real, "the real answer"))
    result = await asyncio.wait_for(call, 20)
    assert (result.text, result.worker) == ("the real answer", "w1")


async def test_a_rerouted_attempts_old_worker_is_stale_and_output_on_the_services_subject_is_refused(parties):
    """w1 ran attempt 0 and the request was rerouted (attempt 1 on w2). w1's valid attempt-0
    result is stale; a result on the reply subject itself (where only services may publish: the
    admin-like router role stands in for a confused service) is refused as unfenced; w2's
    attempt-1 result is taken."""
    submit, client, router, w1, w2, key = parties
    req = tenant_request("A", "rerouted", max_tokens=3)
    call = await submit(req)
    tenant_key = fence.reply_key(key, "A")
    await router.publish(req.reply, Reply(request_id=req.id, kind=ReplyKind.STATUS, status=ReplyStatus.REROUTED,
                                          worker="w1"))
    await router.publish(req.reply, _result(req.id, "w2", fence.reply_sign(tenant_key, req.id, "w2", 1), "bare",
                                            attempt=1))
    # the router's connection keeps its order: once its result is refused, the reroute is known
    assert await wait_for(lambda: client.refused_replies == {fence.REPLY_UNFENCED: 1}, timeout=20)
    await w1.publish(S.worker_reply(req.reply, "w1"),
                     _result(req.id, "w1", fence.reply_sign(tenant_key, req.id, "w1", 0), "stale"))
    assert await wait_for(lambda: _refused(client) == 2, timeout=20)
    assert client.refused_replies == {fence.REPLY_UNFENCED: 1, fence.REPLY_STALE: 1}
    await w2.publish(S.worker_reply(req.reply, "w2"),
                     _result(req.id, "w2", fence.reply_sign(tenant_key, req.id, "w2", 1), "attempt one", attempt=1))
    result = await asyncio.wait_for(call, 20)
    assert (result.text, result.worker) == ("attempt one", "w2")
