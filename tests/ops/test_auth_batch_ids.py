"""Batch request ids scoped by tenant, and job outcomes fenced, against a real nats-server with ``auth init``'s credentials (issue 26).

A batch's ids are a digest of (tenant, class, file), so a tenant that knows another's file could
compute its line ids and take their dedup slots first: that line was refused as a duplicate. Batch
lines are now submitted as the client submits (the id in the tenant's scope, the message id keyed
by the tenant's reply key): every id and message id another tenant can compute is refused or
lands elsewhere, and the victim's batch runs fully; the same tenant resubmitting runs nothing twice.

A job's outcome is folded into its record only from the worker its attempt was assigned to
(its own ``outcome.<tenant>.<batch>.<job>.<worker>``, with the router's reply fence): a worker
that was assigned nothing forges results in vain.
"""

from __future__ import annotations

import orjson
import pytest

from natsched.bus.connection import Bus
from natsched.client.batch import BatchClient, batch_id, plan_batch
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire import subjects as S
from natsched.wire.ids import in_scope, unscoped
from natsched.wire.schema import Reply, ReplyKind
from tests.factories.auth import RoleServices, admin_provisioned, secured_server
from tests.factories.core import wait_for
from tests.ops.test_auth_permissions import assert_no_violation

TENANTS = ["A", "B"]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    with secured_server(tmp_path_factory.mktemp("auth-batch-ids"), tenants=TENANTS, workers=["w1", "w2"]) as both:
        yield both


@pytest.fixture
async def services(secured):
    """(``await as_role(user)``, the services running on their roles: w1 is the only worker)."""
    server, files = secured
    buses: list[Bus] = []

    async def as_role(user: str) -> Bus:
        buses.append(await Bus.connect(server.url, name=user, credentials=files.creds(user)))
        return buses[-1]

    async with admin_provisioned(server, files):
        running = await RoleServices.start(as_role)
        try:
            yield as_role, running
        finally:
            await running.stop()
            for bus in reversed(buses):
                await bus.close()


@pytest.fixture
async def connect(services):
    return services[0]


def lines(n: int, salt: str) -> bytes:
    return b"".join(orjson.dumps({"prompt": f"shared job {salt} {i} " * 6, "max_tokens": 3}) + b"\n"
                    for i in range(n))


async def _done(client: BatchClient, batch: str) -> bool:
    return (await client.status(batch)).done


async def test_two_tenants_one_file_both_run_fully_and_a_resubmission_runs_nothing_twice(connect, caplog):
    data = lines(3, "two-tenants")
    a, b = BatchClient(await connect("batch-A")), BatchClient(await connect("batch-B"))
    ra, rb = await a.submit(data, "A", S.OFFLINE), await b.submit(data, "B", S.OFFLINE)
    assert (ra.published, rb.published) == (3, 3) and ra.batch != rb.batch
    assert await wait_for(lambda: _done(a, ra.batch), timeout=60)
    assert await wait_for(lambda: _done(b, rb.batch), timeout=60)
    for client, report, tenant in ((a, ra, "A"), (b, rb, "B")):
        rows = await client.results(report.batch)
        assert [r["status"] for r in rows] == ["completed"] * 3
        assert all(in_scope(tenant, r["id"]) and not in_scope("B" if tenant == "A" else "A", r["id"]) for r in rows)
        assert [unscoped(r["id"]) for r in rows] == [f"{report.batch}-{n}" for n in (1, 2, 3)]
    again = await a.submit(data, "A", S.OFFLINE)  # within the dedup window and with the manifest there
    assert (again.resumed, again.published, again.already) == (True, 0, 3)
    records = await a.records(await a.manifest(ra.batch))
    assert sorted(r.attempts for r in records.values()) == [1, 1, 1]  # nothing ran twice
    assert_no_violation(caplog)


async def test_a_tenant_knowing_anothers_file_cannot_take_its_lines(connect):
    """B, with its own batch credentials, publishes ahead of A every id and message id it can
    compute from A's file: the legacy bare id, A's scoped id with itself, and with the message id
    signed by the public default key. A then submits the file: every line is published (none is
    a duplicate) and runs."""
    data = lines(2, "victim")
    attacker = BatchClient(await connect("batch-B"))
    await attacker.prepare()
    victim_batch = batch_id("A", S.OFFLINE, data)
    for _, req in plan_batch(data, "A", S.OFFLINE).requests:
        for msg_id in (unscoped(req.id), req.id, M.submission(req.id, fence.reply_key(None, "A"))):
            forged = plan_batch(data, "B", S.OFFLINE).requests[0][1]
            forged.id, forged.reply = req.id, S.outcome("B", victim_batch, req.id)
            await attacker.bus.jpublish(S.request(S.OFFLINE, "B"), forged, msg_id=msg_id,
                                        headers={S.HDR_REPLY: forged.reply})
    victim = BatchClient(await connect("batch-A"))
    report = await victim.submit(data, "A", S.OFFLINE)
    assert report.batch == victim_batch and (report.published, report.already) == (2, 0)
    assert await wait_for(lambda: _done(victim, report.batch), timeout=60)
    assert [r["status"] for r in await victim.results(report.batch)] == ["completed"] * 2


def _refused(runner, reason: str) -> float:
    return runner.metrics.registry.get_sample_value("natsched_offline_refused_outcomes_total",
                                                    {"reason": reason}) or 0.0


async def test_a_worker_not_assigned_a_job_cannot_complete_it_with_forged_output(services):
    """w2 (its own credentials; nothing is ever assigned to it) publishes results for A's job
    before A submits it (a record it creates would stand: the first outcome wins): on its own
    sub-subject with a guessed fence, and naming w1 there. Both are refused and counted; the
    server refuses it the job's subject and w1's sub-subject. A's job then runs on w1 and
    keeps w1's output."""
    as_role, running = services
    data = lines(1, "forged")
    _, req = plan_batch(data, "A", S.OFFLINE).requests[0]
    job = S.parse_outcome_subject(req.reply)
    w2 = await as_role("worker-w2")

    def forged(worker: str) -> Reply:
        return Reply(request_id=req.id, kind=ReplyKind.RESULT, text="FORGED", worker=worker, fence="0" * 16,
                     attempt=0, output_tokens=1)

    await w2.publish(S.worker_outcome(*job, "w2"), forged("w2"))  # a guessed fence
    await w2.publish(S.worker_outcome(*job, "w2"), forged("w1"))  # naming the worker it may be given to
    await w2.publish(S.outcome(*job), forged("w2"))  # refused by the server (the services' subject)
    await w2.publish(S.worker_outcome(*job, "w1"), forged("w1"))  # refused by the server (w1's)
    await w2.flush()
    runner = running.runner
    assert await wait_for(lambda: _refused(runner, fence.REPLY_BAD_FENCE) == 1
                          and _refused(runner, fence.REPLY_WRONG_WORKER) == 1, timeout=30)
    assert await runner.store.get(S.job_key(*job)) is None  # nothing folded

    victim = BatchClient(await as_role("batch-A"))
    report = await victim.submit(data, "A", S.OFFLINE)
    assert report.published == 1
    assert await wait_for(lambda: _done(victim, report.batch), timeout=60)
    [row] = await victim.results(report.batch)
    assert (row["status"], row["worker"], row["output"].split()) == ("completed", "w1", ["tok0", "tok1", "tok2"])
    assert (_refused(runner, fence.REPLY_BAD_FENCE), _refused(runner, fence.REPLY_WRONG_WORKER)) == (1, 1)
    assert _refused(runner, fence.REPLY_UNFENCED) == 0  # the honest run's output was fenced right
