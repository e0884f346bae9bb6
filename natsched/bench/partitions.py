"""``natsched bench partitions``: how fast the real admitter processes decide, at P = 1, 2, ...

Admission alone, as separate ``natsched admitter`` processes on a fresh embedded server: no
router, no worker. The load generator publishes ``--requests`` requests as fast as the server
acks them, spread over one tenant per partition (:func:`natsched.bench.pipeline.bench_tenants`),
under a total nothing reaches (every request is allowed: a reservation record, a hand-off to
ADMITTED and a decision record each). The admitters are ready (consumers bound, the first plan
applied) and then stopped (SIGSTOP) while the requests are stored, so the publishing rate does
not bound the result; it reports decisions per second from their SIGCONT to the last decision
stored, and each process's CPU per decision. The same harness at P = 1 and
P = 2 is the comparison: with one key every replica's commit serialises there; with a partition
each, the keys commit in parallel — as far as the machine's cores let them (docs/fleet.md).
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import orjson

from natsched.bench.memory import read_cpu_s
from natsched.bench.pipeline import bench_tenants, cpu_per_request
from natsched.bus.connection import Bus
from natsched.bus.server import EmbeddedServer, free_port
from natsched.hosting.runtime import READY_PREFIX
from natsched.wire import subjects as S
from natsched.wire.schema import Request


def _start_admitter(url: str, name: str, partition: int, partitions: int, timeout_s: float = 60.0) -> subprocess.Popen:
    part = ["--partition", str(partition), "--partitions", str(partitions)] if partitions > 1 else []
    proc = subprocess.Popen([sys.executable, "-m", "natsched", "--log-level", "warning", "admitter", "--nats-url",
                             url, "--name", name, *part], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if line.startswith(READY_PREFIX):
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    raise RuntimeError(f"admitter {name} did not start within {timeout_s:.0f}s (exit {proc.returncode})")


async def _drive(url: str, requests: int, partitions: int, pids: dict[str, int],
                 admitters: list[subprocess.Popen]) -> dict:
    bus = await Bus.connect(url, name="bench-admission")
    try:
        tenants = bench_tenants(partitions)
        base = await bus.stream_last_seq(S.STREAM_DECISIONS)
        for proc in admitters:
            proc.send_signal(signal.SIGSTOP)
        publish_started = time.monotonic()
        pending = []
        for i in range(requests):
            tenant = tenants[i % len(tenants)]
            req = Request(id=f"adm-{i}", tenant=tenant, cls=S.ONLINE, prompt="ping " * 8, max_tokens=1)
            pending.append(await bus.jpublish_pipelined(S.request(S.ONLINE, tenant), req.encode(),
                                                        headers={S.HDR_MSG_ID: req.id}))
            if len(pending) >= 512:  # a window of publishes in flight, as the pipeline's generator
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
        published = time.monotonic() - publish_started
        cpu0 = {name: read_cpu_s(pid) for name, pid in pids.items()}
        started = time.monotonic()
        for proc in admitters:
            proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 120
        decided = 0
        while time.monotonic() < deadline:
            decided = await bus.stream_last_seq(S.STREAM_DECISIONS) - base
            if decided >= requests:
                break
            await asyncio.sleep(0.02)
        wall = time.monotonic() - started
        cpu = cpu_per_request(cpu0, pids, decided)
    finally:
        await bus.close()
    return {"partitions": partitions, "requests": requests, "decided": decided, "publish_s": round(published, 2),
            "seconds": round(wall, 2), "decisions_per_s": round(decided / wall) if wall > 0 else 0,
            "cpu_ms_per_decision": {k: round(v, 3) for k, v in cpu.items()}}


def run_admission(partitions: int, requests: int) -> dict:
    """One fresh server and ``partitions`` admitter processes (one per partition), driven once."""
    data_dir = tempfile.mkdtemp(prefix="natsched-bench-")
    server = EmbeddedServer(port=free_port(), data_dir=data_dir, sync="interval").start()
    procs: list[subprocess.Popen] = []
    try:
        async def setup() -> None:
            bus = await Bus.connect(server.url, name="bench-setup")
            try:
                await bus.provision()
                await bus.set_partitions(partitions)
                await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(10**12))
            finally:
                await bus.close()

        asyncio.run(setup())
        pids = {"nats-server": server.proc.pid}
        for k in range(partitions):
            name = "admitter" if partitions == 1 else f"admitter-p{k}"
            procs.append(_start_admitter(server.url, name, k, partitions))
            pids[name] = procs[-1].pid
        pids["load generator"] = os.getpid()
        return asyncio.run(_drive(server.url, requests, partitions, pids, procs))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)  # (stopped if the drive failed half-way)
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def print_table(rows: list[dict]) -> None:
    print(f"{'partitions':>10} {'requests':>8} {'decided':>8} {'publish s':>9} {'seconds':>8} {'decisions/s':>12} "
          f"{'cpu ms/dec':>11}  per process")
    for r in rows:
        cpu = r["cpu_ms_per_decision"]
        rest = ", ".join(f"{k} {v:.3f}" for k, v in cpu.items() if k != "total")
        print(f"{r['partitions']:>10} {r['requests']:>8} {r['decided']:>8} {r['publish_s']:>9.2f} {r['seconds']:>8.2f} "
              f"{r['decisions_per_s']:>12} {cpu.get('total', float('nan')):>11.3f}  {rest}")
