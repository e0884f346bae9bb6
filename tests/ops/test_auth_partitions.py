"""Partitioned admission and router pools under ``natsched auth init --partitions 2 --router-pools``.

A real nats-server runs the generated config. First every partitioned role does its job on its
own credentials: each partition's admitter (``admitter-p<k>``) admits its own tenants through its
own consumer and bucket, the ``coordinator`` writes the budget plans, the offline runner admits a
job through each tenant's partition, each pool's router (``router-<pool>``) routes its pool's
model, and an admitter's embedded coordinator candidate can take the lease and write the plan,
with no permission refused. Then a raw connection as each role shows what the server refuses it
(:class:`tests.ops.test_auth_permissions.Probe`: every refusal is the server's permission error).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time

import httpx
import pytest

from natsched.admitter.budget import partition_of
from natsched.admitter.coordinator import Coordinator, CoordinatorSettings, decode_plan
from natsched.admitter.move import change_partitions
from natsched.admitter.offline import OfflineRunner, OfflineSettings
from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.bus.connection import Bus
from natsched.bus.pools import store_pools
from natsched.bus.server import find_binary
from natsched.cli.auth import add_parsers as add_auth_parser
from natsched.cli.auth import cmd_auth
from natsched.client.batch import JobStore
from natsched.client.producer import Client, Timeouts
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from natsched.wire import subjects as S
from natsched.wire.pools import PoolMap
from natsched.wire.schema import Decision
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.profiles import H100_LLAMA8B
from natsched.workers.simengine import SimEngine
from tests.admitter.test_service import set_quotas
from tests.factories.auth import secured_server
from tests.factories.core import wait_for
from tests.factories.gateway import start_gateway
from tests.ops.test_auth_permissions import assert_no_violation, probe, tenant_request  # noqa: F401 (a fixture)
from tests.ops.test_auth_roles import connect  # noqa: F401 (a fixture: each role's Bus, on this module's server)

P0, P1 = "globex", "acme"  # partition_of(.., 2): 0 and 1
assert (partition_of(P0, 2), partition_of(P1, 2)) == (0, 1)
POOLS = "a=ma;b=*"  # pool a routes model ma, pool b every other model
WORKER_MODELS = {"w1": "ma", "w2": "mb"}
KEY = "sk-globex-0123456789"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-partitions")
    with secured_server(root, tenants=[P0, P1], workers=list(WORKER_MODELS), partitions=2,
                        router_pools=POOLS) as running:
        yield running


@pytest.fixture(scope="module")
async def provisioned(secured):
    """As ``natsched up --partitions 2 --router-pools`` provisions it, as the admin: every stream
    and bucket, REQUESTS partitioned in two, the pool map stored, a total of 3,000."""
    server, files = secured
    admin = await Bus.connect(server.url, name="admin", credentials=files.creds("admin"))
    await admin.provision(jobs=True)
    assert await admin.set_partitions(2)
    await store_pools(admin, PoolMap.parse(POOLS))
    await set_quotas(admin, cluster__total=3000, class__online__queue=100)
    try:
        yield server, files, admin
    finally:
        await admin.close()


async def _decisions(admin: Bus, stage: str) -> list[Decision]:
    return [d for d in (Decision.decode(data) for _, data in await admin.stream_messages(S.STREAM_DECISIONS))
            if d.stage == stage]


# --- (a) every partitioned role doing its job --------------------------------------------------
async def test_partition_admitters_coordinator_pool_routers_and_runner_work_on_their_own_roles(
        connect, provisioned, caplog):  # noqa: F811
    server, files, admin = provisioned
    coord_bus = await connect("coordinator")
    await coord_bus.provision()  # natsched coordinator's start-up: reads only, P already 2
    assert await change_partitions(coord_bus, 2) is False
    coord = Coordinator(coord_bus, CoordinatorSettings(name="coord", partitions=2, interval_s=0.1, lease_s=1.0))
    await coord.start()
    admitters = []
    for k in (0, 1):  # no candidate of their own: the coordinator role alone plans
        admitters.append(AdmitterService(await connect(f"admitter-p{k}"), AdmitterServiceSettings(
            name=f"adm-p{k}", partition=k, partitions=2, coordinate=False, ack_wait_s=5.0, keepalive_s=1.0,
            reconcile_interval_s=3600)))
    routers = {pool: RouterService(await connect(S.pool_router(pool)), RouterServiceSettings(
        name=f"rtr-{pool}", pool=pool, core=RouterSettings(policy="least_loaded"), retry_delay_s=0.2))
        for pool in ("a", "b")}
    workers = [WorkerAgent(await connect(f"worker-{w}"), SimEngine(H100_LLAMA8B, block_size=32, time_scale=0.05),
                           WorkerSettings(id=w, model=m, heartbeat_interval_s=0.2)) for w, m in WORKER_MODELS.items()]
    runner = OfflineRunner(await connect("offline"), OfflineSettings(poll_s=0.02, partitions=2))
    try:
        await asyncio.gather(*(a.start() for a in admitters))
        for service in (*routers.values(), *workers, runner):
            await service.start()
        assert await wait_for(lambda: all(a.budget > 0 for a in admitters))  # the coordinator's plan applied
        assert coord.plans_written >= 1
        plan = decode_plan((await admin.kv(S.BUCKET_BUDGET).get(S.KEY_PLAN))[0])
        assert sum(plan.grants.values()) <= 3000
        assert await wait_for(lambda: all(len(a.worker_models) == 2 for a in admitters))
        assert await wait_for(lambda: all(len(r.core.workers) == 1 for r in routers.values()))

        producers = {t: Client(await connect(f"producer-{t}"), Timeouts(admission=20, idle=30)) for t in (P0, P1)}
        reqs = [tenant_request(t, f"{t} asks about {m} " * 6, model=m, max_tokens=3)
                for t in (P0, P1) for m in ("ma", "mb")]
        results = await asyncio.gather(*(producers[r.tenant].submit(r) for r in reqs))
        assert [(r.status, r.worker) for r in results] == [("completed", "w1"), ("completed", "w2")] * 2
        admitted_by = {d.request_id: d.by for d in await _decisions(admin, "admission") if d.decision == "allow"}
        assert {r.id: admitted_by[r.id] for r in reqs} == {
            r.id: "adm-p0" if r.tenant == P0 else "adm-p1" for r in reqs}  # each tenant by its partition
        routed_by = {d.request_id: d.by for d in await _decisions(admin, "routing")}
        assert {r.id: routed_by[r.id] for r in reqs} == {r.id: "rtr-a" if r.model == "ma" else "rtr-b" for r in reqs}

        # the gateway's status page, on its own role: every partition's usage and its budget in the plan
        gw = await start_gateway(server.url, keys={KEY: {"tenant": P0, "class": "online", "status": True}},
                                 credentials=files.creds("gateway"))
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                shown = (await http.get(gw.url + "/status.json", headers={"Authorization": f"Bearer {KEY}"})).json()
        finally:
            await gw.close()
        assert [p["partition"] for p in shown["partitions"]] == [0, 1]
        assert all(p["budget"] is not None for p in shown["partitions"])

        # offline work: degraded by the partition admitter, admitted by the runner through its partition
        jobs = [tenant_request(t, f"{t} offline job " * 6, cls=S.OFFLINE, model="mb", max_tokens=2) for t in (P0, P1)]
        degraded = await asyncio.gather(*(producers[j.tenant].submit(j) for j in jobs))
        assert [d.status for d in degraded] == ["degraded"] * 2
        store = JobStore(admin)

        async def jobs_completed() -> bool:
            found = [await store.find(d.job_id) for d in degraded]
            return all(f is not None and f[1].status == "completed" for f in found)
        assert await wait_for(jobs_completed, timeout=60)
        for k in (0, 1):  # every reservation released in its own partition's bucket
            assert await wait_for(lambda k=k: admitters[k].shared.usage.used == 0)

        # an admitter's embedded candidate: the lease and the plan, on admitter-p1's credentials
        await coord.resign()
        await coord.bus.close()  # (its loop ends with its connection; it may have renewed meanwhile)
        candidate = Coordinator(admitters[1].bus, CoordinatorSettings(name="adm-p1", partitions=2))
        assert await wait_for(lambda: candidate.hold_lease(time.time()))
        current = await admin.kv(S.BUCKET_BUDGET).get(S.KEY_PLAN)
        rev = await admitters[1].bus.kv(S.BUCKET_BUDGET).update(S.KEY_PLAN, current[0], current[1])
        assert rev > current[1]  # the same plan again, by compare-and-swap: the epoch did not move
        await candidate.tick()  # a whole tick: reports and quotas read in windows, within its rights
    finally:
        for w in workers:
            await w.stop()
    assert_no_violation(caplog)


# --- (b) what each role may not do ----------------------------------------------------------------
async def test_a_partition_admitter_is_confined_to_its_own_partition(probe):  # noqa: F811
    p0 = await probe("admitter-p0")
    assert not await p0.publish("$JS.API.CONSUMER.INFO.REQUESTS.admitter-p0", b"")  # its own: allowed
    assert not await p0.publish("$JS.API.STREAM.INFO.KV_inflight-p0", b"")
    for subject in (
            # another partition's requests, by its consumer or by re-pointing its own
            "$JS.API.CONSUMER.CREATE.REQUESTS.admitter-p1.reqp.1.>", "$JS.API.CONSUMER.CREATE.REQUESTS.admitter-p0.reqp.1.>",
            "$JS.API.CONSUMER.CREATE.REQUESTS.admitter-p0.reqp.>", "$JS.API.CONSUMER.MSG.NEXT.REQUESTS.admitter-p1",
            "$JS.API.CONSUMER.MSG.NEXT.REQUESTS.admitter", "$JS.ACK.REQUESTS.admitter-p1.1.1.1.1.1.0",
            "$JS.API.CONSUMER.CREATE.COMPLETIONS.admitter-completions-p1.done.>",
            # another partition's bucket and reports, the unpartitioned key, quotas, the partitioning
            "$KV.inflight-p1.usage", "$KV.inflight-p1.res.r1", "$KV.inflight.usage", "$KV.budget.report.1.adm-p1",
            "$JS.API.DIRECT.GET.KV_inflight-p1.$KV.inflight-p1.usage", "$JS.API.CONSUMER.CREATE.KV_inflight-p1",
            "$KV.quotas." + S.KEY_DYNAMIC_TOTAL, "$KV.quotas." + S.KEY_CLUSTER_TOTAL,
            "$JS.API.STREAM.UPDATE.REQUESTS"):
        assert await p0.publish(subject, b"{}"), f"admitter-p0 publishing to {subject} was not refused"


async def test_the_coordinator_plans_and_touches_no_request_usage_or_report(probe):  # noqa: F811
    c = await probe("coordinator")
    assert not await c.publish("$JS.API.STREAM.INFO.KV_budget", b"")
    for subject in ("$KV.inflight-p0.usage", "$KV.inflight.usage", "$KV.budget.report.0.adm-p0",
                    "$KV.quotas." + S.KEY_CLUSTER_TOTAL, "$JS.API.CONSUMER.CREATE.REQUESTS.admitter-p0.reqp.0.>",
                    "$JS.API.CONSUMER.MSG.NEXT.REQUESTS.admitter-p0", S.admitted("a", S.ONLINE, P0),
                    S.tenant_reply(P0, "r1"), S.work("w1"), "$JS.API.STREAM.UPDATE.REQUESTS"):
        assert await c.publish(subject, b"{}"), f"the coordinator publishing to {subject} was not refused"
    assert await c.subscribe(S.HEARTBEATS_ALL)


async def test_producers_and_workers_gain_nothing_from_partitions(probe):  # noqa: F811
    prod = await probe(f"producer-{P0}")
    assert not await prod.publish(S.cancel(P0, "r1"))  # its own (core NATS): allowed
    for subject in (f"reqp.0.online.{P0}", f"reqp.1.online.{P0}", f"reqp.0.online.{P1}",  # past the transform
                    "$KV.inflight-p0.usage", "$KV.inflight-p1.usage", "$KV.budget.plan", "$KV.budget.report.0.x",
                    "JS.NATSCHED.API.DIRECT.GET.KV_budget.$KV.budget.plan", "JS.NATSCHED.API.STREAM.MSG.GET.KV_budget",
                    "JS.NATSCHED.API.STREAM.MSG.GET.KV_inflight-p0", "$JS.API.STREAM.MSG.GET.KV_budget"):
        assert await prod.publish(subject, b"{}"), f"producer publishing to {subject} was not refused"
    worker = await probe("worker-w1")
    for subject in ("$JS.API.DIRECT.GET.KV_budget.$KV.budget.plan", "$JS.API.STREAM.MSG.GET.KV_budget",
                    "$JS.API.CONSUMER.CREATE.KV_budget", "$JS.API.CONSUMER.CREATE.KV_budget.w.$KV.budget.>",
                    "$KV.budget.plan", "$KV.inflight-p0.usage", "$JS.API.DIRECT.GET.KV_inflight-p0.$KV.inflight-p0.usage",
                    "$JS.API.CONSUMER.CREATE.REQUESTS.admitter-p0.reqp.0.>"):
        assert await worker.publish(subject, b"{}"), f"worker publishing to {subject} was not refused"


async def test_a_pool_router_consumes_its_own_pool_only(probe):  # noqa: F811
    a = await probe("router-a")
    assert not await a.publish("$JS.API.CONSUMER.INFO.ADMITTED.router-a", b"")
    for subject in ("$JS.API.CONSUMER.CREATE.ADMITTED.router-b.adm.b.>", "$JS.API.CONSUMER.CREATE.ADMITTED.router-a.adm.b.>",
                    "$JS.API.CONSUMER.CREATE.ADMITTED.router-a.adm.>", "$JS.API.CONSUMER.CREATE.ADMITTED.router.adm.all.>",
                    "$JS.API.CONSUMER.MSG.NEXT.ADMITTED.router-b", "$JS.API.CONSUMER.MSG.NEXT.ADMITTED.router",
                    "$JS.ACK.ADMITTED.router-b.1.1.1.1.1.0", "$KV.config." + S.KEY_POOLS):
        assert await a.publish(subject, b"{}"), f"router-a publishing to {subject} was not refused"


async def test_the_runner_and_the_gateway_read_the_plan_and_write_no_budget(probe):  # noqa: F811
    runner, gateway = await probe("offline"), await probe("gateway")
    assert not await runner.publish("$JS.API.STREAM.INFO.KV_inflight-p1", b"")
    for subject in ("$KV.budget.plan", "$KV.budget.coordinator", "$KV.budget.report.0.x", "$KV.inflight-p1.other"):
        assert await runner.publish(subject), f"the offline runner publishing to {subject} was not refused"
    for subject in ("$KV.inflight-p0.usage", "$KV.budget.plan", "JS.NATSCHED.API.CONSUMER.CREATE.KV_budget"):
        assert await gateway.publish(subject), f"the gateway publishing to {subject} was not refused"


# --- auth init's flags ------------------------------------------------------------------------------
def _auth_init(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="natsched")
    add_auth_parser(parser.add_subparsers(dest="command"))
    return cmd_auth(parser.parse_args(["auth", "init", *argv]))


def test_init_flags_write_the_partition_and_pool_users_and_refuse_a_bad_pool_spec(tmp_path, capsys):
    out = tmp_path / "out"
    assert _auth_init("--out", str(out), "--tenants", P0, "--workers", "w1", "--partitions", "3",
                      "--router-pools", POOLS) == 0
    users = {p.stem for p in (out / "creds").iterdir()}
    assert {"admitter-p0", "admitter-p1", "admitter-p2", "coordinator", "router-a", "router-b"} <= users
    check = subprocess.run([find_binary(), "-c", str(out / "nats-auth.conf"), "-t"], capture_output=True, text=True, check=False,
                           timeout=30)
    assert check.returncode == 0, check.stderr
    # replaced with fewer partitions: the users it no longer has lose their files too
    assert _auth_init("--out", str(out), "--tenants", P0, "--workers", "w1", "--force") == 0
    assert not {p.stem for p in (out / "creds").iterdir()} & {"admitter-p0", "coordinator", "router-a"}
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert _auth_init("--out", str(bad), "--router-pools", "a.b=m") == 1
    assert "subject token" in capsys.readouterr().err and not bad.exists()
    with pytest.raises(SystemExit):  # argparse: N must be a positive integer
        _auth_init("--out", str(bad), "--partitions", "0")
