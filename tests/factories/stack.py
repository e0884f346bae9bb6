"""Run the real services in-process (each on its own connection) against the test server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass, field

from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.client.producer import Client, Timeouts
from natsched.hosting.runtime import READY_PREFIX
from natsched.bus.connection import Bus
from tests.serverwatch import wait_gone
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.profiles import H100_LLAMA8B
from natsched.workers.simengine import SimEngine


@dataclass
class Stack:
    admitter: AdmitterService
    router: RouterService
    workers: list[WorkerAgent]
    client: Client
    buses: list[Bus] = field(default_factory=list)
    url: str = ""

    async def close(self) -> None:
        for w in self.workers:
            await w.stop()
        for b in self.buses:
            await b.close()
        await wait_gone(self.url, self.buses)  # nothing of this stack reaches the next test's streams


async def start_stack(
    url: str,
    workers: int = 2,
    *,
    policy: str = "least_loaded",
    time_scale: float = 0.05,
    heartbeat_s: float = 0.2,
    no_worker_wait_s: float = 10.0,
    kv_blocks: int | None = None,
    max_model_len: int = 131072,
    timeouts: Timeouts | None = None,
    inline_routing: bool = False,
) -> Stack:
    """``inline_routing``: the router runs inside the admitter, on its connection (admitter --route)."""
    buses = []

    async def connect(name: str) -> Bus:
        b = await Bus.connect(url, name=name)
        buses.append(b)
        return b

    router_settings = RouterServiceSettings(core=RouterSettings(policy=policy), no_worker_wait_s=no_worker_wait_s,
                                            retry_delay_s=0.2)
    if inline_routing:
        bus = await connect("admitter")
        router = RouterService(bus, router_settings)
        admitter = AdmitterService(bus, AdmitterServiceSettings(), router=router)
        await admitter.start()  # starts its router too
    else:
        admitter = AdmitterService(await connect("admitter"), AdmitterServiceSettings())
        await admitter.start()
        router = RouterService(await connect("router"), router_settings)
        await router.start()
    agents = []
    for i in range(1, workers + 1):
        engine = SimEngine(H100_LLAMA8B, block_size=32, time_scale=time_scale, kv_blocks=kv_blocks,
                           max_model_len=max_model_len)
        agent = WorkerAgent(await connect(f"w{i}"), engine, WorkerSettings(id=f"w{i}", heartbeat_interval_s=heartbeat_s))
        await agent.start()
        agents.append(agent)
    client = Client(await connect("producer"), timeouts or Timeouts(admission=10, idle=20))
    stack = Stack(admitter, router, agents, client, buses, url)
    for _ in range(100):  # the router has seen every worker's first heartbeat
        if len(router.core.workers) == workers:
            break
        await asyncio.sleep(0.02)
    return stack


def start_worker(url: str, worker: str) -> subprocess.Popen:
    """A real ``natsched worker`` process (sim engine, real-time decode, 0.2 s heartbeats), for
    tests that kill one with SIGKILL; returns once it printed READY."""
    proc = subprocess.Popen([sys.executable, "-m", "natsched", "worker", "--nats-url", url, "--id", worker,
                             "--engine", "sim", "--time-scale", "1.0", "--heartbeat", "0.2", "--concurrency", "4"],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    for line in proc.stdout:  # bounded: the process prints READY or exits
        if line.startswith(READY_PREFIX):
            return proc
    raise RuntimeError(f"worker {worker} exited with {proc.wait()}")


def stop_workers(procs) -> None:
    """Kill what is still running of ``start_worker``'s processes and reap them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
