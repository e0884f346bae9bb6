"""The router service on a real nats-server, with workers played by the test."""

import asyncio
import time

import pytest

from natsched.wire import codec
from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.wire.schema import Admitted, Assignment, CacheEvent, Control
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from tests.factories.core import make_completion, make_heartbeat, make_request
from tests.factories.core import wait_for as until


@pytest.fixture
async def router(bus, nats_url):
    service = RouterService(await Bus.connect(nats_url, name="router"), RouterServiceSettings(
        core=RouterSettings(policy="least_loaded", heartbeat_timeout_s=1.0), tick_s=0.2, retry_delay_s=0.2))
    await service.start()
    try:
        yield service
    finally:
        await service.bus.close()


class WorkSeen:
    def __init__(self):
        self.assigned: dict[str, str] = {}
        self.controls: list[tuple[str, Control]] = []

    async def start(self, bus):
        async def on_work(subject, data, headers):
            a = Assignment.decode(data)
            self.assigned[a.request.id] = a.worker

        async def on_ctl(subject, data, headers):
            self.controls.append((subject, Control.decode(data)))

        await bus.subscribe(S.WORK_ALL, on_work)
        await bus.subscribe("worker.*.ctl", on_ctl)
        return self


async def admit(bus, n=1):
    ids = []
    for _ in range(n):
        req = make_request(max_tokens=4)
        await bus.jpublish(S.admitted(S.DEFAULT_POOL, req.cls, req.tenant), Admitted(request=req, runtime_tokens=10,
                                                                     admitted_at=time.time()), msg_id=req.id)
        ids.append(req.id)
    return ids


async def beat(bus, worker, seq, **kw):
    await bus.publish(S.heartbeat(worker), make_heartbeat(worker, seq=seq, interval=0.2, **kw))


async def test_a_worker_that_stops_heartbeating_stops_receiving_work(router, bus):
    seen = await WorkSeen().start(bus)
    for seq in range(1, 4):
        await beat(bus, "wa", seq)
        await beat(bus, "wb", seq)
        await asyncio.sleep(0.1)
    first = await admit(bus, 4)
    assert await until(lambda: len(seen.assigned) == 4)
    assert {seen.assigned[r] for r in first} == {"wa", "wb"}
    for seq in range(4, 30):  # wb goes silent; wa keeps beating past wb's 1 s timeout
        await beat(bus, "wa", seq)
        await asyncio.sleep(0.1)
    later = await admit(bus, 4)
    assert await until(lambda: all(r in seen.assigned for r in later))
    assert {seen.assigned[r] for r in later} == {"wa"}


async def test_a_sequence_gap_triggers_a_snapshot_request(router, bus):
    seen = await WorkSeen().start(bus)
    await beat(bus, "wg", 1)
    await bus.publish(S.cache_events("wg"), CacheEvent(worker="wg", seq=1, kind="stored", ts=time.time(), hashes=[1]))
    await bus.publish(S.cache_events("wg"), CacheEvent(worker="wg", seq=3, kind="stored", ts=time.time(), hashes=[2]))
    assert await until(lambda: any(s == S.control("wg") and c.kind == "snapshot" for s, c in seen.controls))


async def test_hostile_reports_are_ignored_and_service_keeps_routing(router, bus):
    seen = await WorkSeen().start(bus)
    await bus.publish(S.heartbeat("wn"), codec.encode(make_heartbeat("wn").to_wire() | {"running": -50}))
    await bus.publish(S.heartbeat("wn"), b"\xc1garbage")
    await bus.publish(S.cache_events("wn"), codec.encode({"worker": "wn", "seq": 1, "kind": "stored", "ts": 0,
                                                          "hashes": [1], "block_size": -4}))
    await bus.publish(S.cache_events("ghost"), CacheEvent(worker="ghost", seq=7, kind="stored", ts=0, hashes=[9]))
    await asyncio.sleep(0.3)
    assert "wn" not in router.core.workers  # a negative load is refused, not believed
    await beat(bus, "wok", 1)
    ids = await admit(bus, 2)
    assert await until(lambda: all(seen.assigned.get(r) == "wok" for r in ids))


async def test_routing_audit_records_every_candidates_score_terms(bus, nats_url):
    from natsched.wire.schema import Decision

    service = RouterService(await Bus.connect(nats_url, name="router-n"), RouterServiceSettings(
        core=RouterSettings(policy="natsched")))
    await service.start()
    try:
        seen = await WorkSeen().start(bus)
        await beat(bus, "wa", 1)
        await beat(bus, "wb", 1)
        assert await until(lambda: len(service.core.workers) == 2)
        (rid,) = await admit(bus, 1)
        assert await until(lambda: rid in seen.assigned)
        await asyncio.sleep(0.2)
        (record,) = [Decision.decode(d) for _, d in await bus.stream_messages(S.STREAM_DECISIONS)]
        assert record.stage == "routing" and record.worker == seen.assigned[rid] and record.policy == "natsched"
        assert set(record.scores) == {"wa", "wb"}
        for terms in record.scores.values():
            assert {"wait_s", "prefill_s", "decode_s", "cache_bonus", "score"} <= set(terms)
    finally:
        await service.bus.close()


async def test_metrics_count_assignments_migrations_and_refused_reports(router, bus):
    seen = await WorkSeen().start(bus)
    await beat(bus, "wa", 1)
    await bus.publish(S.heartbeat("wbad"), codec.encode(make_heartbeat("wbad").to_wire() | {"waiting": -1}))
    same_prefix = [make_request(prompt_token_ids=list(range(64)) + [i], max_tokens=2) for i in range(3)]
    for req in same_prefix:
        await bus.jpublish(S.admitted(S.DEFAULT_POOL, req.cls, req.tenant), Admitted(request=req, runtime_tokens=10,
                                                                     admitted_at=time.time()), msg_id=req.id)
    assert await until(lambda: len(seen.assigned) == 3)
    m = router.metrics
    assert m.assignments.labels("least_loaded", "wa")._value.get() == 3
    assert m.prefix_routes._value.get() == 2 and m.prefix_migrations._value.get() == 0  # one worker: no moves
    assert m.bad_reports.labels("heartbeat")._value.get() == 1


async def test_a_worker_cannot_report_for_another(router, bus):
    await bus.publish(S.heartbeat("wreal"), make_heartbeat("wimpostor"))
    await bus.publish(S.cache_events("wreal"), CacheEvent(worker="wother", seq=1, kind="stored", ts=0, hashes=[1]))
    await asyncio.sleep(0.3)
    assert "wimpostor" not in router.core.workers
    assert router.metrics.bad_reports.labels("heartbeat")._value.get() == 1
    assert router.metrics.bad_reports.labels("cache_event")._value.get() == 1


async def test_every_router_replica_releases_what_it_routed_when_the_completion_comes(bus, nats_url):
    """Completions are watched by every replica, not shared out by a durable consumer: a replica
    handed another's completion could not release the load (or the ledger entry) of its own."""
    replicas = []
    for name in ("ra", "rb"):
        service = RouterService(await Bus.connect(nats_url, name=name), RouterServiceSettings(
            name=name, core=RouterSettings(policy="least_loaded", heartbeat_timeout_s=5.0), tick_s=0.2))
        await service.start()
        replicas.append(service)
    try:
        seen = await WorkSeen().start(bus)
        await beat(bus, "wc", 1)
        assert await until(lambda: all("wc" in r.core.workers for r in replicas))
        ids = await admit(bus, 20)
        assert await until(lambda: len(seen.assigned) == 20)
        assert sum(len(r.core.registry.ledger) for r in replicas) == 20
        assert all(r.core.registry.ledger for r in replicas)  # both routed some
        # one replica's completions first: a consumer shared round-robin would hand about half of
        # them to the other replica (in routing order it can happen to match)
        ordered = [rid for r in replicas for rid in ids if rid in r.core.registry.ledger]
        for rid in ordered:
            await bus.jpublish(S.completion("t1", "wc"), make_completion(rid, runtime_tokens=10, worker="wc"),
                               msg_id=f"{rid}:done")
        assert await until(lambda: not any(r.core.registry.ledger for r in replicas))
    finally:
        for r in replicas:
            await r.bus.close()


async def test_a_hand_off_copy_after_its_completion_is_not_routed_again(router, bus):
    """After an unclean server restart, a hand-off whose ack the server lost comes back, and the
    restarted server's dedup has forgotten the consumed WORK message: routed again, a finished
    request ran a second time (issue 26). Played here by the copy itself (another msg id, as the
    forgotten dedup lets it through): once its attempt's fenced completion was seen, the copy is
    acked and not routed; a copy of a *later* attempt (a rescue) still is, and a forged
    completion is not remembered."""
    routed: list[tuple[str, int]] = []

    async def on_work(subject, data, headers):
        a = Assignment.decode(data)
        routed.append((a.request.id, a.attempt))

    async def admitted_empty():
        return await bus.stream_messages(S.STREAM_ADMITTED) == []

    async def worker_alive():  # the worker's heartbeat loop (0.2 s), for the whole test
        for seq in range(1, 10_000):
            await beat(bus, "wf", seq)
            await asyncio.sleep(0.2)

    await bus.subscribe(S.WORK_ALL, on_work)
    beating = asyncio.create_task(worker_alive())
    try:
        await _finished_copy_is_not_routed(router, bus, routed, admitted_empty)
    finally:
        beating.cancel()


async def _finished_copy_is_not_routed(router, bus, routed, admitted_empty):
    assert await until(lambda: "wf" in router.core.workers)
    req = make_request(max_tokens=4)
    adm = Admitted(request=req, runtime_tokens=10, admitted_at=time.time())
    await bus.jpublish(S.admitted(S.DEFAULT_POOL, req.cls, req.tenant), adm, msg_id=f"{req.id}:adm")
    assert await until(lambda: routed == [(req.id, 0)])
    done = make_completion(req.id, worker="wf")
    await bus.jpublish(S.completion(done.tenant, "wf"), done, msg_id=f"{req.id}:done:{done.fence}")
    assert await until(lambda: f"{req.id}:0" in router.finished)
    await bus.jpublish(S.admitted(S.DEFAULT_POOL, req.cls, req.tenant), adm, msg_id=f"{req.id}:adm-copy")
    assert await until(admitted_empty)  # the copy is acked ...
    await bus.flush()
    assert routed == [(req.id, 0)]  # ... and not routed
    assert router.metrics.finished_copies._value.get() == 1
    forged = make_completion(req.id, worker="wf", attempt=1, fence="0" * 16)  # not the router's token
    await bus.publish(S.completion(forged.tenant, "wf"), forged)
    rescued = Admitted(request=req, runtime_tokens=10, admitted_at=adm.admitted_at, attempt=1, avoid=["wx"])
    await bus.jpublish(S.admitted(S.DEFAULT_POOL, req.cls, req.tenant), rescued, msg_id=f"{req.id}:adm:1")
    assert await until(lambda: routed == [(req.id, 0), (req.id, 1)])  # a later attempt is routed
    assert router.metrics.finished_copies._value.get() == 1


async def test_a_hand_off_copy_before_its_completion_goes_to_the_same_worker_unchanged(router, bus):
    """The copy of a hand-off whose ack a server restart lost can come back before its attempt's
    completion (the worker's publish is retried after the same restart): routed anew, it went to
    another worker and ran a finished request twice (``natsched chaos --scenario recovery``, 1–2
    of 300). Now it is sent again, unchanged (worker, routed_at, fence), under the same message
    id: WORK deduplicates it while the first is known, and otherwise the worker that ran it acks
    it from its own memory. A later attempt (a rescue) is routed anew."""
    sent: list[Assignment] = []

    async def on_work(subject, data, headers):
        sent.append(Assignment.decode(data))

    await bus.subscribe(S.WORK_ALL, on_work)
    for seq, worker in enumerate(("wa", "wb"), 1):
        await beat(bus, worker, seq)
    assert await until(lambda: {"wa", "wb"} <= set(router.core.workers))
    req = make_request(max_tokens=4)
    adm = Admitted(request=req, runtime_tokens=10, admitted_at=time.time())
    await bus.jpublish(S.admitted(S.DEFAULT_POOL, req.cls, req.tenant), adm, msg_id=f"{req.id}:adm")
    assert await until(lambda: len(sent) == 1)
    first = sent[0].worker
    other = "wb" if first == "wa" else "wa"
    await beat(bus, first, 10, running=50, waiting=50)  # fresh routing would now pick the other one
    await beat(bus, other, 11)
    assert await until(lambda: router.core.workers[first].running == 50)
    await bus.jpublish(S.admitted(S.DEFAULT_POOL, req.cls, req.tenant), adm, msg_id=f"{req.id}:adm-copy")
    assert await until(lambda: len(sent) == 2)
    again = sent[1]
    assert (again.worker, again.routed_at, again.fence, again.reply_fence, again.attempt) == \
        (first, sent[0].routed_at, sent[0].fence, sent[0].reply_fence, 0)
    assert router.metrics.repeated_copies._value.get() == 1
    assert len(await bus.stream_messages(S.STREAM_WORK)) == 1  # the server deduplicated the copy
    rescued = Admitted(request=req, runtime_tokens=10, admitted_at=adm.admitted_at, attempt=1, avoid=[first])
    await bus.jpublish(S.admitted(S.DEFAULT_POOL, req.cls, req.tenant), rescued, msg_id=f"{req.id}:adm:1")
    assert await until(lambda: len(sent) == 3)
    assert (sent[2].worker, sent[2].attempt) == (other, 1) and sent[2].routed_at > sent[0].routed_at
    assert router.metrics.repeated_copies._value.get() == 1
