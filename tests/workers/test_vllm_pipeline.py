"""The whole path with real engines: two vLLM workers (CPU, tiny dummy-weights model) behind
the real admitter and router. A long prefix sent repeatedly must be served from the KV cache
of the worker the router chose, and that worker must have announced those blocks on
``worker.<id>.kv`` — the loop that cache-aware routing stands on.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from natsched.admitter.service import AdmitterService
from natsched.wire import subjects as S
from natsched.wire.blocks import request_block_hashes
from natsched.client.producer import Client, Timeouts
from natsched.bus.connection import Bus
from natsched.wire.schema import CacheEvent
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from tests.conftest import wipe
from tests.factories.core import apply_cache_event, submit_shared_prefix
from natsched.workers.tiny_model import write_tiny_model
from natsched.hosting.vllm_worker import VllmWorkerProcess

pytestmark = pytest.mark.vllm

MODEL = "tiny-p"
WORKERS = ("vp1", "vp2")


class CacheView:
    """Each worker's cache as a router following its events sees it."""

    def __init__(self) -> None:
        self.by_worker: dict[str, set[int]] = {w: set() for w in WORKERS}

    async def on_event(self, subject: str, data: bytes, headers: dict) -> None:
        ev = CacheEvent.decode(data)
        apply_cache_event(self.by_worker.setdefault(ev.worker, set()), ev)


@pytest.fixture(scope="module")
async def cluster(nats_url, tmp_path_factory):
    bus = await Bus.connect(nats_url, name="test-vllm-pipeline")
    await wipe(bus)
    await bus.provision()
    view = CacheView()
    await bus.subscribe(S.CACHE_EVENTS_ALL, view.on_event)
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-pipeline"))
    procs = [VllmWorkerProcess(nats_url, w, path, model=MODEL, kv_cache_blocks=256, max_model_len=1024,
                               concurrency=4, heartbeat=0.3, skip_tokenizer_init=True).start() for w in WORKERS]
    services: list = []
    try:
        await asyncio.gather(*(p.await_ready(300) for p in procs))
        admitter = AdmitterService(await Bus.connect(nats_url, name="admitter"))
        await admitter.start()
        router = RouterService(await Bus.connect(nats_url, name="router"),
                               RouterServiceSettings(core=RouterSettings(policy="natsched", block_size=32)))
        await router.start()
        services = [admitter, router]
        deadline = time.monotonic() + 30
        while len(router.core.workers) < len(WORKERS) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        client = Client(await Bus.connect(nats_url, name="producer"), Timeouts(admission=30, idle=120))
        yield client, router, view
        await client.close()
    finally:
        for p in procs:
            p.stop()
        for s in services:
            await s.bus.close()
        await bus.close()


async def test_router_sees_both_real_workers(cluster):
    _, router, _ = cluster
    assert set(router.core.workers) == set(WORKERS)
    assert all(w.model == MODEL and w.block_size == 32 for w in router.core.workers.values())


async def test_repeated_long_prefix_is_served_from_the_chosen_workers_cache(cluster):
    client, router, view = cluster
    prefix = [7 + (i * 13) % 1000 for i in range(256)]  # 8 blocks of 32 tokens
    results = await submit_shared_prefix(client, "t1", prefix, model=MODEL, max_tokens=4)
    first_req, first = results[0]
    prefix_hashes = request_block_hashes(first_req, 32)[:8]
    for req, res in results[1:]:
        assert res.status == "completed" and res.worker in WORKERS
        assert res.cached_tokens >= 7 * 32, (res.worker, res.cached_tokens)  # the last block may be recomputed
        assert set(prefix_hashes) <= view.by_worker[res.worker], "cached blocks the worker never announced"
    # the router kept the prefix where the cache is
    assert len({res.worker for _, res in results[1:]}) == 1
