"""A vLLM worker whose engine core dies: the request fails *reported*, the worker leaves with code 1."""

from __future__ import annotations

import asyncio
import time

import pytest

from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.wire.schema import Assignment, CacheEvent, Completion, Heartbeat, Reply, Request, WorkerId
from tests.conftest import wipe
from natsched.hosting.vllm_worker import VllmWorkerProcess
from tests.factories.core import wait_for

# no skip when vLLM is missing: CI installs the cpu extra, and a missing engine must fail loudly
pytestmark = pytest.mark.vllm

WID = WorkerId("wdead")
#: still streaming when the kill comes, even after the seconds this VM can keep the test from
#: running while vLLM works (the kill ends it early: a long request costs nothing)
LONG = 16_000


async def test_engine_core_death_is_reported_and_the_worker_exits_1(nats_url, tmp_path):
    import psutil

    from natsched.workers.tiny_model import LIVE_LAYERS, write_tiny_model

    bus = await Bus.connect(nats_url, name="test-vllm-death")
    await wipe(bus)
    await bus.provision()
    got: dict[str, list] = {"hb": [], "kv": [], "done": [], "reply": []}

    def sink(key, cls):
        async def on(s, d, h):
            got[key].append(cls.decode(d))
        return on

    await bus.subscribe(S.heartbeat(WID), sink("hb", Heartbeat))
    await bus.subscribe(S.cache_events(WID), sink("kv", CacheEvent))
    await bus.subscribe(S.COMPLETIONS_ALL, sink("done", Completion))
    await bus.subscribe("resp.>", sink("reply", Reply))
    proc = VllmWorkerProcess(nats_url, WID, write_tiny_model(tmp_path / "m", layers=LIVE_LAYERS), model="tiny-d",
                             skip_tokenizer_init=True, heartbeat=0.3, max_model_len=LONG + 96,
                             kv_cache_blocks=LONG // 32 + 64).start()
    try:
        await proc.await_ready(240)
        req = Request(id="dying", tenant="t1", cls="online", model="tiny-d", reply=S.reply("dying"),
                      prompt_token_ids=list(range(10, 74)), max_tokens=LONG, stream=True)
        await bus.jpublish(S.work(WID), Assignment(request=req, worker=WID, runtime_tokens=1000,
                                                   admitted_at=time.time(), routed_at=time.time()), msg_id=req.id)
        # kill while it streams: thousands of tokens are still to come
        assert await wait_for(lambda: sum(r.kind == "token" for r in got["reply"]) >= 5), proc.tail()
        cores = [p for p in psutil.Process(proc.proc.pid).children(recursive=True)
                 if p.name().startswith("VLLM::EngineCore")]
        assert cores, proc.tail()
        for p in cores:
            p.kill()
        assert await wait_for(lambda: got["done"]), proc.tail()
        c = got["done"][0]
        assert c.request_id == "dying" and c.status == "error" and c.reason == "engine_dead"
        # the reply follows the completion's publish ack: it may not be here yet
        assert await wait_for(lambda: any(r.final for r in got["reply"])), proc.tail()
        err = [r for r in got["reply"] if r.final][0]
        assert err.kind == "error" and err.reason == "engine_dead" and err.message
        code = await asyncio.to_thread(proc.wait, 60)
        assert code == 1, proc.tail()
        assert any(hb.state == "quiescing" for hb in got["hb"])
        assert sum(r.kind == "token" for r in got["reply"]) < LONG
        assert any(ev.kind == "cleared" for ev in got["kv"])
    finally:
        proc.stop()
        await bus.close()
