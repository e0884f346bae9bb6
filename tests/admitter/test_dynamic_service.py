"""The capacity-following total in the admitter service, on a real nats-server: the completions it
releases carry the workers' cached-token counts, and the factor's ceiling rises with that measured
prefix sharing (natsched/admitter/dynamic.py) — never past the configured ``cluster.total``."""

from __future__ import annotations

import time

import pytest

from natsched.wire import subjects as S
from tests.admitter.test_service import publish, request, set_quotas, start_admitter, stop
from tests.factories.core import make_completion
from tests.factories.core import wait_for as until


def settle(adm, capacity: int, used: int) -> int:
    adm.worker_load = {"w1": (capacity, used, time.time())}  # what w1's heartbeat would say
    for _ in range(60):
        total = adm.update_dynamic_total()
    return total


async def test_the_measured_prefix_sharing_lifts_the_factor_ceiling(bus, nats_url):
    await set_quotas(bus, cluster__total=100_000)
    adm = await start_admitter(nats_url)
    try:
        assert settle(adm, capacity=1_000, used=100) == 2_000  # nothing measured yet: 2 x capacity
        reqs = [request("t1", tokens=100) for _ in range(4)]
        for r in reqs:
            await publish(bus, r)
        assert await until(lambda: all(r.id in adm.shared.reservations for r in reqs), timeout=5)
        for r in reqs:  # 80 of each 100 prompt tokens were served from the workers' cache
            await bus.jpublish(S.completion("t1", "w1"),
                               make_completion(r.id, runtime_tokens=300, prompt_tokens=100, cached_tokens=80),
                               msg_id=f"done-{r.id}")
        assert await until(lambda: adm.shared.usage.used == 0, timeout=5)
        assert adm.cache_share.share() == pytest.approx(0.8)
        assert settle(adm, capacity=1_000, used=100) == pytest.approx(10_000, rel=0.01)  # 2 / (1 - 0.8)
        await set_quotas(bus, cluster__total=5_000)
        assert await until(lambda: adm.core.quotas.total == 5_000, timeout=5)
        assert settle(adm, capacity=1_000, used=100) == 5_000  # the configured total stays the ceiling
    finally:
        await stop(adm)
