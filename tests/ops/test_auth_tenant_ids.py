"""Request ids scoped by tenant, against a real nats-server with ``auth init``'s credentials (issue 26).

Two tenants using the same request id both run; the same tenant using an id again is
deduplicated; a tenant that takes another tenant's future id (the scoped id, and the message
ids it could compute) is refused with a clear error, and the other tenant's request then runs
as if nothing happened.
"""

from __future__ import annotations

import pytest

from natsched.client.errors import DuplicateRequest
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire import subjects as S
from natsched.wire.ids import scoped
from natsched.wire.schema import DeadLetter, Reply
from tests.ops.test_auth_permissions import (assert_no_violation, provisioned, secured,  # noqa: F401 (fixtures)
                                             start_role_stack, tenant_request)


@pytest.fixture
async def stack(provisioned):  # noqa: F811
    server, files, _ = provisioned
    s = await start_role_stack(server.url, files)
    try:
        yield s
    finally:
        await s.close()


async def test_two_tenants_with_the_same_id_both_run_and_one_tenant_again_is_deduplicated(stack, caplog):
    a, b = tenant_request("A", "A's question " * 4, max_tokens=3, id="same-1"), \
        tenant_request("B", "B's question " * 4, max_tokens=3, id="same-1")
    ra = await stack.producers["A"].submit(a)
    rb = await stack.producers["B"].submit(b)
    assert (ra.status, rb.status) == ("completed", "completed")
    assert ra.request_id != rb.request_id and {ra.request_id, rb.request_id} == {scoped("A", "same-1"),
                                                                               scoped("B", "same-1")}
    again = tenant_request("A", "A's question " * 4, max_tokens=3, id="same-1")
    with pytest.raises(DuplicateRequest):
        await stack.producers["A"].submit(again)
    assert_no_violation(caplog)


async def test_another_tenants_future_id_is_refused_and_touches_nothing(stack):
    """A publishes, with its own credentials, a request under B's future scoped id, once with
    that id as its message id and once with the submission message id a tenant could compute
    without B's reply key: both are refused (``invalid``). B's request under that id then runs."""
    victim = scoped("B", "next-7")
    producer_a = stack.producers["A"]
    for msg_id in (victim, M.submission(victim, fence.reply_key(None, "B"))):
        forged = tenant_request("A", "taking B's id", max_tokens=2)
        forged.id = victim
        sub = await producer_a.bus.inbox(forged.reply)
        try:
            await producer_a.bus.jpublish(S.request(S.ONLINE, "A"), forged, msg_id=msg_id,
                                          headers={S.HDR_REPLY: forged.reply})
            reply = Reply.decode((await sub.next_msg(timeout=20)).data)
        finally:
            await sub.unsubscribe()
        assert (reply.kind, reply.reason) == ("error", "invalid") and "another tenant's scope" in reply.message
    assert await stack.admitter.shared.lookup(victim) is None
    result = await stack.producers["B"].submit(tenant_request("B", "my own id", max_tokens=3, id="next-7"))
    assert (result.status, result.request_id) == ("completed", victim)


async def _raw(producer, tenant: str, rid: str, reply_to: str) -> Reply:
    """A raw publisher's request (no client: the bare id as id and message id); the first reply."""
    req = tenant_request(tenant, f"{tenant} raw " * 4, max_tokens=2)
    req.id, req.reply = rid, reply_to
    sub = await producer.bus.inbox(reply_to)
    try:
        await producer.bus.jpublish(S.request(S.ONLINE, tenant), req, msg_id=f"{rid}-{tenant}",
                                    headers={S.HDR_REPLY: reply_to})
        return Reply.decode((await sub.next_msg(timeout=20)).data)
    finally:
        await sub.unsubscribe()


async def test_under_auth_a_raw_unscoped_id_is_refused_and_takes_no_other_tenants_id(stack, provisioned):  # noqa: F811
    """A and B both publish raw requests (bypassing the client) under the bare id ``x-raw``: each
    is refused ``invalid`` with the rule and the helper to use, dead-lettered, nothing reserved —
    B's is not a ``duplicate`` of A's. B's request ``x-raw`` through the client then runs."""
    _, _, admin = provisioned
    for tenant in ("A", "B"):
        reply = await _raw(stack.producers[tenant], tenant, "x-raw", S.tenant_reply(tenant, "x-raw"))
        assert (reply.kind, reply.reason) == ("error", "invalid"), reply
        assert "not in tenant" in reply.message and "natsched.wire.ids.scoped" in reply.message
    assert await stack.admitter.shared.lookup("x-raw") is None
    dead = [DeadLetter.decode(d) for _, d in await admin.stream_messages(S.STREAM_DEADLETTER)]
    assert sorted(d.subject for d in dead if d.reason == "invalid" and "'x-raw'" in d.error) == \
        [S.request(S.ONLINE, "A"), S.request(S.ONLINE, "B")]
    result = await stack.producers["B"].submit(tenant_request("B", "B's own x-raw", max_tokens=3, id="x-raw"))
    assert (result.status, result.request_id) == ("completed", scoped("B", "x-raw"))
