"""Router replicas share what they learned of each worker through bucket ``workers`` (real NATS)."""

from __future__ import annotations

import time

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from natsched.wire.schema import Admitted, Completion
from tests.factories.core import make_heartbeat, make_request
from tests.factories.core import wait_for as until


@pytest.fixture
async def routers(bus, nats_url):
    out = []
    for name in ("ra", "rb"):
        svc = RouterService(await Bus.connect(nats_url, name=name), RouterServiceSettings(
            name=name, core=RouterSettings(policy="least_loaded"), tick_s=3600.0))  # publishes when told to
        await svc.start()
        out.append(svc)
    try:
        yield out
    finally:
        for svc in out:
            await svc.bus.close()


def serve(svc: RouterService, n: int, slow: float, start: int) -> None:
    """Route ``n`` requests through ``svc`` and complete them as a worker ``slow`` x the fixed model would."""
    base = svc.core.settings.cost
    for i in range(n):
        # the worker's heartbeat between requests: nothing queued (each finished before the next)
        svc.core.on_heartbeat(make_heartbeat("w1", seq=start + i + 2, interval=1.0), time.time())
        req = make_request(id=f"{svc.settings.name}-{start + i}", prompt_token_ids=list(range(64 * (1 + i % 8))),
                           max_tokens=8)
        r = svc.decide(Admitted(request=req, runtime_tokens=600, admitted_at=time.time()))
        assert r.decision.worker == "w1"
        prompt = len(req.prompt_token_ids)
        ttft = slow * base.first_token_s(prompt, 0) + 0.006 * slow
        svc.observe_completion(Completion(request_id=req.id, tenant=req.tenant, status="ok", runtime_tokens=600,
                                          worker="w1", prompt_tokens=prompt, output_tokens=8, ttft=ttft,
                                          tpot=0.02 * slow, ts=time.time()))


async def test_two_routers_converge_on_the_same_coefficients(bus, routers):
    ra, rb = routers
    hb = make_heartbeat("w1", seq=1, interval=1.0)
    for svc in routers:
        svc.core.on_heartbeat(hb, time.time())
    serve(ra, 40, slow=3.0, start=0)  # each replica routed half the requests to the slow worker...
    serve(rb, 40, slow=3.0, start=100)
    assert await ra.publish_costs(time.time()) == 1 and await rb.publish_costs(time.time()) == 1
    await until(lambda: ("w1", rb.instance) in ra._others and ("w1", ra.instance) in rb._others)
    a, b = ra.core.costs.of("w1"), rb.core.costs.of("w1")
    # ...and each now solves both halves: the very same coefficients, on both replicas
    assert a.prefill_tokens_per_s == pytest.approx(b.prefill_tokens_per_s, rel=1e-9)
    assert a.decode_step_s == pytest.approx(b.decode_step_s, rel=1e-9)
    assert a.prefill_tokens_per_s < ra.core.settings.cost.prefill_tokens_per_s / 2  # it learned "slow"
    rec = orjson.loads((await bus.kv(S.BUCKET_WORKERS).get(S.cost_key("w1", ra.instance)))[0])
    assert rec["health"] == "healthy" and rec["samples"] > 0 and rec["estimate"]["prefill_tokens_per_s"] > 0


@pytest.mark.parametrize("value", [b"not json", b"[1, 2]", orjson.dumps({"at": "x"}),
                                   orjson.dumps({"at": 1e18, "stats": {"prefill": {"a": [[float("nan")]]}}})])
async def test_a_bad_shared_record_is_refused_and_counted(routers, value):
    ra, _ = routers
    before = ra.core.costs.of("w9")
    assert ra.apply_cost_record(S.cost_key("w9", "evil"), value, time.time()) is False
    assert ra.metrics.bad_reports.labels("cost")._value.get() == 1
    assert ra.core.costs.of("w9") == before


async def test_bad_completions_are_refused_counted_and_exported_as_metrics(routers):
    ra, _ = routers
    ra.core.on_heartbeat(make_heartbeat("w1", seq=1, interval=1.0), time.time())
    req = make_request(id="neg", prompt_token_ids=list(range(64)), max_tokens=8)
    ra.decide(Admitted(request=req, runtime_tokens=100, admitted_at=time.time()))
    learned = ra.core.costs.of("w1")
    ra.observe_completion(Completion(request_id=req.id, tenant=req.tenant, status="ok", runtime_tokens=100,
                                     worker="w1", prompt_tokens=64, output_tokens=8, ttft=-1.0, tpot=0.01))
    ra._count_refused()
    assert ra.metrics.cost_refused.labels("bad_ttft")._value.get() == 1
    assert ra.core.costs.of("w1") == learned


async def test_learning_and_health_settings_change_live_and_bad_ones_are_refused(routers):
    ra, _ = routers
    assert ra.apply_config(orjson.dumps({"policy": "least_loaded", "learn": {"tau_s": 30.0},
                                         "health": {"slow_factor": 3.0, "recover_factor": 2.0}}))
    assert ra.core.costs.settings.tau_s == 30.0 and ra.core.health.settings.slow_factor == 3.0
    for bad in ({"learn": {"tau_s": -1}}, {"learn": {"nope": 1}}, {"health": {"slow_factor": "fast"}},
                {"health": {"recover_factor": 5.0}}):
        assert not ra.apply_config(orjson.dumps({"policy": "least_loaded", **bad}))
    assert ra.core.costs.settings.tau_s == 30.0 and ra.core.health.settings.slow_factor == 3.0  # kept
    assert ra.metrics.config_errors._value.get() == 4
