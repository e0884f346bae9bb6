"""Every reader of REQUESTS finds a tenant's requests whatever the partitioning (real nats-server).

A partitioned REQUESTS stores ``req.<class>.<tenant>`` as ``reqp.<k>.<class>.<tenant>``; requests
stored before P changed keep their subject. The audit, replay and the batch producer's resume
check must see all of them, and no other tenant's."""

from __future__ import annotations

import asyncio
import time

import pytest

from natsched.admitter.budget import partition_of
from natsched.audit.records import audit_request, audit_window
from natsched.bus.provision import ProvisionSettings
from natsched.client.batch import BatchClient
from natsched.sim.replay import load_recording
from natsched.wire import msgids as M
from natsched.wire import subjects as S
from natsched.wire.ids import unscoped
from natsched.wire.schema import JobRecord, JobStatus
from tests.admitter.test_service import publish, request
from tests.factories.core import wait_for as until
from tests.client.test_batch_submit import Interrupt, batch_file, interrupt_after, stored_ids

A, B = "globex", "acme"  # partitions 0 and 1 of 2
assert (partition_of(A, 2), partition_of(B, 2)) == (0, 1)


def test_the_filters_cover_both_stored_shapes_and_only_that_tenant():
    assert S.stored_requests_of(A) == ("req.*.globex", "reqp.*.*.globex")
    assert S.stored_requests_of(A, S.BATCH) == ("req.batch.globex", "reqp.*.batch.globex")
    with pytest.raises(ValueError):
        S.stored_requests_of("a.b")  # a tenant is one token: no filter escapes its own subjects
    with pytest.raises(ValueError):
        S.stored_requests_of(A, ">")


async def test_audit_and_replay_find_a_tenants_requests_under_every_partitioning(bus):
    since = time.time() - 1
    ids: dict[str, list[str]] = {A: [], B: []}

    async def round_of(n: int) -> None:
        for tenant in (A, B):
            for _ in range(n):
                req = request(tenant, tokens=5)
                ids[tenant].append(req.id)
                await publish(bus, req)

    await round_of(2)  # unpartitioned: req.online.<t>
    await bus.set_partitions(2)
    await round_of(3)  # reqp.<0|1>.online.<t>
    await bus.set_partitions(4)  # (P changed without a drain: older subjects stay as they are)
    await round_of(1)
    subjects = {subject for subject, _ in await bus.stream_messages(S.STREAM_REQUESTS)}
    assert {f"req.online.{A}", f"reqp.0.online.{A}", f"reqp.{partition_of(A, 4)}.online.{A}"} <= subjects

    assert (await audit_window(bus, since, tenant=A))["requests"] == 6
    assert (await audit_window(bus, since, tenant=B))["requests"] == 6
    assert (await audit_window(bus, since))["requests"] == 12
    recording = await load_recording(bus, since, tenant=B)
    assert recording.submitted == 6
    # one request's story through the tenant filter (a job names its tenant): partitioned or not
    for rid in (ids[A][0], ids[A][-1]):
        job = JobRecord(id=rid, tenant=A, status=JobStatus.SUBMITTED, created=time.time())
        story = await audit_request(bus, rid, since=since, job=job)
        assert story["events"][0]["stage"] == "submitted"
        assert story["events"][0]["subject"].endswith(f"online.{A}")


async def test_a_batch_resumes_without_resubmitting_what_a_partition_stored(bus):
    # past the dedup window, only the resume check keeps a line from being stored twice
    await bus.provision(ProvisionSettings(dedup_window_s=0.1))
    client = BatchClient(bus, window=4)
    with pytest.raises(Interrupt):
        await client.submit(batch_file(12), A, progress=interrupt_after(4))  # unpartitioned
    await bus.set_partitions(2)
    with pytest.raises(Interrupt):
        await client.submit(batch_file(12), A, resume=True, progress=interrupt_after(8))  # in partition 0
    assert len(await stored_ids(bus)) == 8
    await asyncio.sleep(0.3)  # past the dedup window
    sent: list[str] = []  # what the resume publishes, before the server's own dedup can hide a copy

    async def seen(subject, data, headers):
        sent.append(headers.get(S.HDR_MSG_ID, ""))
    await bus.subscribe(S.request(S.BATCH, A), seen)
    resumed = await client.submit(batch_file(12), A, resume=True)
    assert (resumed.published, resumed.already) == (4, 8)
    await bus.nc.flush()  # (every delivery of this connection's publishes precedes its ack)
    assert await until(lambda: len(sent) >= 4)
    # (a line's msg id is its tenant-scoped request id and the submission's digest)
    assert sorted(unscoped(M.request_of(m)) for m in sent) == sorted(f"{resumed.batch}-{i}" for i in range(9, 13))
    ids = await stored_ids(bus)
    assert len(ids) == len(set(ids)) == 12
