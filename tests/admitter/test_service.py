"""The admitter service on a real nats-server: shared state, replicas, queue, leases, repair."""

import asyncio
import time

import orjson
import pytest

from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.client.producer import make_request
from natsched.bus.connection import Bus
from natsched.bus.errors import StreamNotFound
from natsched.bus.provision import StreamLimits
from natsched.client.batch import SUBMITTED, WAITING, JobStore
from natsched.wire.schema import Admitted, Decision, Heartbeat, JobRecord, Reply, Request
from tests.factories.core import make_completion
from tests.factories.core import wait_for as until


async def start_admitter(url, name="admitter", **kw) -> AdmitterService:
    kw.setdefault("ack_wait_s", 5.0)
    kw.setdefault("keepalive_s", 1.0)
    kw.setdefault("reconcile_interval_s", 3600)  # tests call reconcile_once themselves
    service = AdmitterService(await Bus.connect(url, name=name), AdmitterServiceSettings(name=name, **kw))
    await service.start()
    return service


async def stop(*services):
    for s in services:
        await s.bus.close()


async def set_quotas(bus, **entries):
    for key, value in entries.items():
        await bus.kv(S.BUCKET_QUOTAS).put(key.replace("__", "."), orjson.dumps(value))


def request(tenant="t1", tokens=100, cls="online", **kw) -> Request:
    # runtime tokens = 2 * prompt + max_tokens
    return make_request(tenant, prompt_token_ids=list(range(tokens)), cls=cls, max_tokens=tokens, **kw)


async def publish(bus, req: Request) -> None:
    req.reply = req.reply or S.reply(req.id)
    await bus.jpublish(S.request(req.cls, req.tenant), req, msg_id=req.id, headers={S.HDR_REPLY: req.reply})


async def decisions(bus, stage="admission"):
    return [Decision.decode(d) for _, d in await bus.stream_messages(S.STREAM_DECISIONS) if
            Decision.decode(d).stage == stage]


async def test_three_replicas_racing_never_over_admit(bus, nats_url):
    await set_quotas(bus, cluster__total=3000, class__online__queue=0)  # 10 requests of 300 fit
    # one request per fetch, so the three replicas really interleave their decisions
    replicas = [await start_admitter(nats_url, f"adm{i}", fetch_batch=1) for i in range(3)]
    try:
        await asyncio.gather(*(publish(bus, request()) for _ in range(40)))
        async def all_decided():
            return len(await decisions(bus)) == 40
        assert await until(all_decided)
        ds = await decisions(bus)
        allowed = [d for d in ds if d.decision == "allow"]
        assert len(allowed) == 10  # compare-and-swap: exactly what fits, never more
        assert len({d.by for d in ds}) >= 2  # the replicas really shared the work
        usage = Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
        assert usage.used == 3000
    finally:
        await stop(*replicas)


async def test_reservations_survive_an_admitter_restart(bus, nats_url):
    first = await start_admitter(nats_url)
    reqs = [request() for _ in range(3)]
    for r in reqs:
        await publish(bus, r)
    assert await until(lambda: first.shared.usage.used == 900)
    await stop(first)
    second = await start_admitter(nats_url, "admitter-2")
    try:
        assert second.shared.usage.used == 900 and set(await second.shared.snapshot()) == {r.id for r in reqs}
        assert not second.shared.reservations  # it remembers what it wrote; these it reads when needed
        await bus.jpublish(S.completion("t1", "w1"), make_completion(reqs[0].id, runtime_tokens=300), msg_id="c1")
        assert await until(lambda: second.shared.usage.used == 600)
    finally:
        await stop(second)


async def test_a_replica_frees_another_replicas_record_once_and_the_writer_forgets_it(bus, nats_url):
    """Replicas do not mirror each other's records: a release reads the record it never saw, and
    the writer drops its remembered copy at its next snapshot (its memory stays bounded)."""
    from natsched.admitter.shared import Reservation

    a = await start_admitter(nats_url, "adm-a")
    b = await start_admitter(nats_url, "adm-b")
    try:
        await a.shared.record(Reservation("r-x", "t1", "default", 300, time.time() - 60, "adm-a"))
        assert "r-x" in a.shared.reservations and "r-x" not in b.shared.reservations
        assert (await b.shared.take("r-x")).tokens == 300
        assert await b.shared.take("r-x") is None and await a.shared.take("r-x") is None  # once
        assert "r-x" not in await a.shared.snapshot()
        assert "r-x" not in a.shared.reservations
    finally:
        await stop(a, b)


async def test_a_duplicate_completion_releases_once(bus, nats_url):
    adm = await start_admitter(nats_url)
    try:
        r = request()
        await publish(bus, r)
        assert await until(lambda: adm.shared.usage.used == 300)
        for i in range(3):  # distinct msg ids: the stream stores all three
            await bus.jpublish(S.completion("t1", "w1"), make_completion(r.id, runtime_tokens=300), msg_id=f"dup{i}")
        assert await until(lambda: adm.shared.usage.used == 0)
        await asyncio.sleep(0.3)
        assert adm.shared.usage.used == 0 and adm.shared.usage.tenants.get("t1", 0) == 0
    finally:
        await stop(adm)


async def test_queued_request_is_held_then_admitted_when_tokens_free(bus, nats_url):
    await set_quotas(bus, cluster__total=300)
    adm = await start_admitter(nats_url)
    try:
        first, second = request(), request()
        sub = await bus.inbox(S.reply(second.id))
        await publish(bus, first)
        assert await until(lambda: adm.shared.usage.used == 300)
        await publish(bus, second)
        status = Reply.decode((await sub.next_msg(timeout=5)).data)
        assert (status.kind, status.status) == ("status", "queued") and status.est_wait is not None
        assert second.id in adm.held
        await asyncio.sleep(1.5)  # longer than keepalive: the held message is kept alive, not redelivered
        info = await bus.stream(S.STREAM_REQUESTS).consumer(S.CONSUMER_ADMITTER)
        assert info.ack_pending == 1 and info.redelivered == 0
        await bus.jpublish(S.completion("t1", "w1"), make_completion(first.id, runtime_tokens=300), msg_id="c-first")
        admitted = Reply.decode((await sub.next_msg(timeout=5)).data)
        assert admitted.status == "admitted"
        adm_msgs = [Admitted.decode(d) for _, d in await bus.stream_messages(S.STREAM_ADMITTED)]
        assert [a.request.id for a in adm_msgs] == [first.id, second.id] and adm_msgs[1].queue_wait > 1
    finally:
        await stop(adm)


async def test_a_crashed_replicas_queue_is_picked_up_by_another(bus, nats_url):
    await set_quotas(bus, cluster__total=300)
    a = await start_admitter(nats_url, "adm-a", ack_wait_s=2.0)
    first, second = request(), request()
    await publish(bus, first)
    assert await until(lambda: a.shared.usage.used == 300)
    await publish(bus, second)
    assert await until(lambda: second.id in a.held)
    await stop(a)  # a crash: its held message is never acked
    b = await start_admitter(nats_url, "adm-b", ack_wait_s=2.0)
    try:
        assert await until(lambda: second.id in b.held, timeout=10)  # redelivered after ack_wait
        await bus.jpublish(S.completion("t1", "w1"), make_completion(first.id, runtime_tokens=300), msg_id="c-1")
        assert await until(lambda: b.shared.reservations.get(second.id) is not None)  # b wrote it
        assert (await b.shared.lookup(second.id)).by == "adm-b"
    finally:
        await stop(b)


async def test_offline_class_is_degraded_to_the_offline_stream(bus, nats_url):
    adm = await start_admitter(nats_url)
    try:
        r = request(cls="offline")
        sub = await bus.inbox(S.reply(r.id))
        await publish(bus, r)
        reply = Reply.decode((await sub.next_msg(timeout=5)).data)
        assert (reply.status, reply.job_id) == ("degraded", r.id)
        offline = [Request.decode(d) for _, d in await bus.stream_messages(S.STREAM_OFFLINE)]
        assert [o.id for o in offline] == [r.id]
        assert adm.shared.usage.used == 0
        with pytest.raises(StreamNotFound):  # no bucket jobs yet (no producer or runner ran): none made
            await bus.stream(S.kv_stream(S.BUCKET_JOBS)).info()
    finally:
        await stop(adm)


async def test_a_degraded_requests_job_record_exists_when_its_producer_hears_the_job_id(bus, nats_url):
    """No offline runner runs: the record is the admitter's, stored before the reply is sent, so a
    client told the job id (the gateway's 422) finds it at once. A batch producer's own record of
    its request stays as it wrote it."""
    await bus.provision(jobs=True)  # the bucket is the batch producer's and the runner's to create
    adm = await start_admitter(nats_url)
    store = JobStore(bus)
    try:
        r = request(cls="offline")
        sub = await bus.inbox(S.reply(r.id))
        await publish(bus, r)
        assert Reply.decode((await sub.next_msg(timeout=5)).data).status == "degraded"
        record, _ = await store.get(S.job_key(r.tenant, S.NO_BATCH, r.id))
        assert (record.id, record.tenant, record.status, record.batch) == (r.id, r.tenant, WAITING, S.NO_BATCH)
        assert record.enqueued == 1 and record.history[-1]["event"] == "degraded"
        assert record.history[-1]["by"] == "admitter"
        assert await store.find(r.id, r.tenant) is not None and await store.find(r.id, "t2") is None

        b = request(cls="offline")
        b.reply = S.outcome(b.tenant, "b1", b.id)  # a batch producer's request: its record first
        key = S.job_key(b.tenant, "b1", b.id)
        assert await store.create(key, JobRecord(id=b.id, tenant=b.tenant, status=SUBMITTED, batch="b1", line=7))
        _, before = await store.get(key)
        outcomes = await bus.inbox(b.reply)
        await publish(bus, b)
        assert Reply.decode((await outcomes.next_msg(timeout=5)).data).status == "degraded"
        record, rev = await store.get(key)
        assert (rev, record.line) == (before, 7)
    finally:
        await stop(adm)


async def test_a_degrade_goes_on_when_its_job_record_cannot_be_stored(bus, nats_url, caplog):
    """Bucket ``jobs`` full (its limits are the operator's): the request is degraded all the same,
    the missing record is logged, and the offline runner writes it when it takes the job."""
    await bus.provision(jobs=True)
    await bus.set_retention({S.BUCKET_JOBS: StreamLimits(max_age_s=3600, max_bytes=1024)})
    await bus.kv(S.BUCKET_JOBS).put("filler", b"x" * 700)
    adm = await start_admitter(nats_url)
    try:
        r = request(cls="offline")
        sub = await bus.inbox(S.reply(r.id))
        await publish(bus, r)
        assert Reply.decode((await sub.next_msg(timeout=30)).data).status == "degraded"
        assert [Request.decode(d).id for _, d in await bus.stream_messages(S.STREAM_OFFLINE)] == [r.id]
        assert await JobStore(bus).find(r.id) is None
        assert "job records not stored" in caplog.text
    finally:
        await stop(adm)


async def test_a_silent_workers_leases_are_reclaimed(bus, nats_url):
    adm = await start_admitter(nats_url, lease_missed=3)
    try:
        r = request()
        await publish(bus, r)
        assert await until(lambda: adm.shared.usage.used == 300)
        for seq in range(1, 4):
            await bus.publish(S.heartbeat("w9"), Heartbeat(worker="w9", seq=seq, ts=time.time(), interval=0.2,
                                                           inflight=[r.id]))
            await asyncio.sleep(0.2)
        assert adm.leases.reported(r.id)
        # then silence: 3 missed heartbeats of 0.2 s
        assert await until(lambda: adm.shared.usage.used == 0, timeout=5)
        assert adm.metrics.repairs.labels("lease")._value.get() == 1
    finally:
        await stop(adm)


async def test_leases_are_judged_while_a_slow_reclaim_runs(bus, nats_url, caplog):
    """A reclaim slowed by the cluster (here: a stand-in that sleeps, as a leader election makes
    the real one wait) must not stop the lease checks, nor be taken for a pause of the admitter
    that restarts every other lease: a second worker dying meanwhile is seen on time."""
    adm = await start_admitter(nats_url, lease_missed=3)
    calls: list[tuple[float, set[str]]] = []

    async def slow_reclaim(expired):
        calls.append((time.monotonic(), set(expired)))
        if "w1" in expired:
            await asyncio.sleep(2.0)

    adm.reclaim = slow_reclaim
    try:
        async def beat(worker: str, n: int) -> None:
            for seq in range(1, n + 1):
                await bus.publish(S.heartbeat(worker), Heartbeat(worker=worker, seq=seq, ts=time.time(), interval=0.1))
                await asyncio.sleep(0.1)

        await asyncio.gather(beat("w1", 5), beat("w2", 5))
        await beat("w2", 3)  # w1 is silent from here, w2 a little later
        w2_silent = time.monotonic()
        assert await until(lambda: "w2" not in adm.leases.workers, timeout=5)
        judged_after = time.monotonic() - w2_silent
        assert await until(lambda: any("w2" in workers for _, workers in calls), timeout=5)
        first = next(t for t, workers in calls if "w1" in workers)
        second = next(t for t, workers in calls if "w2" in workers)
        assert second - first >= 1.9  # one reclaim at a time: w2's waited for w1's to end
        assert judged_after < 1.0, judged_after  # its lease was judged during w1's reclaim, not after it
        assert "was paused" not in caplog.text
    finally:
        await stop(adm)


async def test_reconciliation_repairs_a_drifted_aggregate(bus, nats_url):
    adm = await start_admitter(nats_url)
    try:
        r = request()
        await publish(bus, r)
        assert await until(lambda: adm.shared.usage.used == 300)
        current = await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE)
        await bus.kv(S.BUCKET_INFLIGHT).update(S.KEY_USAGE, Usage(used=5000, tenants={"t1": 5000}).to_json(),
                            current[1])
        assert await until(lambda: adm.shared.usage.used == 5000)
        assert await adm.reconcile_once() == 0  # seen once: could be a commit in flight
        assert await adm.reconcile_once() == 1
        assert adm.shared.usage.used == 300 and adm.shared.usage.tenants["t1"] == 300
        assert adm.metrics.repairs.labels("aggregate")._value.get() == 1
    finally:
        await stop(adm)


async def test_quota_edits_apply_live_and_bad_ones_are_refused(bus, nats_url):
    adm = await start_admitter(nats_url)
    try:
        await bus.kv(S.BUCKET_QUOTAS).put("tenant.a", orjson.dumps({"floor": 0.6, "weight": 1}))
        assert await until(lambda: "a" in adm.core.quotas.tenants, timeout=2)
        await bus.kv(S.BUCKET_QUOTAS).put("tenant.b", orjson.dumps({"floor": 0.6, "weight": 1}))  # 120 %
        await asyncio.sleep(0.5)
        # b's floor edit is refused (its floor stays at the previous value, 0); a keeps its 60 %
        assert adm.core.quotas.tenants["a"].floor == 0.6
        assert getattr(adm.core.quotas.tenants.get("b"), "floor", 0.0) == 0.0
        await bus.kv(S.BUCKET_QUOTAS).put("tenant.a", b"{corrupt")
        await asyncio.sleep(0.5)
        assert adm.core.quotas.tenants["a"].floor == 0.6
        assert adm.metrics.bad_quota_entries._value.get() >= 1
    finally:
        await stop(adm)


async def test_metrics_count_decisions_by_tenant_class_and_reason(bus, nats_url):
    adm = await start_admitter(nats_url)
    try:
        await publish(bus, request())
        await publish(bus, make_request("t1", "x", max_tokens=0))
        assert await until(lambda: adm.metrics.decisions.labels("t1", "online", "reject", "invalid_max_tokens")
                           ._value.get() == 1)
        assert adm.metrics.decisions.labels("t1", "online", "allow", "")._value.get() == 1
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        names = {f.name for f in text_string_to_metric_families(generate_latest(adm.metrics.registry).decode())}
        assert {"natsched_admission_decisions", "natsched_admission_decision_latency_seconds",
                "natsched_admission_queue_depth", "natsched_admission_reconciliation_repairs"} <= names
    finally:
        await stop(adm)


async def test_a_released_reservation_leaves_only_an_expiring_tombstone(bus, nats_url):
    """One key per request ever admitted must not stay in the bucket: the release purges the key
    with a marker that carries a TTL, and a release against a stale revision still conflicts."""
    from natsched.admitter.shared import MARKER_TTL_S, Reservation

    adm = await start_admitter(nats_url)
    try:
        rid = "r-tomb"
        await adm.shared.record(Reservation(rid, "t1", "default", 300, time.time(), "admitter"))
        stale = adm.shared.reservations[rid].revision
        moved = await adm.shared.mark_moved(rid, "w9")  # rewritten: the mirror's revision is old now
        assert moved is not None and moved.revision > stale
        adm.shared.reservations[rid].revision = stale
        taken = await adm.shared.take(rid)  # retried once against the revision read back
        assert taken is not None and taken.moved_from == "w9"
        raw = await bus.js.get_msg(f"KV_{S.BUCKET_INFLIGHT}", subject=f"$KV.{S.BUCKET_INFLIGHT}.{S.reservation_key(rid)}")
        assert raw.headers["KV-Operation"] == "PURGE" and raw.headers["Nats-TTL"] == f"{MARKER_TTL_S}s"
        assert await bus.kv(S.BUCKET_INFLIGHT).get(S.reservation_key(rid)) is None
        assert await adm.shared.take(rid) is None  # freed once
        assert await until(lambda: rid not in adm.shared.reservations, timeout=5)
    finally:
        await stop(adm)


async def test_between_full_reconciliations_a_replica_keeps_only_recent_own_records(bus, nats_url):
    """Its memory of its own records is bounded without a full read; the records stay stored."""
    from natsched.admitter.repair import REMEMBER_S
    from natsched.admitter.shared import Reservation

    adm = await start_admitter(nats_url)
    try:
        assert await adm.reconcile_once() == 0  # the first pass is a full one
        await adm.shared.record(Reservation("r-old", "t1", "default", 10, time.time() - REMEMBER_S - 5, "admitter"))
        await adm.shared.record(Reservation("r-new", "t1", "default", 10, time.time(), "admitter"))
        adm.shared.revision += 1  # usage moved since the last pass: not quiet, no full read
        assert await adm.reconcile_once() == 0
        assert set(adm.shared.reservations) == {"r-new"}
        assert (await adm.shared.lookup("r-old")) is not None
    finally:
        await stop(adm)


async def test_a_release_waiting_for_the_lock_rides_on_the_next_admission_commit(bus, nats_url):
    """Under load a completion and a request batch both wait for the replica's commit lock: the
    batch gives the released tokens back in its own compare-and-swap (one commit, not two) and
    can admit into them at once, instead of queueing behind a full cluster."""
    await set_quotas(bus, cluster__total=300)
    adm = await start_admitter(nats_url)
    try:
        first, second = request(), request()  # 300 runtime tokens each: one fills the cluster
        await publish(bus, first)
        assert await until(lambda: adm.shared.usage.used == 300)
        taken = await adm.shared.take(first.id)  # a completion's first step: the record is gone
        sub = await bus.inbox(S.reply(second.id))
        waiters = lambda: len(adm._lock._waiters or ())  # noqa: E731 - asyncio.Lock's queue, FIFO
        async with adm._lock:
            await publish(bus, second)
            assert await until(lambda: waiters() == 1)  # the batch with `second` waits first...
            release = asyncio.create_task(adm._release_taken([(make_completion(first.id, runtime_tokens=300),
                                                               taken)]))
            assert await until(lambda: waiters() == 2)  # ...then the release
            commits, change_usage = [], adm.shared.change_usage

            async def counted(fn):
                commits.append(fn)
                return await change_usage(fn)

            adm.shared.change_usage = counted
        await release
        status = Reply.decode((await sub.next_msg(timeout=5)).data)
        assert (status.kind, status.status) == ("status", "admitted")  # never queued
        assert len(commits) == 1  # both in one compare-and-swap
        assert adm.shared.usage.used == 300 and adm.shared.usage.tenants == {"t1": 300}
    finally:
        await stop(adm)


async def test_a_reconciliation_pass_that_fails_is_tried_again_at_the_next_interval(nats_url, bus):
    """The reservation read can stall or the server be away for a moment: the loop logs it and
    runs the next pass, it does not end (it ended on anything but an AdmitterError before)."""
    from natsched.bus.errors import SnapshotError

    adm = await start_admitter(nats_url, reconcile_interval_s=0.1)
    calls = []
    snapshot = adm.shared.snapshot

    async def failing_once():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise SnapshotError("reading inflight: nothing for 10s with 5 pending")
        return await snapshot()

    adm.shared.snapshot = failing_once
    try:
        assert await until(lambda: len(calls) >= 2, timeout=10)
    finally:
        await stop(adm)


async def test_the_reconciliation_loop_ends_once_the_connection_is_closed_for_good(nats_url, bus):
    """A closed connection (reconnects exhausted, or closed under it) cannot come back: the loop
    ends instead of warning at every interval for the rest of the process (it did in CI)."""
    adm = await start_admitter(nats_url, reconcile_interval_s=0.05)
    loop = next(t for t in adm.bus._tasks if t.get_name() == "_reconcile_loop")
    try:
        await adm.bus.nc.close()
        assert await until(loop.done, timeout=5)
        assert loop.exception() is None
    finally:
        await stop(adm)


async def test_an_undecodable_usage_is_rebuilt_from_the_records_by_the_next_commit_not_fatal(bus, nats_url, caplog):
    """Garbage in the shared ``usage`` key (a bad manual edit, a buggy tool): refused, counted,
    logged once, and the next commit first rebuilds it from the reservation records. Before,
    every commit lost its race to it, re-read it, failed to decode it, and nothing was admitted."""
    adm = await start_admitter(nats_url)
    try:
        first, second = request(), request()
        await publish(bus, first)
        assert await until(lambda: adm.shared.usage.used == 300)
        await bus.kv(S.BUCKET_INFLIGHT).put(S.KEY_USAGE, b"{not a usage")
        assert await until(lambda: adm.shared.corrupted > 0)
        assert caplog.text.count("refused") == 1 and adm.shared.refused == 1
        assert adm.shared.usage.used == 300  # the last good value, never decided on: rebuilt first
        sub = await bus.inbox(S.reply(second.id))
        await publish(bus, second)
        assert Reply.decode((await sub.next_msg(timeout=5)).data).status == "admitted"
        stored = Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
        assert stored.used == 600 and adm.shared.corrupted == 0 and adm.shared.rebuilt == 1
        adm._refresh_gauges()
        assert adm.metrics.registry.get_sample_value("natsched_admission_refused_kv_values_total") == 1
    finally:
        await stop(adm)


async def test_a_publish_ack_in_the_usage_key_is_never_read_as_zero(bus, nats_url):
    """The reply-to attack's write (``{"stream": ..., "seq": ...}``, a publish ack) on the usage
    key of a *starting* admitter, which has no last good value: it rebuilds from the records, so
    a second request that would fit only an empty cluster is not admitted (it was, 25 times over)."""
    await set_quotas(bus, cluster__total=500, class__online__queue=0)
    adm = await start_admitter(nats_url)
    first = request()
    await publish(bus, first)
    assert await until(lambda: adm.shared.usage.used == 300)
    await stop(adm)
    await bus.kv(S.BUCKET_INFLIGHT).put(S.KEY_USAGE, orjson.dumps({"stream": S.STREAM_REQUESTS, "seq": 7}))
    adm = await start_admitter(nats_url)
    try:
        assert adm.shared.corrupted and adm.shared.usage.used == 0  # nothing good read yet
        second = request()
        sub = await bus.inbox(S.reply(second.id))
        await publish(bus, second)
        reply = Reply.decode((await sub.next_msg(timeout=5)).data)
        assert (reply.status, reply.reason) == ("rejected", "quota_exhausted")
        stored = Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
        assert stored.used == 300 and stored.tenants == {"t1": 300}
    finally:
        await stop(adm)


async def test_reconciliation_rebuilds_an_undecodable_usage_from_the_records_at_once(bus, nats_url):
    """No commit may come for a while (credit pays, traffic stops): the next pass rewrites it from
    the reservation records, without the second look drift gets (nothing can be in flight)."""
    adm = await start_admitter(nats_url)
    try:
        await publish(bus, request())
        assert await until(lambda: adm.shared.usage.used == 300)
        await bus.kv(S.BUCKET_INFLIGHT).put(S.KEY_USAGE, orjson.dumps({"used": -5}))
        assert await until(lambda: adm.shared.corrupted > 0)
        assert await adm.reconcile_once() == 1
        stored = Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
        assert stored.used == 300 and stored.tenants == {"t1": 300} and adm.shared.corrupted == 0
    finally:
        await stop(adm)


async def test_a_request_running_past_its_price_grows_its_reservation_and_new_work_sees_it(bus, nats_url):
    """Priced at the learned output (10 tokens) but generating far more: its worker's heartbeat
    says it holds 450 runtime tokens; the reservation and the tenant's usage grow to that, so
    a request that fitted beside the old price is refused beside the new one. A worker that
    does not run the request cannot grow it; the completion releases the grown amount."""
    from natsched.admitter.policy import AdmissionSettings
    from tests.factories.core import make_heartbeat

    await set_quotas(bus, cluster__total=1000, class__online__queue=0)
    adm = await start_admitter(nats_url, admission=AdmissionSettings(calibrated_output=True, ewma_min_samples=1,
                                                                     calibrated_margin=0.0))
    try:
        adm.core.outputs.observe("t1", "default", 10)
        long_one = make_request(tenant="t1", prompt_token_ids=list(range(100)), max_tokens=400)
        await publish(bus, long_one)
        assert await until(lambda: adm.shared.usage.used == 210)  # 2 x 100 prompt + the learned 10
        await bus.publish(S.heartbeat("w2"), make_heartbeat("w2", inflight=[], over={long_one.id: 5000}))
        await bus.publish(S.heartbeat("w1"), make_heartbeat("w1", inflight=[long_one.id], over={long_one.id: 450}))
        assert await until(lambda: adm.shared.usage.used == 450)
        assert (await adm.shared.lookup(long_one.id)).tokens == 450  # w2's claim grew nothing
        other = make_request(tenant="t2", prompt_token_ids=list(range(100)), max_tokens=400)  # no estimate: 600
        sub = await bus.inbox(S.reply(other.id))
        await publish(bus, other)
        verdict = Reply.decode((await sub.next_msg(timeout=5)).data)
        assert (verdict.status, verdict.reason) == ("rejected", "quota_exhausted")  # 450 + 600 > 1000 (210 + 600 fit)
        await bus.jpublish(S.completion("t1", "w1"), make_completion(long_one.id, runtime_tokens=450), msg_id="g1")
        assert await until(lambda: adm.shared.usage.used == 0)
        assert adm.metrics.registry.get_sample_value("natsched_admission_grown_runtime_tokens_total") == 240
    finally:
        await stop(adm)


async def test_a_reservation_stored_before_its_ack_was_lost_is_kept_not_refused(bus, nats_url):
    """A stalled server stores the record's create and loses its ack; the batch publish retries
    and the create is refused (the key exists). It is this decision's own record: kept (the
    request was refused as its own duplicate and its reservation leaked, under load in the
    hostile chaos run). A second copy of the request, decided apart, is still refused."""
    from natsched.admitter.shared import Reservation

    adm = await start_admitter(nats_url)
    try:
        res = Reservation("lost-ack-1", "t1", "default", 100, time.time(), adm.settings.name)
        await bus.kv(S.BUCKET_INFLIGHT).create(S.reservation_key(res.request_id), res.to_json())  # stored, ack lost
        assert await adm._reserve([res]) == set() and res.revision > 0
        other = Reservation("lost-ack-1", "t1", "default", 100, res.ts + 1.0, "adm-b")
        assert await adm._reserve([other]) == {"lost-ack-1"}
    finally:
        await stop(adm)


async def test_open_mode_takes_unscoped_ids_as_they_are_one_namespace_for_every_tenant(bus, nats_url):
    """Without auth keys (no fence key: the open mode) a raw publisher's bare id is accepted as
    it is, as before issue 26's scoping: the ids then share one namespace, so another tenant's
    same bare id is refused as a ``duplicate`` (docs/reliability.md says so; under auth such an
    id is refused ``invalid``: tests/ops/test_auth_tenant_ids.py)."""
    adm = await start_admitter(nats_url)
    assert adm.bus.fence_key is None
    rid = f"x-open-{time.time_ns()}"
    try:
        first = request("t1")
        first.id, first.reply = rid, S.reply(f"{rid}-t1")
        sub = await bus.inbox(first.reply)
        await bus.jpublish(S.request(first.cls, "t1"), first, msg_id=f"{rid}-t1", headers={S.HDR_REPLY: first.reply})
        reply = Reply.decode((await sub.next_msg(timeout=10)).data)
        await sub.unsubscribe()
        assert (reply.kind, reply.status) == ("status", "admitted")
        before = adm.refused_duplicates
        second = request("t2")
        second.id, second.reply = rid, S.reply(f"{rid}-t2")
        await bus.jpublish(S.request(second.cls, "t2"), second, msg_id=f"{rid}-t2", headers={S.HDR_REPLY: second.reply})
        assert await until(lambda: adm.refused_duplicates == before + 1)  # refused silently, as every duplicate
        assert (await adm.shared.lookup(rid)).tenant == "t1"
    finally:
        await stop(adm)
