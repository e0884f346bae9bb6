"""Per-model capacity in the admitter service, on a real nats-server: the heartbeats name each
worker's model and KV, and each model's admissions stay within its own workers' capacity
(natsched/admitter/dynamic.py ModelTotals), while the other model's requests keep going in."""

from __future__ import annotations

import time

from natsched.admitter.dynamic import DynamicTotalSettings
from natsched.wire import subjects as S
from natsched.wire.schema import Heartbeat, WorkerId
from tests.admitter.test_service import publish, request, set_quotas, start_admitter, stop
from tests.factories.core import make_completion
from tests.factories.core import wait_for as until


async def heartbeat(bus, worker: str, model: str, capacity: int, seq: int = 1) -> None:
    hb = Heartbeat(worker=WorkerId(worker), seq=seq, ts=time.time(), model=model, interval=60.0,
                   capacity_tokens=capacity, runtime_tokens=0)
    await bus.publish(S.heartbeat(WorkerId(worker)), hb)


async def test_each_models_admissions_follow_its_own_workers(bus, nats_url):
    await set_quotas(bus, cluster__total=100_000)
    # the interval loop stays out of the way: the test steps the totals itself
    adm = await start_admitter(nats_url, dynamic=DynamicTotalSettings(interval_s=3600))
    try:
        await heartbeat(bus, "wbig", "big", 10_000)
        await heartbeat(bus, "wsmall", "small", 400)
        assert await until(lambda: {"wbig", "wsmall"} <= adm.worker_models.keys(), timeout=5)
        adm.update_dynamic_total()  # idle workers: factor 1.1
        assert adm.core.model_totals == {"big": 11_000, "small": 440}
        first, second = request(tokens=100, model="small"), request(tokens=100, model="small")  # 300 each
        for r in (first, second):
            await publish(bus, r)
        bigs = [request(tokens=100, model="big") for _ in range(5)]
        for r in bigs:
            await publish(bus, r)
        assert await until(lambda: all(r.id in adm.shared.reservations for r in (first, *bigs)), timeout=5)
        assert await until(lambda: second.id in adm.core.queue, timeout=5)  # 600 > small's 440
        assert second.id not in adm.shared.reservations

        await heartbeat(bus, "wsmall2", "small", 400)  # a second worker of the small model
        assert await until(lambda: "wsmall2" in adm.worker_load, timeout=5)
        adm.update_dynamic_total()
        assert adm.core.model_totals["small"] >= 800
        assert await until(lambda: second.id in adm.shared.reservations, timeout=5)

        await heartbeat(bus, "wnew", "new", 1_000)  # a model appearing: bounded at once, not after an interval
        assert await until(lambda: "new" in (adm.core.model_totals or {}), timeout=5)
        fresh = request(tokens=100, model="new")
        await publish(bus, fresh)
        assert await until(lambda: fresh.id in adm.shared.reservations, timeout=5)

        for r in (first, second):
            await bus.jpublish(S.completion("t1", "w1"), make_completion(r.id, runtime_tokens=300, model="small"),
                               msg_id=f"done-{r.id}")
        assert await until(lambda: adm.shared.usage.model("small") == 0, timeout=5)
    finally:
        await stop(adm)


async def test_a_model_whose_engines_all_have_requests_waiting_is_held_at_the_door(bus, nats_url):
    """natsched/admitter/engines.py in the service: the heartbeats' ``waiting`` saturate a model,
    its next heartbeat with room lets the held request go; another model passes meanwhile."""
    await set_quotas(bus, cluster__total=100_000)
    adm = await start_admitter(nats_url, dynamic=DynamicTotalSettings(interval_s=3600))
    try:
        full = Heartbeat(worker=WorkerId("wq"), seq=1, ts=time.time(), model="small", interval=60.0,
                         capacity_tokens=10_000, runtime_tokens=9_000, running=8, waiting=3)
        await bus.publish(S.heartbeat(WorkerId("wq")), full)
        await heartbeat(bus, "wother", "big", 10_000)
        assert await until(lambda: adm.core.saturated == {"small"} and "wother" in adm.worker_load, timeout=5)
        held, other = request(tokens=100, model="small"), request(tokens=100, model="big")
        await publish(bus, held)
        await publish(bus, other)
        assert await until(lambda: other.id in adm.shared.reservations and held.id in adm.core.queue, timeout=5)
        assert held.id not in adm.shared.reservations
        await heartbeat(bus, "wq", "small", 10_000, seq=2)  # nothing waits in its engine now
        assert await until(lambda: held.id in adm.shared.reservations, timeout=5)
        assert adm.core.saturated == frozenset()
    finally:
        await stop(adm)
