"""Router pools per model on a real nats-server (issue 27): two pools, each with its own router
(consumer ``router-<pool>``) and workers; a model's requests reach only its pool's router."""

import asyncio

import pytest

from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.bus.connection import Bus
from natsched.bus.pools import store_pools
from natsched.client.errors import Rejected
from natsched.client.producer import Client, Timeouts, make_request
from natsched.router.core import RouterSettings
from natsched.router.errors import ConfigError
from natsched.router.service import RouterService, RouterServiceSettings
from natsched.wire import subjects as S
from natsched.wire.pools import PoolMap
from natsched.wire.schema import Decision
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.profiles import H100_LLAMA8B
from natsched.workers.simengine import SimEngine
from tests.factories.core import wait_for
from tests.serverwatch import wait_gone

POOLS = PoolMap.parse("a=ma;b=mb")
WORKERS = {"wa1": "ma", "wa2": "ma", "wb1": "mb", "wc1": "mc"}  # mc: served, but routed by no pool


class Fleet:
    def __init__(self, url):
        self.url, self.buses, self.agents, self.routers = url, [], [], {}
        self.routed: list[Decision] = []

    async def connect(self, name):
        b = await Bus.connect(self.url, name=name)
        self.buses.append(b)
        return b

    async def router(self, pool):
        r = RouterService(await self.connect(f"router-{pool}"), RouterServiceSettings(
            name=f"router-{pool}", core=RouterSettings(policy="least_loaded"), retry_delay_s=0.2,
            no_worker_wait_s=2.0, pool=pool))
        await r.start()
        self.routers[pool] = r
        return r

    async def start(self, pools: PoolMap):
        control = await self.connect("operator")
        await control.provision()
        await store_pools(control, pools)

        async def on_decision(subject, data, headers):
            self.routed.append(Decision.decode(data))

        await control.subscribe(S.decision("routing", "t"), on_decision)
        self.admitter = AdmitterService(await self.connect("admitter"), AdmitterServiceSettings())
        await self.admitter.start()
        for pool in sorted(pools.pools):
            await self.router(pool)
        for wid, model in WORKERS.items():
            engine = SimEngine(H100_LLAMA8B, block_size=32, time_scale=0.05)
            agent = WorkerAgent(await self.connect(wid), engine,
                                WorkerSettings(id=wid, model=model, heartbeat_interval_s=0.2))
            await agent.start()
            self.agents.append(agent)
        self.client = Client(await self.connect("producer"), Timeouts(admission=10, idle=20))
        assert await wait_for(lambda: self.admitter.core.served_models == frozenset(WORKERS.values()))
        return self

    async def close(self):
        for a in self.agents:
            await a.stop()
        for b in self.buses:
            await b.close()
        await wait_gone(self.url, self.buses)


@pytest.fixture
async def fleet(bus, nats_url):
    f = Fleet(nats_url)
    try:
        yield await f.start(POOLS)
    finally:
        await f.close()


async def test_each_pool_router_registers_only_its_models_workers(fleet):
    a, b = fleet.routers["a"], fleet.routers["b"]
    assert await wait_for(lambda: set(a.core.workers) == {"wa1", "wa2"} and set(b.core.workers) == {"wb1"})
    assert await wait_for(lambda: a.foreign > 0 and b.foreign > 0)  # it heard the others, and ignored them
    await asyncio.sleep(0)  # (a later heartbeat of another pool's worker registers nothing either)
    assert set(a.core.workers) == {"wa1", "wa2"} and set(b.core.workers) == {"wb1"}


async def test_a_models_requests_reach_only_its_pools_router_and_workers(fleet):
    results = await asyncio.gather(*[fleet.client.submit(make_request("t", f"hello {i}", model="ma", max_tokens=4))
                                     for i in range(12)],
                                   *[fleet.client.submit(make_request("t", f"hi {i}", model="mb", max_tokens=4))
                                     for i in range(6)])
    assert all(r.status == "completed" for r in results)
    assert {r.worker for r in results[:12]} <= {"wa1", "wa2"} and {r.worker for r in results[12:]} == {"wb1"}
    ids_a = {r.request_id for r in results[:12]}
    assert await wait_for(lambda: len(fleet.routed) >= 18)
    by = {d.request_id: d.by for d in fleet.routed}
    assert {by[i] for i in ids_a} == {"router-a"}  # router b never decided (nor saw) one of pool a's
    assert {by[r.request_id] for r in results[12:]} == {"router-b"}
    consumers = {c.name: c.config.filter_subject for c in await fleet.buses[0].js.consumers_info(S.STREAM_ADMITTED)}
    assert consumers == {"router-a": "adm.a.>", "router-b": "adm.b.>"}


async def test_a_model_no_pool_routes_is_refused_at_admission_naming_the_pools(fleet):
    with pytest.raises(Rejected) as err:
        await fleet.client.submit(make_request("t", "hello", model="mc", max_tokens=4))
    assert err.value.reason == "no_pool"
    assert "'mc'" in str(err.value) and "a (ma); b (mb)" in str(err.value)
    assert (await fleet.buses[0].js.stream_info(S.STREAM_ADMITTED)).state.messages == 0  # stored nowhere


async def test_a_pool_added_live_is_used_by_the_admitter_at_once(fleet):
    await store_pools(fleet.buses[0], PoolMap.parse("a=ma;b=mb;c=mc"))
    assert await wait_for(lambda: fleet.admitter.core.pools.pool_of("mc") == "c")
    c = await fleet.router("c")
    assert await wait_for(lambda: set(c.core.workers) == {"wc1"})
    r = await fleet.client.submit(make_request("t", "hello", model="mc", max_tokens=4))
    assert (r.status, r.worker) == ("completed", "wc1")


async def test_a_router_of_a_pool_not_in_the_map_refuses_to_start(fleet):
    with pytest.raises(ConfigError, match="'z' is not in the pool map"):
        await fleet.router("z")


async def test_without_a_map_one_router_consumes_every_model_on_the_default_subject(bus, nats_url):
    f = Fleet(nats_url)
    try:
        await f.start(PoolMap())
        r = f.routers  # no pools: start a plain router
        plain = await f.router(S.DEFAULT_POOL)
        assert await wait_for(lambda: set(plain.core.workers) == set(WORKERS))
        stored: list[str] = []

        async def on_adm(subject, data, headers):
            stored.append(subject)

        await f.buses[0].subscribe(S.ADMITTED_ALL, on_adm)
        results = await asyncio.gather(*[f.client.submit(make_request("t", "x", model=m, max_tokens=4))
                                         for m in ("ma", "mb", "mc")])
        assert [x.status for x in results] == ["completed"] * 3 and not r.keys() - {S.DEFAULT_POOL}
        assert set(stored) == {"adm.all.online.t"}
        consumers = {c.name: c.config.filter_subject for c in await f.buses[0].js.consumers_info(S.STREAM_ADMITTED)}
        assert consumers == {"router": "adm.all.>"}
    finally:
        await f.close()


async def test_a_bad_pool_map_is_ignored_and_the_one_in_force_kept(fleet):
    rev = await fleet.buses[0].kv(S.BUCKET_CONFIG).put(S.KEY_POOLS, b'{"a": ["ma"], "b": ["ma"]}')  # ma twice
    assert await wait_for(lambda: fleet.admitter.pools.revision >= rev)  # seen...
    assert fleet.admitter.core.pools == POOLS  # ...and refused: the map in force stays
    r = await fleet.client.submit(make_request("t", "hello", model="ma", max_tokens=4))
    assert r.status == "completed" and r.worker in ("wa1", "wa2")


def test_the_gateway_answers_no_pool_as_an_unknown_model():
    from natsched.gateway.service import GatewaySettings, api_error

    err = api_error(Rejected("model 'mc' is routed by no router pool; pools: a (ma)", "r1", "no_pool", None),
                    GatewaySettings())
    assert (err.status, err.code) == (404, "model_not_found") and "no router pool" in str(err)


async def test_a_rescue_readmits_on_its_models_pool(bus, nats_url):
    from tests.admitter.test_rescue import make_assignment, reserve
    from tests.admitter.test_service import start_admitter, stop

    await bus.provision()
    await store_pools(bus, POOLS)
    adm = await start_admitter(nats_url, rescue_grace_s=0.0)  # no heartbeats from wdead: dead for it
    try:
        assert adm.core.pools == POOLS
        stuck = make_assignment(model="mb")
        await reserve(adm, stuck)
        await bus.jpublish(S.work(stuck.worker), stuck, msg_id=f"{stuck.request.id}:work")
        report = await adm.reclaim({})
        assert report.rescued == {stuck.request.id: "wdead"}
        [(subject, _)] = await bus.stream_messages(S.STREAM_ADMITTED)
        assert subject == S.admitted("b", stuck.request.cls, stuck.request.tenant)
    finally:
        await stop(adm)


def test_the_admitter_core_refuses_a_model_no_pool_routes_and_names_the_pools():
    import time

    from natsched.admitter.policy import REJECT, AdmitterCore

    core = AdmitterCore()
    req = make_request("t", "hello", model="mc", max_tokens=4)
    assert core.evaluate(req, time.time()).decision != REJECT  # no map: the one pool routes every model
    core.set_pools(POOLS)
    dec = core.evaluate(req, time.time())
    assert (dec.decision, dec.reason) == (REJECT, "no_pool") and "a (ma); b (mb)" in dec.message
    assert core.evaluate(make_request("t", "hello", model="ma", max_tokens=4), time.time()).decision != REJECT
    core.set_pools(PoolMap.parse("a=ma;b=*"))
    assert core.evaluate(req, time.time()).decision != REJECT  # the * pool takes it


async def test_an_inline_router_leaves_a_configured_pools_requests_to_its_routers(bus, nats_url):
    from tests.factories.stack import start_stack

    stack = await start_stack(nats_url, workers=1, inline_routing=True)
    try:
        await store_pools(bus, PoolMap.parse("a=default"))
        assert await wait_for(lambda: stack.admitter.core.pools.pool_of("default") == "a")
        pool_a = RouterService(await Bus.connect(nats_url, name="router-a"), RouterServiceSettings(
            name="router-a", core=RouterSettings(policy="least_loaded"), retry_delay_s=0.2, pool="a"))
        stack.buses.append(pool_a.bus)
        await pool_a.start()
        assert await wait_for(lambda: set(pool_a.core.workers) == {"w1"})
        routed: list[Decision] = []

        async def on_decision(subject, data, headers):
            routed.append(Decision.decode(data))

        await bus.subscribe(S.decision("routing", "t"), on_decision)
        r = await stack.client.submit(make_request("t", "hello", model="default", max_tokens=4))
        assert r.status == "completed"
        assert await wait_for(lambda: [d.by for d in routed] == ["router-a"])
    finally:
        await stack.close()
