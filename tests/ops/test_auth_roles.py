"""The gateway, batch and offline-runner roles of ``natsched auth init``, on a real nats-server.

First each role does its real work through the real code, every service on its own role: the
gateway serves a request and its status page, a tenant's batch producer submits, resumes and reads
back a batch of offline work, and the offline runner takes that work and folds its outcomes into
the job records — with no permission refused. Then a raw connection as each role shows what the
server refuses it (tests/ops/test_auth_permissions.py's :class:`Probe`).
"""

from __future__ import annotations

import argparse
import subprocess

import httpx
import openai
import orjson
import pytest

from natsched.bus.snapshot import read_kv
from natsched.wire import subjects as S
from natsched.bus.errors import ReadError
from natsched.client.batch import BatchClient, JobStore, request_id
from natsched.bus.connection import Bus, Credentials
from natsched.bus.server import find_binary
from tests.factories.auth import RoleServices
from tests.factories.gateway import start_gateway
from natsched.cli.auth import add_parsers as add_auth_parser, cmd_auth
from natsched.ops.auth import AuthSettings, init
from natsched.wire.roles import local_subject
from tests.factories.core import wait_for
from tests.ops.test_auth_permissions import assert_no_violation, probe, start_server  # noqa: F401 (probe: a fixture)

TENANTS = ["A", "B"]
GATEWAY_TENANTS = ["A"]  # the gateway serves A only
KEY_A = "sk-tenant-a-0123456789"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-roles")
    files = init(AuthSettings(out=root / "auth", tenants=TENANTS, workers=["w1"], gateway_tenants=GATEWAY_TENANTS))
    server = start_server(root, files)
    try:
        yield server, files
    finally:
        server.stop()


@pytest.fixture(scope="module")
async def provisioned(secured):
    """Every stream and bucket made by the admin, the jobs bucket and OUTCOMES included."""
    server, files = secured
    admin = await Bus.connect(server.url, name="admin", credentials=files.creds("admin"))
    await admin.provision()
    await admin.provision_jobs()
    try:
        yield server, files, admin
    finally:
        await admin.close()


@pytest.fixture
async def connect(provisioned):
    """``await connect(user)``: a Bus with that role's credentials, closed after the test."""
    server, files, _ = provisioned
    buses: list[Bus] = []

    async def as_role(user: str) -> Bus:
        bus = await Bus.connect(server.url, name=user, credentials=files.creds(user))
        buses.append(bus)
        return bus

    try:
        yield as_role
    finally:
        for bus in reversed(buses):
            await bus.close()


def offline_lines(tenant: str, n: int) -> bytes:
    return b"".join(orjson.dumps({"prompt": f"{tenant} job {i} " * 6, "max_tokens": 3}) + b"\n" for i in range(n))


# --- auth init ---------------------------------------------------------------------------------
def test_init_flags_name_the_gateway_batch_and_offline_users(tmp_path):
    parser = argparse.ArgumentParser(prog="natsched")
    add_auth_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["auth", "init", "--out", str(out), "--tenants", "acme,globex", "--workers", "g1",
                              "--gateway-tenants", "acme", "--batch-tenants", "", "--no-offline"])
    assert cmd_auth(args) == 0
    assert {p.stem for p in (out / "creds").iterdir()} == {"admin", "admitter", "router", "scheduler", "worker-g1",
                                                           "gateway",
                                                           "producer-acme", "producer-globex"}
    gateway = orjson.loads((out / "creds" / "gateway.json").read_bytes())
    assert (gateway["role"], gateway["tenants"]) == ("gateway", ["acme"])
    check = subprocess.run([find_binary(), "-c", str(out / "nats-auth.conf"), "-t"], capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stderr

    defaults = init(AuthSettings(out=tmp_path / "defaults", tenants=["acme"], workers=["g1"]))
    assert {"offline", "gateway", "batch-acme"} <= set(defaults.credentials)
    assert Credentials.load(defaults.creds("batch-acme")).inbox_prefix == "_INBOX.batch-acme"


# --- every role doing its work -------------------------------------------------------------------
async def test_gateway_batch_and_offline_roles_do_their_work_within_their_permissions(connect, provisioned, caplog):
    """Admitter, router, worker, offline runner, gateway and batch producer, each on its own role."""
    running = await RoleServices.start(connect)  # batch and offline work take the offline path
    admitter = running.admitter
    server, files, _ = provisioned
    gw = await start_gateway(server.url, keys={KEY_A: {"tenant": "A", "class": "online", "status": True}},
                             credentials=files.creds("gateway"))
    try:
        await gw.wait_for_workers(1)
        # the gateway: a request for its tenant, its models and its status page
        sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY_A, max_retries=0, timeout=30)
        reply = await sdk.completions.create(model="default", prompt="hello from A", max_tokens=3)
        assert reply.choices[0].text.split() == ["tok0", "tok1", "tok2"]
        assert [m.id for m in (await sdk.models.list()).data] == ["default"]
        async with httpx.AsyncClient(timeout=30) as http:
            status = (await http.get(gw.url + "/status.json", headers={"Authorization": f"Bearer {KEY_A}"})).json()
        assert [w["id"] for w in status["workers"]] == ["w1"]

        # the batch producer of A: submit offline work, which the offline runner runs and records
        batch = BatchClient(await connect("batch-A"))
        data = offline_lines("A", 3)
        report = await batch.submit(data, "A", S.OFFLINE)
        assert (report.requests, report.published) == (3, 3)
        assert await wait_for(lambda: _done(batch, report.batch), timeout=60)
        rows = await batch.results(report.batch)
        assert [(r["status"], r["output"].split()) for r in rows] == [("completed", ["tok0", "tok1", "tok2"])] * 3
        again = await batch.submit(data, "A", S.OFFLINE, resume=True)  # reads its own REQUESTS and records
        assert (again.resumed, again.published, again.already) == (True, 0, 3)
        found = await JobStore(batch.bus).find(rows[0]["id"], "A")
        assert found is not None and found[1].path == "offline" and found[1].status == "completed"
        await sdk.close()
        # the admitter reads its whole bucket in acknowledged windows (its reconciliation)
        records = await read_kv(admitter.bus.nc, admitter.bus.js, S.BUCKET_INFLIGHT, window=2, stall_s=5)
        assert S.KEY_USAGE in records
        await admitter.reconcile_once()
    finally:
        await gw.close()
        await running.stop()
    assert_no_violation(caplog)


async def _done(client: BatchClient, batch: str) -> bool:
    return (await client.status(batch)).done


# --- what the server refuses each role -----------------------------------------------------------
async def test_gateway_cannot_publish_as_a_tenant_it_does_not_serve_or_edit_quotas(probe):
    gw = await probe("gateway")
    assert not await gw.publish(S.request(S.ONLINE, "A"))  # its tenant: allowed
    assert not await gw.publish(S.cancel("A", "r1"))  # cancels its own tenants' requests
    assert await gw.publish(S.cancel("B", "r1")), "the gateway cancelling a tenant it does not serve was not refused"
    assert await gw.publish(S.control("w1")), "the gateway on a worker's control subject (drain) was not refused"
    assert not await gw.subscribe(S.tenant_reply("A", "r1")) and not await gw.subscribe(S.HEARTBEATS_ALL)
    for cls in S.CLASSES:
        assert await gw.publish(S.request(cls, "B")), f"gateway publishing a {cls} request as B was not refused"
    for subject in ("$KV.quotas." + S.KEY_CLUSTER_TOTAL, "$KV.quotas." + S.tenant_quota_key("A"),
                    "$JS.API.STREAM.UPDATE.KV_quotas", "$JS.API.STREAM.PURGE.KV_quotas",
                    "$JS.API.STREAM.DELETE.KV_quotas", "$KV.config." + S.KEY_ROUTER_CONFIG,
                    "$KV.inflight." + S.KEY_USAGE,  # reads the usage for /status, never changes it
                    S.admitted(S.DEFAULT_POOL, S.ONLINE, "A"), S.work("w1"), S.completion("A", "w1"), S.decision("admission", "A"),
                    # no consumer on, or message read from, the streams that hold prompts and replies
                    "$JS.API.CONSUMER.CREATE.REQUESTS", "$JS.API.STREAM.MSG.GET.REQUESTS",
                    "$JS.API.STREAM.MSG.GET.KV_jobs", "$JS.API.CONSUMER.CREATE.OUTCOMES"):
        for name in {subject, local_subject(subject)}:  # (its account sees the services' API under a prefix)
            assert await gw.publish(name, orjson.dumps(1)), f"gateway publishing to {name} was not refused"
    for subject in (S.tenant_reply("B", "r1"), S.replies_of("B"), "resp.>", S.outcome("A", "b1", "j1"),
                    "_INBOX.producer-B.>", "_INBOX.>"):
        assert await gw.subscribe(subject), f"gateway subscribing to {subject} was not refused"


async def test_batch_role_of_one_tenant_cannot_read_another_tenants_job_records(probe, connect):
    b = BatchClient(await connect("batch-B"))
    report = await b.submit(offline_lines("B", 2), "B", S.OFFLINE)
    theirs = S.job_key("B", report.batch, request_id(report.batch, 1, "B"))
    own = BatchClient(await connect("batch-A"))
    mine = await own.submit(offline_lines("A-again", 1), "A", S.OFFLINE)
    # its own records, through the real reads: every one A's, none of B's
    keys = [k for k, _ in await own.store.scan(S.job_filter("A"))]
    mine_key = S.job_key("A", mine.batch, request_id(mine.batch, 1, "A"))
    assert keys and all(k.startswith("job.A.") for k in keys) and mine_key in keys

    a = await probe("batch-A")
    assert not await a.publish(local_subject(f"$JS.API.DIRECT.GET.KV_jobs.$KV.jobs.{mine_key}"))
    for subject in (f"$JS.API.DIRECT.GET.KV_jobs.$KV.{S.BUCKET_JOBS}.{theirs}",  # B's record by key
                    "$JS.API.DIRECT.GET.KV_jobs", "$JS.API.STREAM.MSG.GET.KV_jobs",  # any record, key in the body
                    "$JS.API.CONSUMER.CREATE.KV_jobs",  # a watch: its filter is in the body
                    "$JS.API.CONSUMER.CREATE.KV_jobs.x.$KV.jobs.job.B.*.*",
                    "$JS.API.CONSUMER.CREATE.KV_jobs.x.$KV.jobs.job.*.*.*", "$JS.API.CONSUMER.CREATE.KV_jobs.x.$KV.jobs.>",
                    "$JS.API.CONSUMER.DURABLE.CREATE.KV_jobs.x", "$JS.API.CONSUMER.MSG.NEXT.KV_jobs.x",
                    "$JS.API.CONSUMER.INFO.KV_jobs.x", "$JS.API.STREAM.PURGE.KV_jobs",
                    f"$KV.{S.BUCKET_JOBS}.{theirs}",  # nor overwrite it
                    # nor B's requests (prompts), by a consumer of its own or the admitter's
                    "$JS.API.CONSUMER.CREATE.REQUESTS.x.req.offline.B", "$JS.API.CONSUMER.CREATE.REQUESTS.x.req.>",
                    "$JS.API.CONSUMER.MSG.NEXT.REQUESTS.admitter", "$JS.API.STREAM.MSG.GET.REQUESTS",
                    S.request(S.OFFLINE, "B")):
        for name in {subject, local_subject(subject)}:
            assert await a.publish(name, b"{}"), f"batch-A publishing to {name} was not refused"
    for subject in ("$KV.jobs.>", f"$KV.jobs.job.B.{report.batch}.*", S.outcome("B", report.batch, "x"), "resp.>",
                    "_INBOX.batch-B.>"):
        assert await a.subscribe(subject), f"batch-A subscribing to {subject} was not refused"
    # the filter is in the consumer's create subject: a body asking for B's records under A's is refused
    body = {"stream_name": "KV_jobs", "config": {"name": "x", "filter_subject": "$KV.jobs.job.B.>",
                                                  "deliver_subject": "_INBOX.batch-A.x", "ack_policy": "none"}}
    answer = await a.nc.request(local_subject("$JS.API.CONSUMER.CREATE.KV_jobs.x.$KV.jobs.job.A.*.*"),
                                orjson.dumps(body), timeout=10)
    assert orjson.loads(answer.data)["error"]["err_code"] == 10131  # filter does not match the create subject
    # and the real reader says so: B's batch status, asked with A's credentials
    with pytest.raises(ReadError, match="may not read"):
        await own.status(report.batch)


async def test_offline_runner_role_cannot_publish_admission_decisions(probe):
    runner = await probe("offline")
    for allowed in (S.decision(S.STAGE_OFFLINE, "A"), S.admitted(S.DEFAULT_POOL, S.BATCH, "A"), S.offline("A"),
                    S.deadletter("offline"), "$KV.inflight." + S.KEY_USAGE, "$KV.inflight." + S.reservation_key("j1")):
        assert not await runner.publish(allowed), f"the offline runner may publish to {allowed}"
    for subject in (S.decision("admission", "A"), S.decision("routing", "A"), S.request(S.ONLINE, "A"),
                    S.work("w1"), S.completion("A", "w1"), S.control("w1"), S.deadletter("admitter"),
                    "$KV.quotas." + S.KEY_CLUSTER_TOTAL, "$KV.quotas." + S.KEY_DYNAMIC_TOTAL,
                    "$KV.config." + S.KEY_ROUTER_CONFIG, f"$KV.jobs.{S.batch_key('b1')}",  # manifests are producers'
                    # the admitter's and the router's consumers are not its own
                    "$JS.API.CONSUMER.CREATE.REQUESTS.admitter.req.>", "$JS.API.CONSUMER.MSG.NEXT.REQUESTS.admitter",
                    "$JS.API.CONSUMER.MSG.NEXT.ADMITTED.router", "$JS.API.STREAM.PURGE.OFFLINE"):
        assert await runner.publish(subject), f"the offline runner publishing to {subject} was not refused"
    assert await runner.subscribe(S.replies_of("A")) and await runner.subscribe(S.decision("admission", "A"))
