"""``natsched bench pipeline``: the scheduler's own cost, on the real services and a real server.

Workers run the :class:`~natsched.workers.nullengine.NullEngine` (no compute), so what is measured is
admission + routing + the bus. The benchmark process publishes requests open-loop at a fixed
rate; each worker's final reply carries the moment its agent received the assignment (and the
admitter's and router's stamps), so the overhead ends where the issue puts it, at the worker,
and the generator needs nothing but the replies a producer gets anyway. (Earlier versions
watched ``work.>`` with a plain subscription: that copy leaves the server when the hand-off is
published, before it is stored and delivered, and cost the generator a decode per request.)

Reported, in the same run: overhead (publish -> assignment) p50/p99, sustained
admitted-and-routed requests per second, requests lost (published, acknowledged by JetStream,
but with no final reply after the drain), and as references the core NATS request/reply round
trip and the JetStream publish-with-ack round trip on this machine.

With ``floor`` a bare relay (:mod:`natsched.bench.relay`) stands where the admitter would: the
same harness then measures what two stored hops cost on this machine before anything is decided.

With ``sample_every_s`` the run also samples the memory of every process of the system and
the size of every stream (:mod:`natsched.bench.memory`), which is what a soak looks at.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from array import array
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

import orjson
from prometheus_client.parser import text_string_to_metric_families

from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.wire.schema import Reply, Request
from natsched.bus.server import DEFAULT_SYNC, free_port, free_ports
from natsched.stats import nearest_rank
from natsched.bench.memory import MemorySampler, memory_report, read_cpu_s
from natsched.hosting.supervisor import Supervisor, UpSettings


@dataclass
class PipelineRun:
    rate: float
    duration_s: float
    admitters: int = 1
    routers: int = 1
    workers: int = 2
    inline_routing: bool = False  # admitters route in-process (admitter --route); routers may be 0
    drain_s: float = 15.0
    sample_every_s: float | None = None  # sample memory and streams this often; None: not at all
    audit_max_bytes: int | None = None  # cap REQUESTS, DECISIONS, COMPLETIONS (a soak that reaches retention)
    floor: bool = False  # a bare relay instead of admitters and routers (natsched.bench.relay)
    credit: bool = True  # False: admitters --no-credit (every allow committed to the shared usage)
    sync: str = DEFAULT_SYNC  # the embedded server's JetStream sync_interval (natsched.bus.server.SYNC_CHOICES)
    partitions: int = 1  # partitioned admission (natsched up --partitions): ``admitters`` per partition


def bench_tenants(partitions: int) -> list[str]:
    """The tenants the load is spread over: ``bench`` alone, or with partitions one tenant per
    partition (the first ``bench-<k>-<j>`` that nats-server's partition() puts in partition k),
    so each partition's admitters get an equal share of the requests."""
    if partitions == 1:
        return ["bench"]
    from natsched.admitter.budget import partition_of

    out = []
    for k in range(partitions):
        out.append(next(f"bench-{k}-{j}" for j in range(10_000) if partition_of(f"bench-{k}-{j}", partitions) == k))
    return out


def _pct(values: list[float], q: float) -> float:
    found = nearest_rank(values, q)
    return float("nan") if found is None else found


async def reference_rtts(bus: Bus, samples: int = 300) -> tuple[float, float]:
    """(core request/reply p50 ms, JetStream publish-with-ack p50 ms), measured sequentially."""
    async def echo(data: bytes) -> bytes:
        return data

    sub = await bus.respond(S.BENCH_ECHO, echo)
    core = []
    for _ in range(samples):
        t = time.perf_counter()
        await bus.request(S.BENCH_ECHO, b"x", timeout=2)
        core.append((time.perf_counter() - t) * 1000)
    await sub.unsubscribe()
    js = []
    async with bus.scratch_stream(S.STREAM_BENCH, [S.BENCH_JS_ALL], max_age_s=60, max_bytes=64 << 20):
        for i in range(samples):
            t = time.perf_counter()
            await bus.jpublish_once("bench.js.ref", b"x" * 200)
            js.append((time.perf_counter() - t) * 1000)
    return statistics.median(core), statistics.median(js)


SLOW_MS = 100.0  # a second whose slowest hand-off took this long is listed in "slow_seconds"
#: the hand-off in three stages, from the timestamps an assignment carries: publish (the
#: request's ``created``) -> the admitter's commit (``admitted_at``) -> the router's decision
#: (``routed_at``) -> the worker's agent receiving it (``received_at``). One machine, one clock.
STAGES = ("admission", "routing", "delivery")
STAGE_SAMPLES = 100_000  # a uniform sample (reservoir) of that many requests: bounded memory in a soak


@dataclass
class _Tally:
    """The load generator's account of one run, bounded by what is in flight.

    A soak publishes hundreds of thousands of requests: only requests still waiting for their
    assignment or final reply are kept, and each assignment leaves one 8-byte overhead sample,
    so the generator's own memory stays flat too (it is one of the sampled processes).
    """

    awaiting_assignment: dict[str, float] = field(default_factory=dict)  # request id -> publish time (unix s)
    awaiting_final: set[str] = field(default_factory=set)
    overhead_ms: array = field(default_factory=lambda: array("d"))
    last_assigned: float = float("nan")
    overhead_second: array = field(default_factory=lambda: array("I"))  # publish second of each overhead sample
    t0: float = 0.0
    published: int = 0
    publish_failed: int = 0
    completed: int = 0
    rejected: int = 0
    finals: int = 0
    stage_cap: int = STAGE_SAMPLES
    stage_samples: list[tuple[float, float, float]] = field(default_factory=list)
    stage_seen: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def on_assigned(self, rid: str, now: float, stamps: tuple[float, float, float, float] | None = None) -> None:
        """``stamps``: (created, admitted_at, routed_at, received) wall-clock seconds."""
        sent = self.awaiting_assignment.pop(rid, None)
        if sent is not None:  # the first assignment only: a redelivery is no new hand-off
            ms = (now - sent) * 1000
            self.overhead_ms.append(ms)
            self.last_assigned = now
            self.overhead_second.append(max(0, int(sent - self.t0)))  # when it was published: a stall shows where it began
            if stamps is not None:
                self.on_stages(stamps)

    def by_second(self) -> dict[int, dict[str, float]]:
        """Overhead per publish second (n, p50, p99, max): warm-up, stalls and drift over a run."""
        groups: dict[int, list[float]] = {}
        for second, ms in zip(self.overhead_second, self.overhead_ms):
            groups.setdefault(second, []).append(ms)
        return {k: {"n": len(v), "p50_ms": _pct(v, 0.5), "p99_ms": _pct(v, 0.99), "max_ms": max(v)}
                for k, v in sorted(groups.items())}

    def on_stages(self, stamps: tuple[float, float, float, float]) -> None:
        """Keep a uniform sample of the stage durations (Algorithm R)."""
        created, admitted, routed, received = stamps
        sample = ((admitted - created) * 1000, (routed - admitted) * 1000, (received - routed) * 1000)
        self.stage_seen += 1
        if len(self.stage_samples) < self.stage_cap:
            self.stage_samples.append(sample)
            return
        j = self.rng.randrange(self.stage_seen)
        if j < self.stage_cap:
            self.stage_samples[j] = sample

    def stages_ms(self) -> dict[str, dict[str, float]]:
        return {name: {"p50": _pct(column, 0.5), "p99": _pct(column, 0.99)}
                for name, column in zip(STAGES, map(list, zip(*self.stage_samples)))}

    def on_final(self, rid: str, kind: str, worker: str | None) -> None:
        if rid not in self.awaiting_final:
            return
        self.awaiting_final.discard(rid)
        if worker is None:  # rejected, or failed in routing: never assigned. From a worker, the
            self.awaiting_assignment.pop(rid, None)  # assignment may still be in this process's queue
        self.finals += 1
        self.completed += kind == "result"
        self.rejected += kind == "error"

    def on_ack(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            self.publish_failed += 1
        else:
            self.published += 1


def admitter_batches(ports: list[int]) -> dict[str, float]:
    """The admitters' batch histograms summed (``natsched_admission_batch_requests``,
    ``_handoff_seconds``): how many requests each decision batch held and how long its
    hand-offs took to be stored. Read from their Prometheus endpoints."""
    want = {"natsched_admission_batch_requests_count": "batches", "natsched_admission_batch_requests_sum": "requests",
            "natsched_admission_handoff_seconds_count": "handoffs", "natsched_admission_handoff_seconds_sum": "handoff_s"}
    out = dict.fromkeys(want.values(), 0.0)
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in want:
                    out[want[sample.name]] += sample.value
    return out


def _batch_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in after}
    return {"batches": int(d["batches"]), "mean_requests": d["requests"] / d["batches"] if d["batches"] else 0.0,
            "handoff_mean_ms": 1000 * d["handoff_s"] / d["handoffs"] if d["handoffs"] else 0.0}


async def drive(url: str, run: PipelineRun, pids: dict[str, int] | None = None,
                admitter_ports: list[int] | None = None, references: bool = True) -> dict:
    """Publish the load, wait for the replies, measure; sample memory when ``pids`` and ``run.sample_every_s``;
    read the admitters' batch metrics when ``admitter_ports``; time the reference round trips
    afterwards unless not ``references`` (NaN then)."""
    bus = await Bus.connect(url, name="bench-pipeline")
    run_id = uuid.uuid4().hex[:12]
    reply_to = S.bench_reply(run_id)
    tally = _Tally()
    sampler: MemorySampler | None = None
    sampling: asyncio.Task | None = None

    async def on_reply(subject: str, data: bytes, headers: dict) -> None:
        reply = Reply.decode(data)
        if not reply.final:
            return
        if reply.received_at is not None:  # a worker had it: the hand-off ended at its receipt
            created = tally.awaiting_assignment.get(reply.request_id)
            stamps = None
            if created is not None and reply.admitted_at is not None and reply.routed_at is not None:
                stamps = (created, reply.admitted_at, reply.routed_at, reply.received_at)
            tally.on_assigned(reply.request_id, reply.received_at, stamps)
        tally.on_final(reply.request_id, reply.kind, reply.worker)

    try:
        await bus.subscribe(reply_to, on_reply)
        await bus.flush()
        total = int(run.rate * run.duration_s)
        pending: set[asyncio.Future] = set()
        if pids and run.sample_every_s:
            sampler = MemorySampler(pids, bus, run.sample_every_s, time.monotonic())
            sampling = asyncio.create_task(sampler.run(), name="memory-sampler")
        cpu0 = {name: read_cpu_s(pid) for name, pid in (pids or {}).items()}
        batches0 = await asyncio.to_thread(admitter_batches, admitter_ports) if admitter_ports else None
        tenants = bench_tenants(run.partitions)
        t0 = time.perf_counter()  # the pacing clock; the tally's is the wall clock the services stamp
        tally.t0 = time.time()
        for i in range(total):
            target = t0 + i / run.rate
            delay = target - time.perf_counter()
            if delay > 0.001:
                await asyncio.sleep(delay)
            rid = f"{run_id}-{i}"
            created = time.time()
            tenant = tenants[i % len(tenants)]
            req = Request(id=rid, tenant=tenant, cls=S.ONLINE, prompt="ping " * 8, max_tokens=1, reply=reply_to,
                          created=created)
            tally.awaiting_assignment[rid] = created
            tally.awaiting_final.add(rid)
            future = await bus.jpublish_pipelined(S.request(S.ONLINE, tenant), req.encode(),
                                                  headers={S.HDR_MSG_ID: rid, S.HDR_REPLY: reply_to})
            pending.add(future)
            future.add_done_callback(tally.on_ack)
            future.add_done_callback(pending.discard)
        await asyncio.gather(*pending, return_exceptions=True)
        deadline = time.perf_counter() + run.drain_s
        while tally.finals < tally.published and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        cpu = cpu_per_request(cpu0, pids or {}, tally.finals)
        batches = (_batch_summary(batches0, await asyncio.to_thread(admitter_batches, admitter_ports))
                   if batches0 is not None else None)
        memory = None
        if sampler is not None:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            await sampler.sample()  # after the drain: what an idle system still holds
            memory = memory_report(sampler.samples, run.duration_s, run.sample_every_s)
        assigned = len(tally.overhead_ms)
        overhead = list(tally.overhead_ms)
        span = tally.last_assigned - tally.t0
        nats_rtt, js_rtt = await reference_rtts(bus) if references else (float("nan"), float("nan"))
        result = {
            "rate": run.rate, "duration_s": run.duration_s, "admitters": run.admitters, "routers": run.routers,
            "partitions": run.partitions,
            "inline_routing": run.inline_routing, "floor": run.floor, "credit": run.credit, "sync": run.sync,
            "requests": total, "published": tally.published, "assigned": assigned,
            "completed": tally.completed, "rejected": tally.rejected,
            "lost": total - tally.finals,
            "overhead_p50_ms": _pct(overhead, 0.5), "overhead_p99_ms": _pct(overhead, 0.99),
            "sustained_rps": assigned / span if span == span and span > 0 else 0.0,
            "nats_rtt_p50_ms": nats_rtt, "js_publish_p50_ms": js_rtt,
            "stages_ms": tally.stages_ms(),
        }
        if cpu:
            result["cpu_ms_per_request"] = cpu
        if batches is not None:
            result["admitter_batches"] = batches
        # second by second, and the seconds whose requests waited longest: where a run's tail comes from
        per_second = tally.by_second()
        result["per_second"] = {str(k): {name: round(v, 3) for name, v in row.items()} for k, row in per_second.items()}
        result["slow_seconds"] = {str(k): round(row["max_ms"], 1) for k, row in per_second.items()
                                  if row["max_ms"] >= SLOW_MS}
        if memory is not None:
            result["memory"] = memory
        return result
    finally:
        if sampling is not None and not sampling.done():
            sampling.cancel()
        await bus.close()


def cpu_per_request(before: dict[str, float | None], pids: dict[str, int], served: int) -> dict[str, float]:
    """CPU milliseconds each process spent per request served since ``before``, and their ``total``.

    Taken after the drain, so every request's whole path (admission, routing, the worker, the
    release) is in it; idle polling of the same seconds is too, which is fair: it is what the
    system costs. Empty when nothing was served or /proc cannot be read."""
    if served <= 0:
        return {}
    out = {}
    for name, pid in pids.items():
        now = read_cpu_s(pid)
        if now is not None and before.get(name) is not None:
            out[name] = (now - before[name]) * 1000 / served
    if out:
        out["total"] = sum(out.values())
    return out


def run_pipeline(run: PipelineRun, nats_url: str | None = None, driver: Callable[..., Awaitable[dict]] | None = None
                 ) -> dict:
    """Start a fresh system (embedded server unless ``nats_url``), drive it (with :func:`drive`
    unless ``driver``, called the same way), stop it."""
    data_dir = tempfile.mkdtemp(prefix="natsched-bench-")
    if run.floor:  # no admitter or router: the relay takes their place
        run = replace(run, admitters=0, routers=0, inline_routing=False)
    up = UpSettings(workers=run.workers, admitters=run.admitters, routers=run.routers, partitions=run.partitions,
                    inline_routing=run.inline_routing, credit=run.credit, engine="null",
                    nats_url=nats_url, port=free_port(), data_dir=data_dir, sync=run.sync, log_level="warning")
    sup = Supervisor(replace(up, metrics_port=free_ports(up.metered())))  # the admitters' batch metrics
    relay = None
    try:
        url = sup.start(quiet=True)
        asyncio.run(_set_quota(url, run.audit_max_bytes))
        pids = sup.pids()
        if run.floor:
            relay = start_relay(url, sup.worker_ids())
            pids["relay"] = relay.pid
        time.sleep(1.0)  # workers' first heartbeats reach the routers (inline ones too)
        pids["load generator"] = os.getpid()
        from natsched.hosting.runtime import run_loop  # uvloop, as the services run: the generator's own CPU is shared

        admitters = [port for name, port in sup.metrics_ports.items() if name.startswith("admitter")]
        return run_loop((driver or drive)(url, run, pids, admitters))
    finally:
        if relay is not None:
            relay.kill()
            relay.wait()
        sup.stop(quiet=True)
        shutil.rmtree(data_dir, ignore_errors=True)


def start_relay(url: str, workers: list[str], timeout_s: float = 30.0) -> subprocess.Popen:
    """``python -m natsched.bench.relay`` started and ready (its consumer bound), or RuntimeError."""
    proc = subprocess.Popen([sys.executable, "-m", "natsched.bench.relay", url, *workers],
                            stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the relay did not start within {timeout_s:.0f}s (exit {proc.returncode})")
    return proc


async def _set_quota(url: str, audit_max_bytes: int | None = None) -> None:
    bus = await Bus.connect(url, name="bench-setup")
    try:  # measure the scheduler, not a quota: a total nothing here can reach
        await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(10**12))
        if audit_max_bytes is not None:
            await _cap_audit_streams(bus, audit_max_bytes)
    finally:
        await bus.close()


async def _cap_audit_streams(bus: Bus, max_bytes: int) -> None:
    """Retention as an operator sets it (``natsched retention set``), small enough that a soak
    reaches it: then the server's memory must level off while old records are discarded."""
    from natsched.bus.provision import StreamLimits, default_limits

    audit = (S.STREAM_REQUESTS, S.STREAM_DECISIONS, S.STREAM_COMPLETIONS)
    await bus.set_retention({stream: StreamLimits(default_limits(stream).max_age_s, max_bytes) for stream in audit})


REFINE_STEPS = 2  # --find-max: halvings of the gap between the last rate that passed and the first that failed
P99_LIMIT_MS = 10.0


def find_max(base: PipelineRun, rates: list[float], nats_url: str | None, refine: int = REFINE_STEPS,
             run: Callable[[PipelineRun, str | None], dict] | None = None) -> tuple[dict | None, list[dict]]:
    """Ramp the rate until a run fails, then halve the gap between the last rate that passed and
    the first that failed ``refine`` times (rounded to 50/s): a coarse ramp alone can be off by
    half its step (500/s passing and 1,000/s failing said nothing of 750/s). The best run is the
    highest rate with p99 <= 10 ms and nothing lost; every run is returned, in the order run."""
    run = run or run_pipeline
    results: list[dict] = []

    def passes(rate: float) -> dict | None:
        res = run(replace(base, rate=rate, sample_every_s=None, audit_max_bytes=None), nats_url)
        results.append(res)
        print(_row(res), file=sys.stderr, flush=True)
        return res if res["lost"] == 0 and res["overhead_p99_ms"] <= P99_LIMIT_MS else None

    best, failed = None, None
    for rate in rates:
        res = passes(rate)
        if res is None:
            failed = rate
            break
        best = res
    low = best["rate"] if best else 0.0
    for _ in range(refine if failed is not None else 0):
        mid = round((low + failed) / 2 / 50) * 50
        if not low < mid < failed:
            break
        res = passes(mid)
        if res is None:
            failed = mid
        else:
            best, low = res, mid
    return best, results


HEADER = (f"{'rate':>7} {'adm':>3} {'rtr':>4} {'sent':>7} {'lost':>5} {'p50 ms':>8} {'p99 ms':>8} {'sustained/s':>12} "
          f"{'cpu ms/req':>11}")


def _row(r: dict) -> str:
    routers = f"{r['routers']}{'+i' if r.get('inline_routing') else ''}"  # +i: the admitters route inline
    admitters = r["admitters"]
    if r.get("partitions", 1) > 1:  # per partition x partitions
        admitters = f"{admitters}x{r['partitions']}"
    if r.get("floor"):
        admitters, routers = "-", "flr"  # the bare relay in their place
    return (f"{r['rate']:>7.0f} {admitters:>3} {routers:>4} {r['requests']:>7} {r['lost']:>5} "
            f"{r['overhead_p50_ms']:>8.2f} {r['overhead_p99_ms']:>8.2f} {r['sustained_rps']:>12.0f} "
            f"{r.get('cpu_ms_per_request', {}).get('total', float('nan')):>11.3f}")


def print_table(results: list[dict]) -> None:
    print(HEADER)
    for r in results:
        print(_row(r))
    r = results[-1]
    print(f"reference: core NATS request/reply p50 {r['nats_rtt_p50_ms']:.3f} ms, "
          f"JetStream publish+ack p50 {r['js_publish_p50_ms']:.3f} ms")
    stages = r.get("stages_ms")
    if stages:
        print("stages p50/p99 ms: " + ", ".join(f"{name} {v['p50']:.2f}/{v['p99']:.2f}" for name, v in stages.items())
              + "  (publish -> admission commit -> routing decision -> the worker received it)")
    per_second = r.get("per_second")
    if per_second:  # a long run would make a long line: the first 30 seconds and the worst one
        shown = list(per_second.items())[:30]
        worst = max(per_second.items(), key=lambda kv: kv[1]["p99_ms"])
        print("p99 ms by publish second: " + " ".join(f"{row['p99_ms']:.1f}" for _, row in shown)
              + (" ..." if len(per_second) > len(shown) else "") + f"  (worst: second {worst[0]}, "
              f"p99 {worst[1]['p99_ms']:.1f}, max {worst[1]['max_ms']:.1f})")
    batches = r.get("admitter_batches")
    if batches and batches["batches"]:
        print(f"admitter batches: {batches['batches']:,}, {batches['mean_requests']:.2f} requests each, "
              f"hand-off wait {batches['handoff_mean_ms']:.2f} ms on average  (the acks of a batch's "
              f"reservations and hand-offs)")
    cpu = r.get("cpu_ms_per_request")
    if cpu:
        print("CPU ms per request: " + ", ".join(f"{name} {ms:.3f}" for name, ms in cpu.items()))
