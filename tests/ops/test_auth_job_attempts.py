"""Job outcomes fenced by admission attempt, against a real nats-server with ``auth init``'s credentials (issue 26).

A job taken by the offline runner is assigned to w1 (attempt 0); w1 falls silent and the
admitters' rescue re-admits it as attempt 1, which runs on w2. w1 was only paused: it still
holds the genuine reply fence of attempt 0, and its late output must not become the job's. The
runner refuses it as ``stale`` (counted, logged, never folded); w2's is taken, and the job
completes exactly once, with w2's output.

The router and the two workers are played by the test on their own roles' credentials, with the
messages they build (an Assignment on ``work.w1``, fenced Replies on their ``outcome`` sub-subjects),
so that the old attempt's worker can be made late at a chosen point; the admitter, its rescue, the
offline runner and the server's permissions are the real ones.
"""

from __future__ import annotations

import time

import orjson
import pytest

from natsched.admitter.offline import OfflineRunner, OfflineSettings
from natsched.admitter.service import AdmitterService
from natsched.bus.connection import Bus
from natsched.client.batch import COMPLETED, RUNNING, BatchClient, plan_batch
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire import subjects as S
from natsched.wire.schema import Assignment, Reply, ReplyKind
from tests.factories.auth import admin_provisioned, secured_server
from tests.factories.core import wait_for


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    with secured_server(tmp_path_factory.mktemp("auth-job-attempts"), tenants=["A"], workers=["w1", "w2"]) as both:
        yield both


@pytest.fixture
async def services(secured):
    """(``await as_role(user)``, the admin's Bus, the admitter, the offline runner): no router and
    no worker run, the test plays them."""
    server, files = secured
    buses: list[Bus] = []

    async def as_role(user: str) -> Bus:
        buses.append(await Bus.connect(server.url, name=user, credentials=files.creds(user)))
        return buses[-1]

    async with admin_provisioned(server, files) as admin:
        admitter = AdmitterService(await as_role("admitter"))
        await admitter.start()
        admitter.core.settings.degrade_watermark = 0.0  # the batch line takes the offline path
        runner = OfflineRunner(await as_role("offline"), OfflineSettings(poll_s=0.02))
        await runner.start()
        try:
            yield as_role, admin, admitter, runner
        finally:
            for bus in reversed(buses):
                await bus.close()


def _refused(runner: OfflineRunner, reason: str) -> float:
    return runner.metrics.registry.get_sample_value("natsched_offline_refused_outcomes_total",
                                                    {"reason": reason}) or 0.0


def _completed(runner: OfflineRunner) -> float:
    return runner.metrics.registry.get_sample_value("natsched_offline_jobs_total", {"event": "completed"}) or 0.0


def result(key: str, aid: str, worker: str, attempt: int, text: str) -> Reply:
    """The final reply ``worker`` sends for attempt ``attempt`` of ``aid``, fenced as the router signed it."""
    return Reply(request_id=aid, kind=ReplyKind.RESULT, text=text, worker=worker, output_tokens=3,
                 fence=fence.reply_sign(fence.reply_key(key, "A"), aid, worker, attempt), attempt=attempt)


async def test_a_rescued_jobs_old_worker_is_refused_stale_and_the_new_attempt_completes_it_once(services, caplog):
    as_role, admin, admitter, runner = services
    data = orjson.dumps({"prompt": "rescued job " * 6, "max_tokens": 3}) + b"\n"
    _, planned = plan_batch(data, "A", S.OFFLINE).requests[0]
    job = S.parse_outcome_subject(planned.reply)
    key = S.job_key(*job)
    report = await BatchClient(await as_role("batch-A")).submit(data, "A", S.OFFLINE)
    assert report.published == 1

    async def record():
        got = await runner.store.get(key)
        return got[0] if got else None

    assert await wait_for(lambda: _running(record), timeout=30)  # the runner took it: reserved, ADMITTED
    taken = await record()
    aid = taken.attempt_id
    reserved = await admitter.shared.lookup(aid)
    assert reserved is not None and reserved.attempt == 0

    # the router assigns attempt 0 to w1 (as RouterService does: both fences signed)
    router = await as_role("router")
    run = taken.request
    run.id, run.reply = aid, S.outcome(*job)
    now = time.time()
    await router.jpublish(S.work("w1"), Assignment(
        request=run, worker="w1", runtime_tokens=reserved.tokens, admitted_at=now, routed_at=now, attempt=0,
        fence=fence.sign(admin.fence_key, aid, "w1", 0),
        reply_fence=fence.reply_sign(fence.reply_key(admin.fence_key, "A"), aid, "w1", 0)), msg_id=M.work(aid))

    # w1 never heartbeats: the admitters' rescue re-admits it as attempt 1 and says "rerouted"
    await admitter.rescuer.sweep(lambda worker: worker != "w1")
    assert await wait_for(lambda: _reservation_attempt(admitter, aid, 1), timeout=30)
    assert await wait_for(lambda: _admission_attempt(record, 1), timeout=30)  # the runner heard it

    # w1, only paused, delivers its genuine output of attempt 0: refused, stale, nothing folded
    w1 = await as_role("worker-w1")
    await w1.publish(S.worker_outcome(*job, "w1"), result(admin.fence_key, aid, "w1", 0, "w1 late output"))
    await w1.flush()
    assert await wait_for(lambda: _refused(runner, fence.REPLY_STALE) == 1, timeout=30)
    assert (await record()).status == RUNNING and (await record()).output is None
    assert "refused (stale)" in caplog.text

    # w2 runs attempt 1 and answers: that is the job's outcome
    w2 = await as_role("worker-w2")
    await w2.publish(S.worker_outcome(*job, "w2"), result(admin.fence_key, aid, "w2", 1, "w2 output"))
    await w2.flush()
    assert await wait_for(lambda: _status(record, COMPLETED), timeout=30)
    done = await record()
    assert (done.output, done.worker, done.attempts, done.admission_attempt) == ("w2 output", "w2", 1, 1)
    assert [e["event"] for e in done.history].count(COMPLETED) == 1 and _completed(runner) == 1

    # w1 again, after the job completed: still stale, and the record keeps w2's output
    await w1.publish(S.worker_outcome(*job, "w1"), result(admin.fence_key, aid, "w1", 0, "w1 again"))
    await w1.flush()
    assert await wait_for(lambda: _refused(runner, fence.REPLY_STALE) == 2, timeout=30)
    assert (await record()).output == "w2 output" and _completed(runner) == 1
    assert _refused(runner, fence.REPLY_BAD_FENCE) == _refused(runner, fence.REPLY_WRONG_WORKER) == 0


async def _running(record) -> bool:
    r = await record()
    return r is not None and r.status == RUNNING and r.attempt_id is not None


async def _status(record, status: str) -> bool:
    r = await record()
    return r is not None and r.status == status


async def _admission_attempt(record, attempt: int) -> bool:
    r = await record()
    return r is not None and r.admission_attempt == attempt


async def _reservation_attempt(admitter: AdmitterService, aid: str, attempt: int) -> bool:
    res = await admitter.shared.lookup(aid)
    return res is not None and res.attempt == attempt
