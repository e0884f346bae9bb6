"""The offline runner against a real nats-server, with the real admitter, router and sim workers."""

import time

import orjson
import pytest

from natsched.admitter.offline import OfflineRunner, OfflineSettings
from natsched.admitter.shared import SharedState
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.client.batch import BatchClient, JobStore, request_id
from natsched.client.producer import make_request
from natsched.wire.ids import RequestId, scoped
from natsched.wire.codec import encode
from natsched.bus.connection import Bus
from natsched.wire.schema import DeadLetter, Decision, Reply
from tests.factories.stack import start_stack
from tests.factories.core import wait_for


async def start_runner(url: str, **settings) -> tuple[OfflineRunner, Bus]:
    """An offline runner on its own connection; fast polls so tests wait little."""
    settings.setdefault("poll_s", 0.02)
    bus = await Bus.connect(url, name="offline")
    runner = OfflineRunner(bus, OfflineSettings(**settings))
    await runner.start()
    return runner, bus


async def jobs_stack(url: str, *, total: int = 3000, workers: int = 2, **stack_kw):
    """The services of tests/factories/stack.py plus an offline runner, with a tight online budget in which
    the admitter degrades every batch request (degrade watermark 0: batch work always goes offline)."""
    stack = await start_stack(url, workers=workers, **stack_kw)
    stack.admitter.core.settings.degrade_watermark = 0.0
    await stack.client.bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(total))
    runner, runner_bus = await start_runner(url)
    stack.buses.append(runner_bus)
    await wait_for(lambda: stack.admitter.total == total and runner.total == total)
    return stack, runner


async def job(bus: Bus, job_id: str, tenant: str = "t1"):
    """The record of ``job_id`` as given (a record written here), or as the client submitted it
    (in its tenant's scope: natsched.wire.ids.scoped)."""
    found = await JobStore(bus).find(job_id) or await JobStore(bus).find(scoped(tenant, job_id))
    return found[1] if found else None


async def records(bus: Bus, stream: str, schema, subject=None):
    return [schema.decode(data) for _, data in await bus.stream_messages(stream, subject)]


@pytest.fixture
async def stack(bus, nats_url):
    s, runner = await jobs_stack(nats_url)
    s.runner = runner
    try:
        yield s
    finally:
        await s.close()


async def test_offline_class_request_becomes_a_job_that_completes(stack, bus):
    result = await stack.client.submit(make_request("t1", prompt_token_ids=list(range(64)), max_tokens=4,
                                                    cls="offline", id="solo1"))
    assert (result.status, result.job_id) == ("degraded", scoped("t1", "solo1"))  # the id in its tenant's scope
    assert await wait_for(lambda: _status(bus, "solo1", "completed"))
    record = await job(bus, "solo1")
    assert record.batch == S.NO_BATCH and record.path == "offline" and record.output.split() == [
        f"tok{i}" for i in range(4)]
    assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)  # the completion released it


async def _status(bus, job_id, status):
    record = await job(bus, job_id)
    return record is not None and record.status == status


async def test_work_waits_while_usage_is_above_the_low_watermark(stack, bus):
    other = SharedState(bus, "test")
    await other.start()
    await other.change_usage(lambda u: (Usage(used=1400, tenants={"t0": 1400}), None))  # 1400 + 220 > 1500
    await stack.client.submit(make_request("t1", prompt_token_ids=list(range(100)), max_tokens=20, cls="offline",
                                           id="held1"))
    assert await wait_for(lambda: len(stack.runner.held) == 1)
    assert await stack.runner.take_once() == 0
    held = await job(bus, "held1")  # nothing started: the admitter's record, waiting
    assert (held.status, held.attempts, held.started) == ("waiting", 0, None)
    await other.change_usage(lambda u: (Usage(), None))
    assert await wait_for(lambda: _status(bus, "held1", "completed"))
    allow = [d for d in await records(bus, S.STREAM_DECISIONS, Decision, S.decision("offline", "t1"))]
    assert [(d.decision, d.budget["used"]) for d in allow] == [("allow", 0)]


async def test_transient_failures_are_retried_then_failed_and_dead_lettered(bus, nats_url):
    stack, runner = await jobs_stack(nats_url, workers=0, no_worker_wait_s=0.3)
    try:
        client = BatchClient(bus)
        report = await client.submit(b'{"prompt": "nobody home", "max_tokens": 2}\n', "t1")
        rid = request_id(report.batch, 1, "t1")
        assert await wait_for(lambda: _status(bus, rid, "failed"), timeout=60)
        record = await job(bus, rid)
        assert (record.reason, record.attempts) == ("no_worker", 3) and "after 3 attempt" in record.message
        decisions = await records(bus, S.STREAM_DECISIONS, Decision, S.decision("offline", "t1"))
        assert [(d.request_id, d.decision) for d in decisions] == [
            (rid, "allow"), (rid, "retry"), (f"{rid}-r2", "allow"), (f"{rid}-r2", "retry"), (f"{rid}-r3", "allow"),
            (f"{rid}-r3", "fail")]
        dead = await records(bus, S.STREAM_DEADLETTER, DeadLetter, S.deadletter("offline"))
        assert [(d.reason, d.headers[S.HDR_MSG_ID]) for d in dead] == [("no_worker", rid)]
        assert (await client.results(report.batch))[0]["error"].startswith("no_worker: gave up after 3")
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)
    finally:
        await stack.close()


async def test_permanent_failure_is_recorded_at_once(bus, nats_url):
    stack, runner = await jobs_stack(nats_url, total=400_000, max_model_len=1000)
    try:
        await stack.client.submit(make_request("t1", prompt_token_ids=list(range(2000)), max_tokens=8,
                                               cls="offline", id="huge1"))
        assert await wait_for(lambda: _status(bus, "huge1", "failed"))
        record = await job(bus, "huge1")
        assert (record.reason, record.attempts) == ("prompt_too_long", 1)
        dead = await records(bus, S.STREAM_DEADLETTER, DeadLetter, S.deadletter("offline"))
        assert [d.reason for d in dead] == ["prompt_too_long"]
    finally:
        await stack.close()


async def test_too_large_for_the_offline_share_fails_instead_of_waiting_forever(stack, bus):
    await stack.client.submit(make_request("t1", prompt_token_ids=list(range(800)), max_tokens=8, cls="offline",
                                           id="big1"))  # 1608 > 1500 = 0.5 x 3000
    assert await wait_for(lambda: _status(bus, "big1", "failed"))
    assert (await job(bus, "big1")).reason == "too_large"


async def test_hostile_offline_messages_are_dead_lettered_and_the_runner_keeps_serving(stack, bus):
    await bus.jpublish(S.offline("t1"), b"\xc1 not msgpack", msg_id="junk1")
    wrong = make_request("t2", "mine?", id="wrong1", cls="offline")
    await bus.jpublish(S.offline("t1"), wrong, msg_id="wrong1:offline")  # tenant t2 on t1's subject
    await bus.jpublish(S.offline("t1"), encode({"id": "x", "tenant": "t1"}), msg_id="nofields")
    assert await wait_for(lambda: _dead_count(bus, 3))
    dead = await records(bus, S.STREAM_DEADLETTER, DeadLetter, S.deadletter("offline"))
    assert sorted(d.reason for d in dead) == ["invalid", "invalid", "malformed"]
    assert (await job(bus, "wrong1")) is None
    await stack.client.submit(make_request("t1", "still here", max_tokens=2, cls="offline", id="ok1"))
    assert await wait_for(lambda: _status(bus, "ok1", "completed"))


async def _dead_count(bus, n):
    return (await bus.stream(S.STREAM_DEADLETTER).info()).messages >= n


async def test_garbage_on_an_outcome_subject_is_dead_lettered(stack, bus):
    await bus.publish(S.outcome("t1", "-", "ghost"), b"\x00garbage")
    assert await wait_for(lambda: _dead_count(bus, 1))
    dead = await records(bus, S.STREAM_DEADLETTER, DeadLetter)
    assert [(d.subject, d.reason) for d in dead] == [(S.outcome("t1", "-", "ghost"), "malformed")]


async def test_the_same_job_queued_twice_runs_once(stack, bus):
    req = make_request("t1", prompt_token_ids=list(range(64)), max_tokens=3, cls="offline", id="twice1")
    await bus.jpublish(S.offline("t1"), req, msg_id="twice1:a")
    await bus.jpublish(S.offline("t1"), req, msg_id="twice1:b")
    assert await wait_for(lambda: _status(bus, "twice1", "completed"))
    await wait_for(lambda: _queue_empty(bus))
    from natsched.wire.schema import Completion

    done = await records(bus, S.STREAM_COMPLETIONS, Completion)
    assert [c.request_id for c in done] == [req.id]


async def _queue_empty(bus):
    return (await bus.stream(S.STREAM_OFFLINE).info()).messages == 0


async def test_a_lost_attempt_times_out_and_is_retried(stack, bus):
    stack.runner.running["job.t1.-.lost1"] = ("lost1", time.time() - 10_000)
    store = JobStore(bus)
    from natsched.wire.schema import JobRecord

    req = make_request("t1", prompt_token_ids=list(range(64)), max_tokens=2, cls="offline")
    req.id = RequestId("lost1")  # the record's own id, as written here
    await store.create(S.job_key("t1", "-", "lost1"), JobRecord(id="lost1", tenant="t1", status="running",
                                                               request=req, attempts=1, attempt_id="lost1"))
    assert await stack.runner.sweep_once() == 1
    assert await wait_for(lambda: _status(bus, "lost1", "completed"))
    record = await job(bus, "lost1")
    assert record.attempts == 2 and record.attempt_id == "lost1-r2"
    assert [h["event"] for h in record.history][:2] == ["retry", "taken"]


async def test_jobs_cli_shows_lists_and_says_not_found(stack, bus, nats_url):
    from tests.client.test_batch_submit import cli2

    await stack.client.submit(make_request("t1", "listed", max_tokens=2, cls="offline", id="cli1"))
    assert await wait_for(lambda: _status(bus, "cli1", "completed"))
    shown = cli2(nats_url, "jobs", "show", scoped("t1", "cli1"), "--json")  # the id it was submitted under
    assert shown.returncode == 0 and orjson.loads(shown.stdout)["status"] == "completed"
    listed = cli2(nats_url, "jobs", "list", "--tenant", "t1", "--status", "completed,failed", "--json")
    assert [j["id"] for j in orjson.loads(listed.stdout)] == [scoped("t1", "cli1")]
    none = cli2(nats_url, "jobs", "list", "--tenant", "t1", "--status", "failed", "--json")
    assert orjson.loads(none.stdout) == []
    bad = cli2(nats_url, "jobs", "list", "--status", "exploded")
    assert bad.returncode == 1 and "unknown status exploded" in bad.stderr
    missing = cli2(nats_url, "jobs", "show", "ghost")
    assert missing.returncode == 2 and "job ghost not found" in missing.stderr


async def test_metrics_count_what_the_runner_did(bus, nats_url):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from natsched.bus.server import free_port

    stack = await start_stack(nats_url)
    port = free_port()
    runner, runner_bus = await start_runner(nats_url, metrics_port=port)
    stack.buses.append(runner_bus)
    try:
        await stack.client.submit(make_request("t1", "count me", max_tokens=2, cls="offline", id="m1"))
        assert await wait_for(lambda: _status(bus, "m1", "completed"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        samples = {(s.name, s.labels.get("event")): s.value for f in text_string_to_metric_families(text)
                   for s in f.samples}
        assert samples[("natsched_offline_jobs_total", "taken")] == 1
        assert samples[("natsched_offline_jobs_total", "completed")] == 1
        assert samples[("natsched_offline_wait_seconds_count", None)] == 1
        # a late duplicate result changes nothing: neither the record nor the count
        m1 = scoped("t1", "m1")  # the job's id: the request's, in its tenant's scope
        await bus.publish(S.outcome("t1", S.NO_BATCH, m1), Reply(request_id=m1, kind="result", text="again"))
        assert await wait_for(lambda: _outcomes_empty(bus))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'natsched_offline_jobs_total{event="completed"} 1.0' in text
        assert (await job(bus, "m1")).output.split() == ["tok0", "tok1"]
    finally:
        await stack.close()


async def _outcomes_empty(bus):
    info = await bus.stream(S.STREAM_OUTCOMES).consumer(S.CONSUMER_OFFLINE_OUTCOMES)
    return info.pending == 0 and info.ack_pending == 0


async def test_a_quota_rejection_of_a_batch_line_puts_it_on_the_offline_path(stack, bus):
    from natsched.wire.schema import JobRecord

    # a batch line as its producer recorded it, and the admitter's answer: refused for quota
    req = make_request("t1", "rejected, then run offline", max_tokens=2, cls="batch", id="bq1")
    req.id, req.reply = RequestId("bq1"), S.outcome("t1", "bq", "bq1")  # as a batch producer builds it: no scope
    await stack.runner.store.create(S.job_key("t1", "bq", "bq1"),
                                    JobRecord(id="bq1", tenant="t1", status="submitted", batch="bq", request=req))
    rejected = Reply(request_id="bq1", kind="error", status="rejected", reason="queue_full", retry_after=1.0)
    await bus.publish(S.outcome("t1", "bq", "bq1"), rejected)
    assert await wait_for(lambda: _status(bus, "bq1", "completed"))
    record = await job(bus, "bq1")
    assert (record.path, record.attempts, record.attempt_id, record.batch) == ("offline", 1, "bq1", "bq")
    assert [h["event"] for h in record.history] == ["requeue", "taken", "assigned", "completed"] or \
        [h["event"] for h in record.history] == ["requeue", "taken", "completed"]
    decisions = await records(bus, S.STREAM_DECISIONS, Decision, S.decision("offline", "t1"))
    assert [(d.decision, d.reason) for d in decisions] == [("requeue", "queue_full"), ("allow", None)]


async def test_a_corrupted_job_record_is_replaced_not_fatal(stack, bus):
    await JobStore(bus).ensure()
    await bus.kv(S.BUCKET_JOBS).put(S.job_key("t1", S.NO_BATCH, "rot1"), b"\xc1 rotten")
    assert (await JobStore(bus).get(S.job_key("t1", S.NO_BATCH, "rot1"))) is None
    await stack.client.submit(make_request("t1", "after the rot", max_tokens=2, cls="offline", id="rot1"))
    assert await wait_for(lambda: _status(bus, "rot1", "completed"))
