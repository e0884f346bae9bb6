"""``natsched bench server``: what natsched adds per request in front of a real ``vllm serve``.

The same request (token-id prompt, ``--max-tokens`` tokens with ``ignore_eos``) three ways,
one at a time, interleaved round-robin so drift in the server (or the shared machine) lands on
every path alike:

- ``direct`` — a streaming ``POST /v1/completions`` to the server with httpx, read to ``[DONE]``:
  what a client that called vLLM itself would see;
- ``engine`` — the agent's server engine alone (:class:`~natsched.workers.vllm_server.ServerEngine`:
  its HTTP client, SSE parsing and usage checks), no bus;
- ``natsched`` — the whole path: a producer on an embedded nats-server, an admitter, a router
  and the worker agent fronting the server, to the final reply.

Reported per path: end-to-end p50/p99 (ms). The server's own time varies far more than what
natsched adds (on a shared CPU, ±100 ms between two identical calls), so percentiles of
different calls cannot isolate the overhead; **natsched's overhead is therefore measured per
request, paired**: the request's end-to-end time minus the time the agent's HTTP call to the
server took for that very request (from the agent's first byte sent to the server's
``[DONE]``), split into *before* (the producer's publish, admission, routing, the hops over
the bus, the hand-off to the agent) and *after* (the final reply back to the producer). The
per-token relay to the producer happens while the agent reads the stream, so it falls inside
the HTTP span (a buffered NATS publish per chunk). Without ``--url`` the command starts a
``vllm serve`` of the tiny dummy-weights model (:mod:`natsched.hosting.vllm_serve`), which is what it measures on a
machine without a GPU; on a real deployment point it at a server (``--url``, ``--model``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from natsched.workers.vllm_server import ServerEngine, ServerSettings

PATHS = ("direct", "engine", "natsched")


def add_server_bench_parser(bsub) -> None:
    sp = bsub.add_parser("server", help="natsched's own cost per request in front of a real vllm serve",
                         description="Send the same requests to a vllm serve directly, through the agent's server "
                                     "engine, and through the whole natsched pipeline; print p50/p99 of each and "
                                     "the overheads. Without --url a tiny dummy-weights vllm serve is started.")
    add_server_flags(sp)
    sp.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    sp.set_defaults(handler=run_server_bench)


#: the server benchmark's own flags and their defaults (``bench pipeline --engine vllm-server`` takes them too)
SERVER_DEFAULTS = {"url": None, "model": None, "requests": 60, "warmup": 5, "prompt_tokens": 64, "max_tokens": 8}


def add_server_flags(p: argparse.ArgumentParser, note: str = "") -> None:
    """The server to measure and the requests to send (``note``: a suffix for every help text)."""
    d = SERVER_DEFAULTS
    p.add_argument("--url", default=None, help=f"a running server (default: start a tiny one){note}")
    p.add_argument("--model", default=None, help=f"the served model name (default: the server's first){note}")
    p.add_argument("--requests", type=int, default=d["requests"], help=f"requests per path (default 60){note}")
    p.add_argument("--warmup", type=int, default=d["warmup"],
                   help=f"unmeasured requests per path first (default 5){note}")
    p.add_argument("--prompt-tokens", type=int, default=d["prompt_tokens"],
                   help=f"prompt length in tokens (default 64){note}")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"],
                   help=f"output tokens per request (default 8){note}")


def run_server_bench(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except asyncio.CancelledError:  # SIGTERM: the vllm serve it started is stopped already
        print("bench server: stopped (SIGTERM)", file=sys.stderr)
        return 143


async def _main(args: argparse.Namespace) -> int:
    # SIGTERM cancels the run, so the finally below stops a vllm serve this bench started (the
    # default action would leave it running, orphaned, with its engine process)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    serve = None
    url = args.url
    try:
        if url is None:
            from natsched.bus.server import free_port
            from natsched.workers.tiny_model import write_tiny_model
            from natsched.hosting.vllm_serve import VllmServe

            path = write_tiny_model(Path(tempfile.mkdtemp(prefix="natsched-bench-")) / "tiny", tokenizer=True)
            serve = VllmServe(path, "tiny", port=free_port(), kv_port=free_port(), max_num_seqs=8).start()
            print("starting vllm serve (tiny model) ...", file=sys.stderr, flush=True)
            await asyncio.to_thread(serve.wait_ready, 600)
            url = serve.url
        report = await _measure(args, url, serve.kv_endpoint if serve else None)
    finally:
        if serve is not None:
            serve.stop()
    print(table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


async def _measure(args: argparse.Namespace, url: str, kv: str | None) -> dict[str, Any]:
    import httpx

    from natsched.admitter.service import AdmitterService
    from natsched.bus.connection import Bus
    from natsched.bus.server import EmbeddedServer, free_port
    from natsched.client.producer import Client, Timeouts, make_request
    from natsched.router.core import RouterSettings
    from natsched.router.service import RouterService, RouterServiceSettings
    from natsched.workers.agent import WorkerAgent, WorkerSettings
    from natsched.workers.engine import EngineRequest

    data_dir = tempfile.mkdtemp(prefix="natsched-bench-nats-")
    server = EmbeddedServer(port=free_port(), data_dir=data_dir).start()
    buses: list = []
    try:
        async def connect(name):
            b = await Bus.connect(server.url, name=name)
            buses.append(b)
            return b

        admin = await connect("bench")
        await admin.provision()
        admitter = AdmitterService(await connect("admitter"))
        await admitter.start()
        router = RouterService(await connect("router"), RouterServiceSettings(core=RouterSettings(policy="natsched")))
        await router.start()
        engine = _TimedEngine(ServerSettings(url=url, model=args.model, kv_events=kv, ignore_eos=True))
        await engine.discover()
        agent = WorkerAgent(await connect("w1"), engine, WorkerSettings(id="w1", model=engine.model, concurrency=8))
        await agent.start()
        probe = ServerEngine(ServerSettings(url=url, model=engine.model, ignore_eos=True))  # the engine path
        await probe.start()
        client = Client(await connect("producer"), Timeouts(admission=30, idle=120))
        while "w1" not in router.core.workers:
            await asyncio.sleep(0.05)
        http = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0))
        model, n_out = engine.model, args.max_tokens

        def prompt(i: int) -> list[int]:  # distinct prompts: no path is served from another's cache
            rng = random.Random(i)
            return [1] + [rng.randrange(3, 1000) for _ in range(args.prompt_tokens - 1)]

        async def direct(i: int) -> None:
            body = probe.request_body(EngineRequest(id=f"d{i}", prompt_tokens=0, hashes=[], max_tokens=n_out,
                                                    prompt_token_ids=prompt(i), model=model))
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        return
            raise RuntimeError("direct stream ended without [DONE]")

        async def via_engine(i: int) -> None:
            outs = [o async for o in probe.generate(EngineRequest(id=f"e{i}", prompt_tokens=0, hashes=[],
                                                                  max_tokens=n_out, prompt_token_ids=prompt(i)))]
            if outs[-1].error:
                raise RuntimeError(outs[-1].error)

        overhead: dict[str, list[float]] = {"total": [], "before": [], "after": []}

        async def via_natsched(i: int) -> bool:
            t0 = time.perf_counter()
            req = make_request("bench", prompt_token_ids=prompt(i), model=model, max_tokens=n_out)
            res = await client.submit(req)
            t1 = time.perf_counter()
            if res.output_tokens != n_out:
                raise RuntimeError(f"natsched path produced {res.output_tokens} tokens, not {n_out}")
            began, done = engine.spans.pop(req.id)
            sample.update(before=(began - t0) * 1000, after=(t1 - done) * 1000,
                          total=((t1 - t0) - (done - began)) * 1000)
            return True

        sample: dict[str, float] = {}

        runners = {"direct": direct, "engine": via_engine, "natsched": via_natsched}
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        total = args.warmup + args.requests
        for i in range(total):
            for k, p in enumerate(PATHS):  # round-robin, a fresh prompt for each
                t0 = time.perf_counter()
                paired = await runners[p](i * len(PATHS) + k + 10_000 * (i < args.warmup))
                if i >= args.warmup:
                    times[p].append((time.perf_counter() - t0) * 1000)
                    if paired:
                        for key, value in sample.items():
                            overhead[key].append(value)
        await http.aclose()
        await probe.stop()
        await agent.stop()
        return _report(times, overhead, url, model, args)
    finally:
        for b in buses:
            await b.close()
        server.stop()


class _TimedEngine(ServerEngine):
    """The agent's server engine, noting how long each request's HTTP call took (for the pairing)."""

    def __init__(self, settings: ServerSettings) -> None:
        super().__init__(settings)
        self.spans: dict[str, tuple[float, float]] = {}  # request id -> (HTTP call began, [DONE] read)

    async def generate(self, request):
        t0 = time.perf_counter()
        async for out in super().generate(request):
            if out.finished:
                self.spans[request.id] = (t0, time.perf_counter())
            yield out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def _stats(v: list[float]) -> dict[str, float]:
    return {"p50_ms": _pct(v, 50), "p99_ms": _pct(v, 99), "mean_ms": statistics.fmean(v), "n": len(v)}


def _report(times: dict[str, list[float]], overhead: dict[str, list[float]], url: str, model: str,
            args: argparse.Namespace) -> dict[str, Any]:
    return {"url": url, "model": model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "paths": {p: _stats(v) for p, v in times.items()},
            "natsched_overhead": {k: _stats(v) for k, v in overhead.items()}}


def table(r: dict[str, Any]) -> str:
    lines = [f"server {r['url']} model {r['model']}: {r['requests']} requests per path, "
             f"{r['prompt_tokens']} prompt tokens, {r['max_tokens']} output tokens, one at a time",
             f"{'end to end':<22} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}"]
    for p in PATHS:
        s = r["paths"][p]
        lines.append(f"{p:<22} {s['p50_ms']:>9.2f} {s['p99_ms']:>9.2f} {s['mean_ms']:>9.2f}")
    labels = {"total": "natsched overhead", "before": "  submit -> HTTP call", "after": "  [DONE] -> result"}
    for key, label in labels.items():
        o = r["natsched_overhead"][key]
        lines.append(f"{label:<22} {o['p50_ms']:>9.2f} {o['p99_ms']:>9.2f} {o['mean_ms']:>9.2f}")
    lines.append("(overhead per request: its end to end minus its own HTTP call to the server; before: publish, "
                 "admission, routing, hand-off to the agent; after: the final reply back to the producer)")
    return "\n".join(lines)
