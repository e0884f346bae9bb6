"""Recovery that does not depend on timing: one reservation per request id, whatever its msg ids,
and a nats-server SIGKILLed and restarted on its data dir under load (real processes)."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from natsched.admitter.credit import CreditSettings
from natsched.admitter.usage import Usage
from natsched.bus.connection import Bus
from natsched.bus.server import SYNC_ALWAYS, EmbeddedServer, free_port
from natsched.client.producer import Timeouts
from natsched.wire import subjects as S
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire.schema import Admitted, Assignment, Completion, Decision, Heartbeat, Reply
from tests.admitter.test_service import decisions, publish, request, set_quotas, start_admitter, stop
from tests.factories.core import make_completion, make_request
from tests.factories.core import wait_for as until
from tests.factories.stack import start_stack


async def replies_to(bus: Bus, subject: str) -> list[Reply]:
    got: list[Reply] = []

    async def on_reply(_subject: str, data: bytes, _headers: dict) -> None:
        got.append(Reply.decode(data))

    await bus.subscribe(subject, on_reply)
    return got


async def test_one_request_id_under_two_msg_ids_is_reserved_once(bus, nats_url):
    """The first copy is admitted; the second (another Nats-Msg-Id, so JetStream stores both) is
    refused as a duplicate: the usage holds one reservation, not two until the drift repair, and
    the producer hears only the first copy's news."""
    adm = await start_admitter(nats_url)
    try:
        req = request(tokens=100)  # 300 runtime tokens
        req.reply = S.reply(req.id)
        got = await replies_to(bus, req.reply)
        await publish(bus, req)
        assert await until(lambda: adm.shared.usage.used == 300)
        again = copy.deepcopy(req)
        await bus.jpublish(S.request(again.cls, again.tenant), again, msg_id=f"{again.id}-other",
                           headers={S.HDR_REPLY: again.reply})
        assert await until(lambda: adm.refused_duplicates == 1)
        assert adm.shared.usage.used == 300  # reserved once
        assert set(await adm.shared.snapshot()) == {req.id}
        assert [r.status for r in got] == ["admitted"]  # nothing about the refused copy
        allows = [d for d in await decisions(bus) if d.request_id == req.id]
        assert [d.decision for d in allows] == ["allow"]  # one decision record
        admitted = [d for _, d in await bus.stream_messages(S.STREAM_ADMITTED)]
        assert len(admitted) == 1  # handed off once
    finally:
        await stop(adm)


async def test_a_finished_request_id_published_again_is_not_readmitted(bus, nats_url):
    """Its release marker refuses the create: a completed request is never re-admitted."""
    adm = await start_admitter(nats_url)
    try:
        req = request(tokens=100)
        req.reply = S.reply(req.id)
        got = await replies_to(bus, req.reply)
        await publish(bus, req)
        assert await until(lambda: adm.shared.usage.used == 300)
        await bus.jpublish(S.completion(req.tenant, "w1"),
                           make_completion(req.id, tenant=req.tenant, runtime_tokens=300), msg_id=f"{req.id}:done")
        assert await until(lambda: adm.shared.usage.used == 0)
        await bus.jpublish(S.request(req.cls, req.tenant), copy.deepcopy(req), msg_id=f"{req.id}-again",
                           headers={S.HDR_REPLY: req.reply})
        assert await until(lambda: adm.refused_duplicates == 1)
        assert adm.shared.usage.used == 0 and await adm.shared.snapshot() == {}
        assert not [r for r in got if r.kind == "error"]  # the producer keeps its one outcome
    finally:
        await stop(adm)


async def test_two_replicas_given_one_id_twice_reserve_it_once(bus, nats_url):
    await set_quotas(bus, cluster__total=100_000)
    # without credit: the usage then holds exactly the reservations (credit blocks count in it too)
    replicas = [await start_admitter(nats_url, f"adm{i}", fetch_batch=1, credit=CreditSettings(enabled=False))
                for i in range(2)]
    try:
        reqs = [request(tokens=10) for _ in range(20)]  # 30 runtime tokens each
        for r in reqs:
            r.reply = S.reply(r.id)
        replies = [await replies_to(bus, r.reply) for r in reqs]
        await asyncio.gather(*(publish(bus, r) for r in reqs))
        await asyncio.gather(*(bus.jpublish(S.request(r.cls, r.tenant), copy.deepcopy(r), msg_id=f"{r.id}-2",
                                            headers={S.HDR_REPLY: r.reply}) for r in reqs))
        assert await until(lambda: sum(a.refused_duplicates for a in replicas) == 20)
        assert all([x.status for x in rs] == ["admitted"] for rs in replies)
        usage = Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
        assert usage.used == 20 * 30  # one reservation each
        assert len(await bus.stream_messages(S.STREAM_ADMITTED)) == 20
    finally:
        await stop(*replicas)


# --- nats-server SIGKILLed and restarted on its data dir ---------------------------------------


@pytest.fixture
def own_server(tmp_path):
    """A server of this test's own (killed and restarted), with natsched's durability: sync always."""
    server = EmbeddedServer(port=free_port(), data_dir=tmp_path / "nats", sync=SYNC_ALWAYS).start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_sigkilled_server_restarted_on_its_data_dir_keeps_every_release(own_server):
    """Releases are fsynced before they are acknowledged (sync always): after SIGKILL and a restart,
    no released reservation comes back, the admitter notices the new server and checks what it
    is redelivered, and new requests are served."""
    url = own_server.url
    stack = await start_stack(url, workers=2, timeouts=Timeouts(admission=30, idle=30))
    observer = await Bus.connect(url, name="observer")
    try:
        reqs = [make_request(f"before {i}", max_tokens=4) for i in range(40)]
        results = await asyncio.gather(*(stack.client.submit(r) for r in reqs))
        assert [r.status for r in results] == ["completed"] * 40
        assert await until(lambda: stack.admitter.shared.usage.used == 0)
        own_server.kill()
        own_server.start()  # the same port and data dir
        assert await until(lambda: stack.admitter.bus.server_changes == 1, timeout=30)
        usage = await observer.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE)
        assert usage is not None and Usage.from_json(usage[0]).used == 0
        assert [k for k in await observer.kv(S.BUCKET_INFLIGHT).keys() if k.startswith("res.")] == []
        after = [make_request(f"after {i}", max_tokens=4) for i in range(10)]
        results = await asyncio.gather(*(stack.client.submit(r) for r in after))
        assert [r.status for r in results] == ["completed"] * 10
        done = [Completion.decode(d).request_id for _, d in await observer.stream_messages(S.STREAM_COMPLETIONS)]
        assert sorted(done) == sorted(r.id for r in reqs + after)  # one outcome each, none re-run
        allows = [Decision.decode(d) for _, d in await observer.stream_messages(S.STREAM_DECISIONS)]
        assert sorted(x.request_id for x in allows if x.stage == "admission" and x.decision == "allow") == \
            sorted(r.id for r in reqs + after)  # nothing re-admitted
        assert await until(lambda: stack.admitter.shared.usage.used == 0)
    finally:
        await observer.close()
        await stack.close()


async def test_a_request_running_through_a_server_restart_completes_and_is_not_an_engine_error(own_server):
    """The server dies while a worker generates and stays away past the worker's publish budget:
    the worker keeps its completion until the server is back, so the request completes (one ok
    completion), never ``engine_error``, and its reservation is released."""
    stack = await start_stack(own_server.url, workers=1, time_scale=1.0, timeouts=Timeouts(admission=30, idle=30))
    observer = None
    try:
        req = make_request("a long answer " * 8, max_tokens=200)  # a few seconds on the sim engine
        run = asyncio.create_task(stack.client.submit(req))
        assert await until(lambda: any(req.id in lease.inflight for lease in stack.admitter.leases.workers.values()))
        worker = stack.workers[0]
        worker.bus.publish_budget_s = 0.5  # the outage outlasts the publish budget
        own_server.kill()
        # it finished, its completion waits; and the outage outlasts the lease (3 heartbeats of 0.2 s)
        assert await until(lambda: worker.completion_retries >= 3)
        own_server.start()
        result = await run
        assert result.status == "completed"
        observer = await Bus.connect(own_server.url, name="observer")
        done = [Completion.decode(d) for _, d in await observer.stream_messages(S.STREAM_COMPLETIONS)]
        assert [(c.request_id, c.status) for c in done] == [(req.id, "ok")]
        records = [Decision.decode(d) for _, d in await observer.stream_messages(S.STREAM_DECISIONS)]
        assert [x for x in records if x.decision == "rescue"] == []  # no lease judged while nothing was heard
        assert await until(lambda: stack.admitter.shared.usage.used == 0)
    finally:
        if observer is not None:
            await observer.close()
        await stack.close()


async def test_a_server_restart_does_not_expire_the_leases_of_live_workers(own_server):
    """Issue 26's two ``ok`` completions after a server restart: heartbeats are core NATS, so none
    arrives while the admitter's own connection is down, and the lease loop took that silence
    for the workers' and rescued every in-flight request of every worker — run twice, the first
    run's completion then refused as stale. Here a worker (played by the test) runs one request
    through the restart and reconnects a moment after the admitter: its lease holds, nothing is
    rescued, and its completion (attempt 0) is the one accepted and releases the reservation."""
    url = own_server.url
    adm = await start_admitter(url, lease_missed=3)
    worker = await Bus.connect(url, name="worker-w1")
    checks: list[tuple[float, dict]] = []  # every lease judgement of the admitter: (when, expired)
    judge = adm.leases.expired

    def counted(now: float, *args):
        out = judge(now, *args)
        checks.append((now, out))
        return out

    adm.leases.expired = counted
    beating = asyncio.Event()
    seq = 0

    async def heartbeats() -> None:  # the worker's loop: every 0.1 s while it is connected
        nonlocal seq
        while True:
            await beating.wait()
            seq += 1
            hb = Heartbeat(worker="w1", seq=seq, ts=time.time(), interval=0.1, inflight=[req.id])
            await worker.publish(S.heartbeat("w1"), hb)
            await asyncio.sleep(0.1)

    req = request(tokens=100)  # 300 runtime tokens
    beat = asyncio.create_task(heartbeats())
    try:
        await publish(worker, req)
        assert await until(lambda: adm.shared.usage.used == 300)
        [(_, data)] = await worker.stream_messages(S.STREAM_ADMITTED)  # the router's part: assign it to w1
        adm_msg = Admitted.decode(data)
        a = Assignment(request=adm_msg.request, worker="w1", runtime_tokens=300, admitted_at=adm_msg.admitted_at,
                       routed_at=time.time(), fence=fence.sign(None, req.id, "w1", 0))
        await worker.jpublish(S.work("w1"), a, msg_id=M.work(req.id))
        beating.set()
        assert await until(lambda: adm.leases.reported(req.id))
        beating.clear()
        own_server.kill()
        killed = time.time()
        # the admitter judges leases every 0.1 s: wait until it has judged 1 s of outage (3 leases)
        assert await until(lambda: any(now - killed > 1.0 for now, _ in checks), timeout=10)
        assert [out for _, out in checks if out] == []  # nothing expired while nothing could be heard
        assert "w1" in adm.leases.workers
        own_server.start()  # the same port and data dir
        assert await until(lambda: adm.bus.server_changes == 1, timeout=30)
        back = time.time()
        # the worker comes back a heartbeat later than the admitter (well within its lease)
        assert await until(lambda: any(now - back > 0.1 for now, _ in checks), timeout=10)
        beating.set()
        assert await until(lambda: worker.connected, timeout=30)
        done = make_completion(req.id, runtime_tokens=300)
        await worker.jpublish(S.completion(done.tenant, "w1"), done, msg_id=M.completion(req.id, done.fence))
        assert await until(lambda: adm.shared.usage.used == 0)  # attempt 0's completion accepted
        assert [out for _, out in checks if out] == []
        assert adm.shared.stale == 0
        admitted = [Admitted.decode(d) for _, d in await worker.stream_messages(S.STREAM_ADMITTED)]
        assert [(x.request.id, x.attempt) for x in admitted] == [(req.id, 0)]  # no rescue's attempt 1
        records = [Decision.decode(d) for _, d in await worker.stream_messages(S.STREAM_DECISIONS)]
        assert [x for x in records if x.decision == "rescue"] == []
    finally:
        beat.cancel()
        await worker.close()
        await stop(adm)
