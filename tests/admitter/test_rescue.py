"""A dead worker's unfinished requests: re-admitted (still reserved), re-routed, one outcome each."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import pytest

from natsched.admitter.rescue import readmission, stranded
from natsched.admitter.shared import Reservation
from natsched.wire import fence
from natsched.wire import subjects as S
from natsched.client.producer import Client, Timeouts
from natsched.client.errors import RequestFailed
from natsched.wire.schema import Admitted, Assignment, Completion, Decision, Reply, WorkerId
from tests.factories.core import make_completion, make_request, wait_for
from tests.factories.stack import start_stack, start_worker, stop_workers
from tests.admitter.test_service import start_admitter, stop
from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.bus.connection import Bus


def make_assignment(worker: str = "wdead", *, attempt: int = 0, avoid: list[str] | None = None, **req) -> Assignment:
    return Assignment(request=make_request(**req), worker=WorkerId(worker), runtime_tokens=300, admitted_at=1.0,
                      routed_at=2.0, attempt=attempt, avoid=avoid or [])


# --- the pure parts -------------------------------------------------------------------------

def test_readmission_is_the_next_attempt_avoiding_every_dead_worker():
    a = make_assignment("w2", attempt=1, avoid=["w1"])
    adm = readmission(a, WorkerId("w2"), "admitter-b")
    assert (adm.attempt, adm.avoid, adm.runtime_tokens, adm.admitted_at) == (2, ["w1", "w2"], 300, 1.0)
    assert adm.request == a.request and adm.admitter == "admitter-b"
    assert readmission(a, WorkerId("w1"), "x").avoid == ["w1"]  # named once


def test_only_subjects_of_dead_workers_with_messages_are_stranded():
    counts = {"work.alive": 3, "work.dead": 2, "work.gone": 0, "other.x": 5}
    assert stranded(counts, lambda w: w == "alive") == [("dead", "work.dead")]
    assert S.work_owner("work.w1") == "w1" and S.work_owner("work.a.b") is None and S.work_owner("req.x") is None


# --- one replica's sweep against a real server ------------------------------------------------

async def reserve(adm, a: Assignment) -> None:
    await adm.shared.record(Reservation(a.request.id, a.request.tenant, a.request.model, a.runtime_tokens,
                                        time.time(), adm.settings.name))


async def admitted(bus) -> list[Admitted]:
    return [Admitted.decode(d) for _, d in await bus.stream_messages(S.STREAM_ADMITTED)]


async def test_a_sweep_readmits_stranded_work_once_and_removes_what_already_finished(bus, nats_url):
    adm = await start_admitter(nats_url, rescue_grace_s=0.0)  # no heartbeats from wdead: dead for it
    try:
        running, finished = make_assignment(), make_assignment()
        await reserve(adm, running)  # finished: its completion released its reservation already
        for a in (running, finished):
            await bus.jpublish(S.work(a.worker), a, msg_id=f"{a.request.id}:work")
        await bus.jpublish(S.work(WorkerId("wdead")), b"\x00not msgpack")
        first = await adm.reclaim({})
        second = await adm.reclaim({})  # another sweep (or replica) finds nothing left to do
        assert first.rescued == {running.request.id: "wdead"} and first.finished == [finished.request.id]
        assert first.bad == 1 and not second.rescued and not second.finished
        assert await bus.stream_messages(S.STREAM_WORK) == []
        [again] = await admitted(bus)
        assert (again.request.id, again.attempt, again.avoid) == (running.request.id, 1, ["wdead"])
        assert adm.shared.reservations[running.request.id].moved_from == "wdead"  # still reserved
        dead = await bus.stream_messages(S.STREAM_DEADLETTER)
        assert len(dead) == 1
    finally:
        await stop(adm)


async def test_two_replicas_rescuing_the_same_message_store_it_once(bus, nats_url):
    a1 = await start_admitter(nats_url, "a1", rescue_grace_s=0.0)
    a2 = await start_admitter(nats_url, "a2", rescue_grace_s=0.0)
    try:
        stuck = make_assignment()
        await reserve(a1, stuck)
        await bus.jpublish(S.work(stuck.worker), stuck)
        reports = await asyncio.gather(a1.reclaim({}), a2.reclaim({}))
        assert sum(len(r.rescued) for r in reports) >= 1
        assert [x.request.id for x in await admitted(bus)] == [stuck.request.id]  # deduplicated
        # the expired lease of wdead on either replica does not free the moved reservation
        await a2.reclaim({"wdead": {stuck.request.id}})
        kept = await a2.shared.lookup(stuck.request.id)
        assert kept is not None and kept.moved_from == "wdead"
        assert a1.shared.usage.used == a2.shared.usage.used
    finally:
        await stop(a1, a2)


# --- the producer's side -----------------------------------------------------------------------

async def serve_replies(bus, req, replies: list[Reply]) -> None:
    """Play the services' part on the request's reply subject once it is published."""
    assert await wait_for(lambda: req.reply is not None, timeout=5)
    await asyncio.sleep(0.2)  # the client subscribed before it published
    attempt = 0
    for r in replies:
        if r.kind == "status":  # the services' news, on the reply subject itself
            attempt += r.status == "rerouted"
            await bus.publish(req.reply, r)
        else:  # a worker's output: on its own sub-subject, with its reply fence (natsched.wire.fence)
            r.attempt, r.fence = attempt, fence.reply_sign(fence.reply_key(None, req.tenant), req.id, r.worker, attempt)
            await bus.publish(S.worker_reply(req.reply, r.worker), r)


async def test_a_reroute_before_any_output_is_invisible_and_late_tokens_of_the_dead_worker_are_ignored(bus):
    req = make_request(tenant="t1")
    rid = req.id
    script = [Reply(request_id=rid, kind="status", status="assigned", worker="wa"),
              Reply(request_id=rid, kind="status", status="rerouted", worker="wa"),
              Reply(request_id=rid, kind="token", text="stale", worker="wa"),  # fenced as attempt 1: refused, wa was left
              Reply(request_id=rid, kind="status", status="assigned", worker="wb"),
              Reply(request_id=rid, kind="token", text="fresh", worker="wb"),
              Reply(request_id=rid, kind="result", worker="wb", output_tokens=1)]
    client = Client(bus, Timeouts(admission=5, idle=5))  # no services: the test plays them
    result, _ = await asyncio.gather(client.submit(req), serve_replies(bus, req, script))
    assert (result.text, result.worker) == ("fresh", "wb")
    assert "rerouted" in result.statuses


async def test_a_stream_that_already_had_output_fails_with_worker_lost(bus):
    """Its output came without token ids, so nobody can go on after it (a migration needs them:
    ``tests/client/test_retry_timeouts.py``): the consumer is told, not given a restart."""
    req = make_request(tenant="t1")
    rid = req.id
    script = [Reply(request_id=rid, kind="token", text="half", worker="wa"),
              Reply(request_id=rid, kind="status", status="rerouted", worker="wa")]
    client = Client(bus, Timeouts(admission=5, idle=5))

    async def read():
        return [c.text async for c in client.stream(req)]

    with pytest.raises(RequestFailed) as err:
        await asyncio.gather(read(), serve_replies(bus, req, script))
    assert err.value.reason == "worker_lost"


# --- kill -9 of a real worker process mid-run ------------------------------------------------------

async def kill_wa_mid_run(bus, nats_url, *, restart: bool) -> None:
    """wa and wb run 8 long requests; wa is killed with SIGKILL (and, with ``restart``, started
    again at once under its id, its lease made endless so that only the restart can trigger the
    rescue): wa's unfinished requests complete on wb, one outcome each, nothing leaked."""
    stack = await start_stack(nats_url, workers=0, timeouts=Timeouts(admission=20, idle=20 if restart else 30))
    if restart:
        stack.admitter.leases.missed = 10_000  # no lease expires in this test
    procs = [start_worker(nats_url, w) for w in ("wa", "wb")]
    try:
        assert await wait_for(lambda: len(stack.router.core.workers) == 2, timeout=10)
        first_start = stack.admitter._instances["wa"]
        reqs = [make_request(f"question {i} " * 8, max_tokens=300) for i in range(8)]  # seconds each
        runs = [asyncio.create_task(stack.client.submit(r)) for r in reqs]
        lease = lambda: stack.admitter.leases.workers.get("wa")  # noqa: E731
        assert await wait_for(lambda: lease() is not None and lease().inflight, timeout=15)
        on_wa = set(lease().inflight)
        os.kill(procs[0].pid, signal.SIGKILL)
        if restart:
            procs[0].wait()
            procs[0] = start_worker(nats_url, "wa")  # same id, same durable consumer
        results = await asyncio.gather(*runs)
        assert [r.status for r in results] == ["completed"] * len(reqs)
        assert {r.worker for r in results if r.request_id in on_wa} == {"wb"}  # rescued, avoiding wa
        done = Counter(Completion.decode(d).request_id for _, d in await bus.stream_messages(S.STREAM_COMPLETIONS))
        assert done == Counter(r.id for r in reqs)  # exactly one outcome each
        rescues = [Decision.decode(d) for _, d in await bus.stream_messages(S.STREAM_DECISIONS)]
        assert on_wa <= {x.request_id for x in rescues if x.decision == "rescue"}
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0, timeout=10)  # nothing leaked
        if restart:
            assert stack.admitter._instances["wa"] != first_start  # the restart was seen from started_at
            assert "wa" not in stack.admitter._dead  # its lease never expired
            more = make_request("after the restart", max_tokens=4)  # the restarted worker takes new work
            assert (await stack.client.submit(more)).status == "completed"
        else:
            assert await bus.stream_messages(S.STREAM_WORK) == []
    finally:
        stop_workers(procs)
        await stack.close()


async def test_kill_9_of_a_worker_mid_run_reroutes_its_work_with_one_outcome_each(bus, nats_url):
    await kill_wa_mid_run(bus, nats_url, restart=False)


async def test_kill_9_of_a_worker_mid_stream_the_stream_goes_on_on_the_other(bus, nats_url):
    """A stream of 600 tokens (~4 s of real-time decode: the kill lands mid-stream even when this
    reader lags); its worker is killed with SIGKILL after 20 went out. The admitter
    rescues it, the producer migrates it (the next try carries the 20 ids), and the survivor
    goes on: the consumer reads tok0..tok599 exactly once, in order, from two workers."""
    stack = await start_stack(nats_url, workers=0, timeouts=Timeouts(admission=20, idle=30))
    procs = {w: start_worker(nats_url, w) for w in ("wa", "wb")}
    try:
        assert await wait_for(lambda: len(stack.router.core.workers) == 2, timeout=10)
        request = make_request("a long story " * 8, max_tokens=600)
        stream = stack.client.stream(request)
        chunks, killed = [], None
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 20:
                killed = stream._progress.worker
                os.kill(procs[killed].pid, signal.SIGKILL)
        assert "".join(c.text for c in chunks) == "".join(f" tok{i}" for i in range(600))
        assert [c.index for c in chunks] == list(range(len(chunks)))
        r = stream.result
        assert (r.migrations, r.output_tokens, r.text) == (1, 600, "".join(c.text for c in chunks))
        assert r.worker != killed
        done = {Completion.decode(d).request_id: Completion.decode(d)
                for _, d in await bus.stream_messages(S.STREAM_COMPLETIONS)}
        assert done[f"{request.id}-r1"].status == "ok"  # the continuation; the rescued try was cancelled
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0, timeout=10)  # nothing leaked
    finally:
        stop_workers(procs.values())
        await stack.close()


async def test_a_worker_that_died_between_its_completion_and_its_ack_is_not_run_again(bus, nats_url):
    """The completion is stored but the admitters have not processed it yet (slowed down here):
    the sweep waits for them, finds the reservation released, and only removes the message."""
    adm = AdmitterService(await Bus.connect(nats_url, name="slow"), AdmitterServiceSettings(
        name="slow", rescue_grace_s=0.0, reconcile_interval_s=3600))
    handle = adm._on_completions

    async def slow(batch):
        await asyncio.sleep(1.0)
        await handle(batch)

    adm._on_completions = slow
    await adm.start()
    try:
        done = make_assignment()
        await reserve(adm, done)
        await bus.jpublish(S.work(done.worker), done)
        await bus.jpublish(S.completion("t1", done.worker), make_completion(done.request.id, runtime_tokens=300,
                                                                            worker=done.worker),
                           msg_id=f"{done.request.id}:done")
        report = await adm.reclaim({})
        assert report.finished == [done.request.id] and not report.rescued
        assert await admitted(bus) == [] and await bus.stream_messages(S.STREAM_WORK) == []
    finally:
        await stop(adm)


async def test_a_finished_request_whose_completion_is_never_acked_is_not_run_again(bus, nats_url):
    """As a killed admitter leaves it: the completion was delivered and will not be acked before
    the ack wait, so the ack floor stays below it. The sweep reads the completions above the
    floor, sees this request finished, and only removes the message (the reservation waits for
    the completion's redelivery)."""
    adm = AdmitterService(await Bus.connect(nats_url, name="stuck"), AdmitterServiceSettings(
        name="stuck", rescue_grace_s=0.0, reconcile_interval_s=3600))

    async def never(batch):
        await asyncio.Event().wait()

    adm._on_completions = never
    await adm.start()
    try:
        done, running = make_assignment(), make_assignment()
        for a in (done, running):
            await reserve(adm, a)
            await bus.jpublish(S.work(a.worker), a)
        await bus.jpublish(S.completion("t1", done.worker), make_completion(done.request.id, runtime_tokens=300,
                                                                            worker=done.worker),
                           msg_id=f"{done.request.id}:done")
        report = await adm.reclaim({})
        assert report.finished == [done.request.id]
        assert report.rescued == {running.request.id: "wdead"}
        assert [x.request.id for x in await admitted(bus)] == [running.request.id]
        assert await bus.stream_messages(S.STREAM_WORK) == []
        assert (await adm.shared.lookup(done.request.id)).moved_from == "wdead"  # released by its completion
    finally:
        await stop(adm)


async def test_a_worker_restarted_inside_its_lease_has_its_predecessors_work_rescued_at_once(bus, nats_url):
    """kill -9 and a restart under the same id before the lease expires: the lease never lapses,
    yet the predecessor's un-acked work is re-run elsewhere long before the 30 s ack wait
    would bring it back (the clients give up after 20 s)."""
    await kill_wa_mid_run(bus, nats_url, restart=True)
