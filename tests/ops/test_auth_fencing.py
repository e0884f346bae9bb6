"""Fenced completions against a real nats-server with ``auth init``'s credentials (issue 26).

A worker may publish completions on its own ``done.*.<worker>`` only (the server refuses any
other), and the admitter releases a reservation only for a completion carrying the fencing token
of the worker and attempt the request was assigned to. Forged, misattributed and stale
completions are refused and counted, and touch neither the reservation nor the real
completion's ``<id>:done:<fence>`` dedup slot.
"""

from __future__ import annotations

import asyncio

import pytest

from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.bus.connection import Bus, Credentials
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire import subjects as S
from natsched.wire.ids import scoped
from natsched.wire.schema import Completion
from tests.factories.core import make_request, wait_for
from tests.ops.test_auth_permissions import probe, provisioned, secured  # noqa: F401 (fixtures)


@pytest.fixture
async def admitter(provisioned):  # noqa: F811
    server, files, admin = provisioned
    bus = await Bus.connect(server.url, name="admitter", credentials=files.creds("admitter"))
    adm = AdmitterService(bus, AdmitterServiceSettings(name="admitter", reconcile_interval_s=3600,
                                                       rescue_grace_s=3600))
    await adm.start()
    try:
        yield adm
    finally:
        await bus.close()


async def _admitted(admin: Bus, adm: AdmitterService, tenant: str = "A") -> str:
    """One request of ``tenant`` admitted (no router runs: it stays reserved); its id."""
    req = make_request(tenant=tenant, prompt_token_ids=list(range(50)), max_tokens=10)
    req.id = scoped(tenant, req.id)  # under auth keys the admitter takes scoped ids only
    req.reply = S.tenant_reply(tenant, req.id)
    await admin.jpublish(S.request(S.ONLINE, tenant), req, msg_id=req.id, headers={S.HDR_REPLY: req.reply})
    assert await wait_for(lambda: adm.shared.usage.tenant(tenant) > 0, timeout=10)
    return req.id


def _completion(rid: str, worker: str, token: str, attempt: int = 0, tenant: str = "A") -> Completion:
    return Completion(request_id=rid, tenant=tenant, status="ok", runtime_tokens=110, worker=worker,
                      attempt=attempt, fence=token, output_tokens=10)


def _refused(adm: AdmitterService, reason: str) -> float:
    return adm.metrics.registry.get_sample_value("natsched_admission_refused_completions_total",
                                                 {"reason": reason}) or 0.0


async def _as(server, files, user: str) -> Bus:
    return await Bus.connect(server.url, name=user, credentials=files.creds(user))


async def test_a_worker_may_publish_completions_on_its_own_subject_only(probe):  # noqa: F811
    w1 = await probe("worker-w1")
    assert not await w1.publish(S.completion("A", "w1"))
    for subject in (S.completion("A", "w2"), S.completion("B", "w2"), S.completion("A", S.ROUTER_SOURCE), "done.A"):
        assert await w1.publish(subject), f"worker-w1 publishing to {subject} was not refused"


async def test_forged_and_misattributed_completions_release_nothing_and_take_no_dedup_slot(provisioned, admitter):  # noqa: F811
    """The request runs on w2 (attempt 0). w1, with its own credentials, publishes: a completion
    with a made-up fence and the old ``<id>:done`` msg id, one naming w2 in its body on its own
    subject, and one on its own subject with w2's token copied from nowhere (it cannot know it).
    Each is refused and counted; the reservation stays; then w2's real completion releases it."""
    server, files, admin = provisioned
    adm = admitter
    rid = await _admitted(admin, adm)
    held = adm.shared.usage.tenant("A")
    key = Credentials.load(files.creds("router")).fence_key  # what the router signed with
    assert key and key != fence.DEFAULT_KEY and not Credentials.load(files.creds("worker-w1")).fence_key
    real = fence.sign(key, rid, "w2", 0)
    w1 = await _as(server, files, "worker-w1")
    try:
        forged = [(_completion(rid, "w1", "0" * 16), M.completion(rid)),  # a fence of its own making
                  (_completion(rid, "w2", "f" * 16), M.completion(rid, "f" * 16)),  # naming w2, on w1's subject
                  (_completion(rid, "w1", fence.sign(None, rid, "w1", 0)), M.completion(rid, "guess"))]
        for c, msg_id in forged:
            await w1.jpublish(S.completion("A", "w1"), c, msg_id=msg_id)
        assert await wait_for(lambda: _refused(adm, fence.BAD_FENCE) == 2 and _refused(adm, fence.WRONG_SOURCE) == 1,
                              timeout=10)
        assert adm.shared.usage.tenant("A") == held and await adm.shared.lookup(rid) is not None
    finally:
        await w1.close()
    w2 = await _as(server, files, "worker-w2")
    try:
        ack = await w2.jpublish(S.completion("A", "w2"), _completion(rid, "w2", real), msg_id=M.completion(rid, real))
        assert not ack.duplicate  # no forged publish took its slot
        assert await wait_for(lambda: adm.shared.usage.tenant("A") == 0, timeout=10)
        assert await adm.shared.lookup(rid) is None
    finally:
        await w2.close()


async def test_a_rescued_attempts_old_worker_is_fenced_off(provisioned, admitter):  # noqa: F811
    """w1 ran attempt 0, was declared dead, and the request was rescued to w2 as attempt 1 (the
    reservation says so). w1 wakes up and completes attempt 0 with its valid token: stale,
    refused; w2's completion of attempt 1 releases."""
    server, files, admin = provisioned
    adm = admitter
    rid = await _admitted(admin, adm)
    assert (await adm.shared.mark_moved(rid, "w1", attempt=1)).attempt == 1
    key = Credentials.load(files.creds("router")).fence_key
    w1, w2 = await _as(server, files, "worker-w1"), await _as(server, files, "worker-w2")
    try:
        old = fence.sign(key, rid, "w1", 0)
        await w1.jpublish(S.completion("A", "w1"), _completion(rid, "w1", old), msg_id=M.completion(rid, old))
        assert await wait_for(lambda: _refused(adm, fence.STALE) == 1, timeout=10)
        assert await adm.shared.lookup(rid) is not None and adm.shared.usage.tenant("A") > 0
        new = fence.sign(key, rid, "w2", 1)
        await w2.jpublish(S.completion("A", "w2"), _completion(rid, "w2", new, attempt=1),
                          msg_id=M.completion(rid, new))
        assert await wait_for(lambda: adm.shared.usage.tenant("A") == 0, timeout=10)
    finally:
        await asyncio.gather(w1.close(), w2.close())
