"""``natsched bench pipeline``: the scheduler's own cost, on the real services and a real server.

Workers run the :class:`~workers.nullengine.NullEngine` (no compute), so what is measured is
admission + routing + the bus. The benchmark process publishes requests open-loop at a fixed
rate and watches ``work.>`` with a plain subscription: the moment an assignment is published
to a worker's subject is the moment that worker is handed it.

Reported, in the same run: overhead (publish -> assignment) p50/p99, sustained
admitted-and-routed requests per second, requests lost (published, acknowledged by JetStream,
but with no final reply after the drain), and as references the core NATS request/reply round
trip and the JetStream publish-with-ack round trip on this machine.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import orjson

from bus import subjects as S
from bus.connection import Bus
from bus.schema import Assignment, Reply, Request
from bus.server import free_port
from natsched.supervisor import Supervisor, UpSettings


@dataclass
class PipelineRun:
    rate: float
    duration_s: float
    admitters: int = 1
    routers: int = 1
    workers: int = 2
    drain_s: float = 15.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def reference_rtts(bus: Bus, samples: int = 300) -> tuple[float, float]:
    """(core request/reply p50 ms, JetStream publish-with-ack p50 ms), measured sequentially."""
    async def respond(msg) -> None:
        await msg.respond(msg.data)

    sub = await bus.nc.subscribe(S.BENCH_ECHO, cb=respond)
    core = []
    for _ in range(samples):
        t = time.perf_counter()
        await bus.request(S.BENCH_ECHO, b"x", timeout=2)
        core.append((time.perf_counter() - t) * 1000)
    await sub.unsubscribe()
    from nats.js import api  # bus/ owns nats; this benchmark is part of the bus-facing CLI

    await bus.js.add_stream(api.StreamConfig(name=S.STREAM_BENCH, subjects=[S.BENCH_JS_ALL],
                                             storage=api.StorageType.MEMORY, max_age=60, max_bytes=64 << 20))
    js = []
    try:
        for i in range(samples):
            t = time.perf_counter()
            await bus.js.publish("bench.js.ref", b"x" * 200)
            js.append((time.perf_counter() - t) * 1000)
    finally:
        await bus.js.delete_stream(S.STREAM_BENCH)
    return statistics.median(core), statistics.median(js)


async def drive(url: str, run: PipelineRun) -> dict:
    bus = await Bus.connect(url, name="bench-pipeline")
    run_id = uuid.uuid4().hex[:12]
    reply_to = S.bench_reply(run_id)
    sent: dict[str, float] = {}
    assigned: dict[str, float] = {}
    finals: dict[str, str] = {}

    async def on_work(subject: str, data: bytes, headers: dict) -> None:
        rid = Assignment.decode(data).request.id
        if rid in sent and rid not in assigned:
            assigned[rid] = time.perf_counter()

    async def on_reply(subject: str, data: bytes, headers: dict) -> None:
        reply = Reply.decode(data)
        if reply.final:
            finals[reply.request_id] = reply.kind

    try:
        await bus.subscribe(S.WORK_ALL, on_work)
        await bus.subscribe(reply_to, on_reply)
        await bus.nc.flush()
        total = int(run.rate * run.duration_s)
        futures = []
        t0 = time.perf_counter()
        for i in range(total):
            target = t0 + i / run.rate
            delay = target - time.perf_counter()
            if delay > 0.001:
                await asyncio.sleep(delay)
            rid = f"{run_id}-{i}"
            req = Request(id=rid, tenant="bench", cls=S.ONLINE, prompt="ping " * 8, max_tokens=1, reply=reply_to,
                          created=time.time())
            sent[rid] = time.perf_counter()
            futures.append(await bus.js.publish_async(S.request(S.ONLINE, "bench"), req.encode(),
                                                      headers={S.HDR_MSG_ID: rid, S.HDR_REPLY: reply_to}))
        acks = await asyncio.gather(*futures, return_exceptions=True)
        published = sum(1 for a in acks if not isinstance(a, BaseException))
        deadline = time.perf_counter() + run.drain_s
        while len(finals) < published and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        overhead = [(assigned[r] - sent[r]) * 1000 for r in assigned]
        span = (max(assigned.values()) - t0) if assigned else float("nan")
        nats_rtt, js_rtt = await reference_rtts(bus)
        return {
            "rate": run.rate, "duration_s": run.duration_s, "admitters": run.admitters, "routers": run.routers,
            "requests": total, "published": published, "assigned": len(assigned),
            "completed": sum(1 for k in finals.values() if k == "result"),
            "rejected": sum(1 for k in finals.values() if k == "error"),
            "lost": total - len(finals),
            "overhead_p50_ms": _pct(overhead, 0.5), "overhead_p99_ms": _pct(overhead, 0.99),
            "sustained_rps": len(assigned) / span if span == span and span > 0 else 0.0,
            "nats_rtt_p50_ms": nats_rtt, "js_publish_p50_ms": js_rtt,
        }
    finally:
        await bus.close()


def run_pipeline(run: PipelineRun, nats_url: str | None = None) -> dict:
    """Start a fresh system (embedded server unless ``nats_url``), drive it, stop it."""
    data_dir = tempfile.mkdtemp(prefix="natsched-bench-")
    sup = Supervisor(UpSettings(workers=run.workers, admitters=run.admitters, routers=run.routers, engine="null",
                                nats_url=nats_url, port=free_port(), data_dir=data_dir, log_level="warning"))
    try:
        url = sup.start(quiet=True)
        asyncio.run(_set_quota(url))
        time.sleep(1.0)  # workers' first heartbeats reach the routers
        return asyncio.run(drive(url, run))
    finally:
        sup.stop(quiet=True)
        shutil.rmtree(data_dir, ignore_errors=True)


async def _set_quota(url: str) -> None:
    bus = await Bus.connect(url, name="bench-setup")
    try:  # measure the scheduler, not a quota: a total nothing here can reach
        await bus.kv_put(S.BUCKET_QUOTAS, S.KEY_CLUSTER_TOTAL, orjson.dumps(10**12))
    finally:
        await bus.close()


def find_max(base: PipelineRun, rates: list[float], nats_url: str | None) -> tuple[dict | None, list[dict]]:
    """Ramp the rate; the best run is the highest rate with p99 <= 10 ms and nothing lost."""
    results, best = [], None
    for rate in rates:
        res = run_pipeline(PipelineRun(rate, base.duration_s, base.admitters, base.routers, base.workers), nats_url)
        results.append(res)
        print(_row(res), file=sys.stderr, flush=True)
        if res["lost"] == 0 and res["overhead_p99_ms"] <= 10.0:
            best = res
        else:
            break
    return best, results


HEADER = f"{'rate':>7} {'adm':>3} {'rtr':>3} {'sent':>7} {'lost':>5} {'p50 ms':>8} {'p99 ms':>8} {'sustained/s':>12}"


def _row(r: dict) -> str:
    return (f"{r['rate']:>7.0f} {r['admitters']:>3} {r['routers']:>3} {r['requests']:>7} {r['lost']:>5} "
            f"{r['overhead_p50_ms']:>8.2f} {r['overhead_p99_ms']:>8.2f} {r['sustained_rps']:>12.0f}")


def print_table(results: list[dict]) -> None:
    print(HEADER)
    for r in results:
        print(_row(r))
    r = results[-1]
    print(f"reference: core NATS request/reply p50 {r['nats_rtt_p50_ms']:.3f} ms, "
          f"JetStream publish+ack p50 {r['js_publish_p50_ms']:.3f} ms")
