"""The agent in front of an engine server: away while it is silent, back when it answers, and a
new cache epoch re-registers it with the router (``started_at``) and sends a snapshot after.

A scripted engine stands in for the server's reachability (the real one:
``test_vllm_server.py``, the engine's own detection: ``test_vllm_server_answers.py``); the bus is
the real test server. Also ``natsched worker --engine vllm-server`` as a process, in front of the
fake server of ``test_vllm_server_answers``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from natsched.hosting.runtime import READY_PREFIX
from natsched.wire import subjects as S
from natsched.wire.schema import CacheEvent, Heartbeat, ServedModel, WorkerId
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.engine import EngineOutput, EngineStats
from tests.factories.core import wait_for
from tests.workers.test_vllm_server_answers import Fake, fake_server


class ServerLike:
    """An engine with a server's extras: ``epoch``, ``served_models()``, ``unreachable_s``."""

    block_size = 32

    def __init__(self) -> None:
        self.st = EngineStats(kv_total_blocks=100, capacity_tokens=3200)
        self.epoch = time.time()
        self.cached: list[int] = [11, 12]

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def set_cache_listener(self, fn) -> None: ...

    def cached_hashes(self) -> list:
        return list(self.cached)

    def stats(self) -> EngineStats:
        return self.st

    def served_models(self) -> list[ServedModel]:
        return [ServedModel(id="tiny", max_model_len=1024), ServedModel(id="sql", parent="tiny", active=True)]

    async def abort(self, request_id: str) -> None: ...

    async def generate(self, request):
        yield EngineOutput(0, finished=True, finish_reason="length", prompt_tokens=1, output_tokens=1)


async def listen(bus, subject, cls):
    out: list = []

    async def on(subj, data, headers):
        out.append(cls.decode(data))

    await bus.subscribe(subject, on)
    return out


async def test_a_silent_server_sends_the_agent_to_backoff_then_away_and_back(bus):
    engine = ServerLike()
    agent = WorkerAgent(bus, engine, WorkerSettings(id="sv1", model="tiny", heartbeat_interval_s=0.05,
                                                    unreachable_leave_s=0.3))
    hbs = await listen(bus, S.heartbeat(WorkerId("sv1")), Heartbeat)
    await agent.start()
    try:
        assert await wait_for(lambda: hbs and [m.id for m in hbs[-1].served] == ["tiny", "sql"])
        engine.st.unreachable_s, engine.st.unreachable_reason = 0.1, "/metrics: ConnectError"
        assert await wait_for(lambda: hbs[-1].state == "backoff")
        engine.st.unreachable_s = 0.5
        assert await wait_for(lambda: hbs[-1].state == "quiescing")
        assert not agent._stopped.is_set()  # away, not drained: the process stays to come back
        engine.st.unreachable_s = 0.0
        assert await wait_for(lambda: hbs[-1].state == "healthy")
        # a heartbeat that comes late (a loaded machine) and finds the server silent past the
        # leave time already still announces backoff once before the leave
        seen = len(hbs)
        engine.st.unreachable_s = 5.0
        assert await wait_for(lambda: hbs[-1].state == "quiescing")
        states = [h.state for h in hbs[seen - 1:]]
        assert [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s] == ["healthy", "backoff", "quiescing"]
    finally:
        await agent.stop()


async def test_a_drained_agent_stays_drained_when_its_server_comes_and_goes(bus):
    from natsched.wire.schema import Control

    engine = ServerLike()
    agent = WorkerAgent(bus, engine, WorkerSettings(id="sv2", heartbeat_interval_s=0.05, unreachable_leave_s=0.1))
    hbs = await listen(bus, S.heartbeat(WorkerId("sv2")), Heartbeat)
    await agent.start()
    try:
        await bus.publish(S.control(WorkerId("sv2")), Control(kind="drain", ts=time.time(), by="test"))
        assert await wait_for(lambda: agent._stopped.is_set())
        engine.st.unreachable_s = 0.5
        await wait_for(lambda: len(hbs) > 5)
        engine.st.unreachable_s = 0.0
        n = len(hbs)
        assert await wait_for(lambda: len(hbs) > n + 3)
        assert hbs[-1].state == "quiescing"  # coming back does not undo a drain
    finally:
        await agent.stop()


async def test_a_new_cache_epoch_re_registers_the_worker_and_snapshots_after(bus):
    engine = ServerLike()
    agent = WorkerAgent(bus, engine, WorkerSettings(id="sv3", heartbeat_interval_s=0.05))
    hbs = await listen(bus, S.heartbeat(WorkerId("sv3")), Heartbeat)
    kvs = await listen(bus, S.cache_events(WorkerId("sv3")), CacheEvent)
    await agent.start()
    try:
        assert await wait_for(lambda: len(hbs) >= 2)
        first = hbs[-1].started_at
        engine.cached = [21]
        engine.epoch = time.time() + 1  # the server restarted (or its events were lost)
        assert await wait_for(lambda: hbs[-1].started_at > first)
        assert await wait_for(lambda: kvs and kvs[-1].kind == "snapshot" and kvs[-1].hashes == [21])
        hb_new = next(h for h in hbs if h.started_at > first)
        assert kvs[-1].seq > hb_new.kv_seq  # after the heartbeat that reset the router's view
    finally:
        await agent.stop()


async def test_natsched_worker_vllm_server_process_fronts_a_server(bus, nats_url):
    fake = Fake()
    async with fake_server(fake) as (url, _):
        proc = subprocess.Popen([sys.executable, "-m", "natsched", "worker", "--nats-url", nats_url, "--id", "cli1",
                                 "--engine", "vllm-server", "--url", url, "--heartbeat", "0.2"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        hbs = await listen(bus, S.heartbeat(WorkerId("cli1")), Heartbeat)
        try:
            line = await asyncio.to_thread(_ready_line, proc)
            assert "engine=vllm-server model=tiny" in line
            assert await wait_for(lambda: hbs and hbs[-1].model == "tiny", timeout=20)
            assert [(m.id, m.parent) for m in hbs[-1].served] == [("tiny", None), ("sql-lora", "tiny")]
            assert hbs[-1].kv_total_blocks == 256 and hbs[-1].block_size == 32  # from the server's metrics
            assert hbs[-1].capacity_tokens == 256 * 32  # what the admitters' total sums
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)


def _ready_line(proc) -> str:
    for line in proc.stdout:
        if line.startswith(READY_PREFIX):
            return line
    raise AssertionError(f"worker exited with {proc.wait()} before it was ready")


async def test_the_servers_own_counters_reach_the_agents_prometheus_page(bus):
    """vllm:num_preemptions and vllm:prefix_cache_queries/_hits, scraped from the server, as the
    worker's natsched_worker_engine_* gauges (the backoff monitor takes the preemption rate)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from natsched.workers.vllm_server import ServerEngine, ServerSettings

    def page() -> dict[str, float]:
        text = generate_latest(agent.metrics.registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("natsched_worker_engine_")}

    async with fake_server(Fake()) as (url, _):
        engine = ServerEngine(ServerSettings(url=url, scrape_interval_s=0.05))
        agent = WorkerAgent(bus, engine, WorkerSettings(id="sv4", model="tiny", heartbeat_interval_s=0.05))
        await agent.start()
        try:
            assert await wait_for(lambda: page().get("natsched_worker_engine_prefix_cache_queries") == 400)
            assert page() == {"natsched_worker_engine_preemptions": 7,
                              "natsched_worker_engine_prefix_cache_queries": 400,
                              "natsched_worker_engine_prefix_cache_hits": 192}
        finally:
            await agent.stop()
