"""``natsched bench ...``: benchmarks are commands, not timed tests (ARCHITECTURE.md, "Benchmarks").

``natsched bench routing --trace FILE [--workers N] [--policies LIST|all] [--speedup X |
--target-busy F] [--limit N] [--profile P] [--json OUT] [--plot OUT.png]`` replays the trace in the
discrete-event simulator for every chosen policy on identical arrivals, prints a table and
optionally writes JSON and a PNG (the PNG needs matplotlib: the ``bench`` extra).

``natsched bench pipeline --rate R --duration S [--admitters K] [--routers K] [--find-max | --soak
[--max-rate M]] [--sample-every S] [--json OUT]`` runs the real services on a real nats-server with a
zero-compute engine and measures the scheduler's own cost (:mod:`natsched.bench.pipeline`), and
the memory of every process along the way (:mod:`natsched.bench.memory`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from natsched.sim.trace import MOONCAKE_TRACE

import orjson

from natsched.cli.argtypes import fraction, non_negative_int, positive_float, positive_int
from natsched.cli.options import fail as _fail
from natsched.workers.profiles import DEFAULT_PROFILE, PROFILES
from natsched.bus.server import DEFAULT_SYNC, SYNC_CHOICES

DEFAULT_RATE = 1000.0  # bench pipeline, requests per second
DEFAULT_DURATION_S = 10.0
SOAK_DURATION_S = 600.0  # issue #8: a soak is 10 minutes at half the maximum rate
RAMP_RATES = (250, 500, 1000, 1500, 2000, 2500, 3000, 4000, 5000, 6000, 8000)  # --find-max


def add_parsers(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` (with its ``routing`` subcommand) to the top-level subcommands."""
    bench = subparsers.add_parser("bench", help="run a benchmark in the discrete-event simulator",
                                  description="Benchmarks: print a table, write JSON (and a PNG plot).")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    rt = bsub.add_parser(
        "routing", help="every routing policy side by side on one trace",
        description="Replay a Mooncake JSONL trace through the shipped router and simulated engines, once per "
                    "policy, on identical arrivals; print a table (and write JSON / a PNG).",
    )
    rt.add_argument("--trace", type=Path, default=MOONCAKE_TRACE,
                    help="Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids of 512-token "
                         "blocks; default: the public Mooncake synthetic trace shipped with natsched)")
    rt.add_argument("--workers", type=positive_int, default=8, help="simulated workers (default 8)")
    rt.add_argument("--policies", default="all",
                    help="comma-separated routing policies, or 'all' (default: every registered policy)")
    load = rt.add_mutually_exclusive_group()
    load.add_argument("--speedup", type=positive_float, default=None,
                      help="compress arrival times by this factor (default 1)")
    load.add_argument("--target-busy", type=fraction, default=None, metavar="F",
                      help="pick the speed-up at which least_loaded keeps workers busy this share of the time "
                           "(e.g. 0.8), then use it for every policy")
    rt.add_argument("--limit", type=positive_int, default=None, help="keep only the first N requests")
    rt.add_argument("--profile", default=DEFAULT_PROFILE, type=_profiles,
                    help=f"engine profile (default {DEFAULT_PROFILE}), or several, comma-separated, that the "
                         f"workers take in turn (a mixed cluster); known: {', '.join(sorted(PROFILES))}")
    rt.add_argument("--kv-blocks", type=positive_int, default=None, metavar="N",
                    help="KV cache blocks per simulated worker (default: the profile's KV capacity / the trace's "
                         "block size): what more or less KV would do")
    rt.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    rt.add_argument("--plot", type=Path, default=None, metavar="OUT.png",
                    help="write a PNG (TTFT CDF, hit ratio vs ceiling); needs matplotlib")
    rt.add_argument("--jobs", type=positive_int, default=2,
                    help="policies simulated in parallel processes (default 2; 1 = in this process)")
    rt.add_argument("--calib-limit", type=positive_int, default=1000,
                    help="requests per run of --target-busy's first, coarse calibration (default 1000); "
                         "a longer trace is then calibrated on all its requests from that answer")
    rt.add_argument("--hb-interval", type=positive_float, default=1.0,
                    help="virtual seconds between worker heartbeats (default 1)")
    rt.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    rt.add_argument("--sweep", type=positive_int, default=1, metavar="N",
                    help="also run every policy at N speed-ups spread around the chosen one and report the "
                         "means and how often each target is met (one run's hit ratio moves by tenths of a "
                         "point with a 1%% change of load; default 1: off)")
    rt.add_argument("--sweep-span", type=fraction, default=0.05, metavar="F",
                    help="the sweep covers speed-up x [1-F, 1+F] (default 0.05)")
    rt.set_defaults(handler=_cmd_routing)
    _add_pipeline_parser(bsub)
    _add_health_parser(bsub)
    add_admission_parser(bsub)
    from natsched.bench.server import add_server_bench_parser

    add_server_bench_parser(bsub)
    from natsched.cli.scenarios import add_scenarios_parser

    add_scenarios_parser(bsub)
    ss = bsub.add_parser("shared-state", help="cost of the admitters' compare-and-swap on the shared usage",
                         description="Replicas commit one-token reservations by KV compare-and-swap as fast as "
                                     "they can; prints commits/s, lost races per commit and lost updates.")
    ss.add_argument("--replicas", default="1,2,3", help="replica counts to run, comma separated (default 1,2,3)")
    ss.add_argument("--seconds", type=positive_float, default=5.0, help="seconds per run (default 5)")
    ss.add_argument("--partitions", default="1", help="partition counts to run, comma separated: replica i "
                                                      "commits to partition i %% P's own bucket (default 1)")
    ss.add_argument("--nats-url", default=None, help="use this server instead of an embedded one")
    ss.add_argument("--json", type=Path, default=None, help="write the results as JSON")
    ss.set_defaults(handler=_cmd_shared)
    ad = bsub.add_parser("partitions", help="decisions/s of real admitter processes, one per partition",
                         description="Admission alone (no router, no worker): publish --requests requests over one "
                                     "tenant per partition and time the admitter processes deciding them, at each "
                                     "partition count.")
    ad.add_argument("--partitions", default="1,2", help="partition counts to run, comma separated (default 1,2)")
    ad.add_argument("--requests", type=positive_int, default=5000, help="requests per run (default 5000)")
    ad.add_argument("--json", type=Path, default=None, help="write the results as JSON")
    ad.set_defaults(handler=_cmd_admission)
    add_scale_parser(bsub)
    add_priority_parser(bsub)
    add_stored_parser(bsub)
    cd = bsub.add_parser("codec", help="decode-and-validate cost per message (the msgspec schema engine)",
                         description="Time decoding the same encoded messages with msgpack alone (no checks), "
                                     "with the schema engine (msgspec struct, dataclass, the message's checks) "
                                     "and with its msgspec struct alone, and encoding them; the engine must "
                                     "refuse every malformed input first.")
    cd.add_argument("--n", type=positive_int, default=20_000, help="decodes per round (default 20000)")
    cd.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    cd.set_defaults(handler=_cmd_codec)
    return bench


def _cmd_codec(args) -> int:
    from natsched.bench.codec import codec_table, refusals, run_codec_benchmark

    accepted = [name for name, refusal in refusals().items() if refusal is None]
    if accepted:
        return _fail(f"the schema engine accepts malformed input: {', '.join(accepted)}")
    rows = run_codec_benchmark(args.n)
    print(codec_table(rows))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
    return 0


def add_stored_parser(bsub) -> None:
    """``natsched bench stored`` (:mod:`natsched.bench.stored`)."""
    st = bsub.add_parser("stored", help="JetStream writes and wire messages per request, by stream and kind",
                         description="Run the real services (null-engine workers) on a short load and count, per "
                                     "completed request, the messages every stream stored (from the streams' "
                                     "sequence numbers) and every message on the wire by kind (a '>' "
                                     "subscription; background traffic of an idle window of the same length "
                                     "subtracted).")
    st.add_argument("--requests", type=positive_int, default=300, help="requests to publish (default 300)")
    st.add_argument("--rate", type=positive_float, default=100.0, help="requests per second (default 100)")
    st.add_argument("--admitters", type=positive_int, default=1, help="admitter replicas (default 1)")
    st.add_argument("--routers", type=non_negative_int, default=None,
                    help="router replicas (default 1; 0 with --inline-routing)")
    st.add_argument("--inline-routing", action="store_true", help="the admitters route what they admit")
    st.add_argument("--no-credit", action="store_true", help="admitters without credit blocks")
    st.add_argument("--workers", type=positive_int, default=2, help="null-engine workers (default 2)")
    st.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    st.set_defaults(handler=_cmd_stored)


def _cmd_stored(args) -> int:
    from natsched.bench.pipeline import PipelineRun
    from natsched.bench.stored import run_stored, stored_table

    routers = args.routers if args.routers is not None else (0 if args.inline_routing else 1)
    run = PipelineRun(rate=args.rate, duration_s=args.requests / args.rate, admitters=args.admitters,
                      routers=routers, workers=args.workers, inline_routing=args.inline_routing,
                      credit=not args.no_credit)
    res = run_stored(run)
    print(stored_table(res))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(res, option=orjson.OPT_INDENT_2) + b"\n")
    return 0 if res["lost"] == 0 else _fail(f"{res['lost']} requests lost")


def add_scale_parser(bsub) -> None:
    """``natsched bench scale`` (:mod:`natsched.sim.scale`)."""
    sc = bsub.add_parser("scale", help="partitioned admission: commits/s, conflicts, fairness as partitions grow",
                         description="Simulate P admission partitions (each with its own usage key and admitter "
                                     "replicas) under the hierarchical budget; print commits/s, efficiency, "
                                     "conflicts, decision latency, floors and over-admission for each P.")
    sc.add_argument("--partitions", default="1,2,4,8", help="partition counts, comma separated (default 1,2,4,8)")
    sc.add_argument("--replicas", type=positive_int, default=2, help="admitter replicas per partition (default 2)")
    sc.add_argument("--cores", type=positive_int, default=2, help="cores per JetStream server (default 2)")
    sc.add_argument("--duration", type=positive_float, default=8.0, help="simulated seconds per run (default 8)")
    sc.add_argument("--seed", type=int, default=1)
    sc.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    sc.set_defaults(handler=_cmd_scale)


def _cmd_scale(args) -> int:
    from natsched.sim.scale import ScaleBenchSettings, run_scale_benchmark, scale_table

    try:
        parts = tuple(int(x) for x in args.partitions.split(",") if x.strip())
        if not parts or min(parts) < 1:
            raise ValueError
    except ValueError:
        return _fail(f"--partitions must be positive integers, got {args.partitions!r}")
    if args.duration <= 1.0:
        return _fail("--duration must be longer than the 1 s warm-up")
    report = run_scale_benchmark(ScaleBenchSettings(partitions=parts, replicas=args.replicas, cores=args.cores,
                                                    duration_s=args.duration, seed=args.seed,
                                                    kill_coordinator_at=args.duration / 2), sys.stderr)
    print(scale_table(report))
    return _write_json(args.json, report)


def add_priority_parser(bsub) -> None:
    """``natsched bench priority`` (:mod:`natsched.sim.priority`)."""
    pr = bsub.add_parser("priority", help="online waits in a burst over a batch backlog: lending vs none",
                         description="Replay the same seeded online burst over a batch backlog through "
                                     "AdmitterCore with class limits and lending, the same limits without "
                                     "lending, and no class limits; print online waits, rejections, batch "
                                     "throughput and the loan (virtual time).")
    pr.add_argument("--burst", default="1.5,2,3",
                    help="online demand in the burst, as multiples of its own limit's capacity (default 1.5,2,3)")
    pr.add_argument("--lend-share", type=fraction, default=0.5, help="admission.lend_share (default 0.5)")
    pr.add_argument("--seed", type=int, default=1)
    pr.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    pr.set_defaults(handler=_cmd_priority)


def _cmd_priority(args) -> int:
    from dataclasses import asdict

    from natsched.sim.priority import PrioritySettings, priority_table, run_priority_benchmark

    try:
        bursts = tuple(float(x) for x in args.burst.split(",") if x.strip())
        if not bursts or min(bursts) <= 0:
            raise ValueError
    except ValueError:
        return _fail(f"--burst must be positive numbers, got {args.burst!r}")
    rows = run_priority_benchmark(PrioritySettings(lend_share=args.lend_share, seed=args.seed), bursts)
    print(priority_table(rows))
    return _write_json(args.json, [{k: v for k, v in asdict(r).items() if k != "waits"} for r in rows])


def _write_json(path: Path | None, report) -> int:
    """Write a benchmark's JSON report when ``--json`` asked for it: 0, or 1 with a message."""
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        except OSError as exc:
            return _fail(f"cannot write {path}: {exc.strerror or exc}")
        print(f"wrote {path}", file=sys.stderr)
    return 0


def add_admission_parser(bench_subparsers) -> argparse.ArgumentParser:
    """``natsched bench admission`` (:mod:`natsched.sim.bench_admission`)."""
    p = bench_subparsers.add_parser(
        "admission", help="natsched's admission policy vs a count-based FIFO on a generated overload",
        description="Generate an overload (tenants with floors, a mix of short and long requests), replay the same "
                    "arrivals through natsched's AdmitterCore and a count-based FIFO, and print a table "
                    "(and write JSON).",
    )
    p.add_argument("--workload", type=Path, default=None, metavar="FILE",
                   help="workload JSON (default: the built-in 3x overload of tenants a/b/c; format in "
                        "sim/admission_workload.py)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.set_defaults(handler=run_admission)
    return p


def _profiles(value: str) -> str:
    """``--profile``: one engine profile, or several comma-separated (a mixed cluster), all known."""
    names = [p.strip() for p in value.split(",") if p.strip()]
    unknown = [n for n in names if n not in PROFILES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown engine profile {', '.join(unknown) or repr(value)}; "
                                         f"known: {', '.join(sorted(PROFILES))}")
    return ",".join(names)


def _add_health_parser(bsub) -> None:
    hp = bsub.add_parser("health", help="how fast a slowed worker leaves online work and comes back",
                         description="Simulate the shipped router on a trace while one worker runs at a third of "
                                     "its speed for a minute; print when it went half-open and healthy again, "
                                     "its share of routed requests, and TTFT with and without the health rule.")
    hp.add_argument("--trace", type=Path, default=MOONCAKE_TRACE, help="Mooncake JSONL trace (default: the shipped one)")
    hp.add_argument("--workers", type=positive_int, default=8, help="simulated workers (default 8)")
    hp.add_argument("--speedup", type=positive_float, default=0.8, help="arrival speed-up (default 0.8)")
    hp.add_argument("--speed", type=positive_float, default=1 / 3, help="the slowed worker's speed (default 1/3)")
    hp.add_argument("--slow-at", type=positive_float, default=400.0, help="seconds after the first arrival (400)")
    hp.add_argument("--slow-for", type=positive_float, default=60.0, help="seconds slowed (default 60)")
    hp.add_argument("--worker", type=int, default=3, help="index of the worker slowed (default 3)")
    hp.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    hp.set_defaults(handler=_cmd_health)


def _cmd_health(args) -> int:
    from natsched.sim.bench_health import HealthBenchSettings, format_health, run_health_benchmark
    from natsched.sim.errors import SimError
    from natsched.sim.trace import load_mooncake

    try:
        settings = HealthBenchSettings(workers=args.workers, speedup=args.speedup, worker=args.worker,
                                       speed=args.speed, slow_at=args.slow_at, slow_for=args.slow_for)
        report = run_health_benchmark(load_mooncake(str(args.trace)), settings)
    except SimError as exc:
        return _fail(str(exc))
    print(format_health(report))
    return _write_json(args.json, report)


def _add_pipeline_parser(bsub) -> None:
    from natsched.bench.server import add_server_flags

    pp = bsub.add_parser("pipeline", help="the scheduler's own cost on real services (zero-compute engine)",
                         description="Start a fresh system (embedded nats-server, admitters, routers, null-engine "
                                     "workers), publish requests open-loop and measure publish -> assignment. "
                                     "Every --sample-every seconds the RSS of each process (nats-server, admitters, "
                                     "routers, offline runner, workers, this load generator) and the size of every "
                                     "stream are sampled; a memory table says whether each process stayed flat "
                                     "after warm-up. A soak: --soak (10 minutes at half the --find-max rate, "
                                     "measured first) or --soak --max-rate M (at M/2) or --soak --rate R (at R).")
    pp.add_argument("--rate", type=positive_float, default=None,
                    help=f"requests per second (default {DEFAULT_RATE:.0f}; with --soak: half the maximum)")
    pp.add_argument("--duration", type=positive_float, default=None,
                    help=f"seconds of load (default {DEFAULT_DURATION_S:.0f}; with --soak {SOAK_DURATION_S:.0f})")
    pp.add_argument("--admitters", type=positive_int, default=1, help="admitter replicas (default 1)")
    pp.add_argument("--routers", type=non_negative_int, default=None,
                    help="router replicas (default 1; 0 with --inline-routing)")
    pp.add_argument("--partitions", type=positive_int, default=1, metavar="P",
                    help="partitioned admission (natsched up --partitions): --admitters per partition, the load "
                         "spread over one tenant per partition (default 1)")
    pp.add_argument("--inline-routing", action="store_true",
                    help="the admitters route what they admit in their own process (natsched admitter --route)")
    pp.add_argument("--floor", action="store_true",
                    help="a bare relay (pull, send to a worker, ack; no quota, records or statuses) in place of "
                         "the admitters and routers: what the bus, the client and this machine cost before "
                         "anything is decided, measured by the same harness")
    pp.add_argument("--no-credit", action="store_true",
                    help="admitters without credit (natsched admitter --no-credit): every allow committed to the "
                         "shared usage before its request goes out, for comparison")
    pp.add_argument("--workers", type=positive_int, default=2, help="null-engine workers (default 2)")
    pp.add_argument("--sync", choices=SYNC_CHOICES, default=DEFAULT_SYNC,
                    help=f"the embedded server's JetStream sync_interval, as natsched up --sync (default "
                         f"{DEFAULT_SYNC}): run both to see what fsync-before-ack costs")
    mode = pp.add_mutually_exclusive_group()
    mode.add_argument("--find-max", action="store_true",
                      help="ramp the rate (250, 500, 1000, 1500, ...), halve the gap to the first rate that "
                           "fails twice, and report the highest with p99 <= 10 ms and nothing lost")
    mode.add_argument("--soak", action="store_true",
                      help=f"a soak: {SOAK_DURATION_S / 60:.0f} minutes (unless --duration) at --rate, or at half "
                           "of --max-rate, or else at half the rate --find-max measures first; the memory table "
                           "says whether every process stayed flat")
    pp.add_argument("--max-rate", type=positive_float, default=None, metavar="M",
                    help="with --soak: the known maximum rate (from --find-max); the soak runs at M/2")
    pp.add_argument("--sample-every", type=positive_float, default=10.0, metavar="S",
                    help="seconds between memory and stream-size samples (default 10)")
    pp.add_argument("--audit-max-mib", type=positive_int, default=None, metavar="N",
                    help="retention of REQUESTS, DECISIONS and COMPLETIONS (default 1 GiB each): small enough "
                         "that a soak reaches it, to show the server's memory levelling off")
    pp.add_argument("--nats-url", default=None, help="use this server instead of an embedded one")
    pp.add_argument("--json", type=Path, default=None, metavar="OUT",
                    help="write the results as JSON (with every memory sample under 'memory')")
    pp.add_argument("--engine", choices=PIPELINE_ENGINES, default="null",
                    help="null (default): zero-compute workers, the scheduler's own cost at a rate; vllm-server: "
                         "the agent's cost per request in front of a real vllm serve, against calling it directly "
                         "(runs natsched bench server: --url, --model, --requests, --warmup, --prompt-tokens, "
                         "--max-tokens; the rate, soak and replica flags do not apply)")
    add_server_flags(pp, note=" (--engine vllm-server)")
    pp.set_defaults(handler=_cmd_pipeline)


#: bench pipeline's engines; vllm-server is ``bench server`` (natsched.bench.server)
PIPELINE_ENGINES = ("null", "vllm-server")
#: pipeline flags with no meaning in front of a real server (all default to None or False)
PIPELINE_ONLY = ("rate", "duration", "find_max", "soak", "max_rate", "floor", "inline_routing", "routers",
                 "no_credit", "audit_max_mib", "nats_url")


def _pipeline_on_servers(args) -> int:
    """``bench pipeline --engine vllm-server``: what the issue asks of it (the agent's overhead per
    request in front of a real server, p50/p99, against calling the server directly) is what
    ``bench server`` measures; an open-loop rate through real servers would measure the servers."""
    from natsched.bench.server import run_server_bench

    given = [n for n in PIPELINE_ONLY if getattr(args, n) not in (None, False)]
    if given:
        return _fail(f"--engine vllm-server runs natsched bench server, which takes none of "
                     f"{', '.join('--' + n.replace('_', '-') for n in given)}")
    print("bench pipeline --engine vllm-server: running natsched bench server (the same requests to the server "
          "directly, through the agent's engine and through the whole pipeline, one at a time)",
          file=sys.stderr, flush=True)
    return run_server_bench(args)


def cmd_bench(args) -> int:
    """Run the benchmark the parsed flags chose (each benchmark's parser binds its handler)."""
    return args.handler(args)


def run_admission(args) -> int:
    """``natsched bench admission``: 0 on success, 1 with a message on bad input."""
    from natsched.sim.admission_workload import AdmissionWorkload
    from natsched.sim.bench_admission import run_admission_benchmark
    from natsched.sim.errors import SimError

    try:
        w = AdmissionWorkload.load(args.workload)
        stream = None if getattr(args, "no_progress", False) else sys.stderr
        if stream is not None:
            print(f"admission benchmark: {w.source}", file=stream, flush=True)
        report = run_admission_benchmark(w, stream)
    except SimError as exc:
        return _fail(str(exc))
    print(report.table())
    if args.json is not None:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
        except OSError as exc:
            return _fail(f"cannot write {args.json}: {exc.strerror or exc}")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _cmd_routing(args) -> int:
    from natsched.sim.bench_routing import RoutingBenchSettings, run_routing_benchmark
    from natsched.sim.errors import SimError
    from natsched.sim.plot import plot_routing, require_matplotlib

    try:
        if args.plot is not None:
            require_matplotlib()  # say so now, not after minutes of simulation
        settings = RoutingBenchSettings(
            trace=str(args.trace), workers=args.workers, policies=args.policies, speedup=args.speedup,
            target_busy=args.target_busy, limit=args.limit, profile=args.profile, jobs=args.jobs,
            calib_limit=args.calib_limit, hb_interval=args.hb_interval, progress=not args.no_progress,
            sweep=args.sweep, sweep_span=args.sweep_span, kv_blocks=args.kv_blocks,
        )
        report = run_routing_benchmark(settings)
    except SimError as exc:
        return _fail(str(exc))
    print(report.table())
    try:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
            print(f"wrote {args.json}", file=sys.stderr)
        if args.plot is not None:
            title = (f"{Path(report.trace).name}: {report.requests} requests, {report.workers} workers, "
                     f"speed-up {report.speedup:.3g}")
            plot_routing(args.plot, report.ttfts, {n: m["hit_ratio"] for n, m in report.policies.items()},
                         report.ceiling_hit_ratio, title, pooled=report.pooled_hit_ratio)
            print(f"wrote {args.plot}", file=sys.stderr)
    except OSError as exc:
        return _fail(f"cannot write output: {exc}")
    except SimError as exc:
        return _fail(str(exc))
    return 0


def _cmd_shared(args) -> int:
    from natsched.bench.shared import print_table, run_shared_state

    try:
        replicas = [int(x) for x in args.replicas.split(",") if x.strip()]
        partitions = [int(x) for x in args.partitions.split(",") if x.strip()]
        if not replicas or min(replicas) < 1 or not partitions or min(partitions) < 1:
            raise ValueError
    except ValueError:
        return _fail(f"--replicas and --partitions must be positive integers, got {args.replicas!r}, "
                     f"{args.partitions!r}")
    rows = run_shared_state(replicas, args.seconds, args.nats_url, partitions)
    print_table(rows)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
    return 0


def _cmd_admission(args) -> int:
    from natsched.bench.partitions import print_table, run_admission

    try:
        partitions = [int(x) for x in args.partitions.split(",") if x.strip()]
        if not partitions or min(partitions) < 1:
            raise ValueError
    except ValueError:
        return _fail(f"--partitions must be positive integers, got {args.partitions!r}")
    rows = [run_admission(p, args.requests) for p in partitions]
    print_table(rows)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
    return 0


def _soak_rate(args, base) -> float | None:
    """The soak's rate: --rate, else half of --max-rate, else half of what a --find-max ramp measures now."""
    from dataclasses import replace

    from natsched.bench.pipeline import find_max

    if args.rate is not None:
        return args.rate
    if args.max_rate is not None:
        return args.max_rate / 2
    print("soak: measuring the maximum rate first (--max-rate M skips this)", file=sys.stderr, flush=True)
    ramp = replace(base, rate=0.0, duration_s=DEFAULT_DURATION_S, sample_every_s=None, audit_max_bytes=None)
    best, _ = find_max(ramp, list(RAMP_RATES), args.nats_url)
    return best["rate"] / 2 if best else None


def _cmd_pipeline(args) -> int:
    from natsched.errors import NatschedError
    from natsched.bench.memory import print_memory, soak_summary
    from natsched.bench.pipeline import PipelineRun, find_max, print_table, run_pipeline
    from natsched.bench.server import SERVER_DEFAULTS

    if args.engine == "vllm-server":
        return _pipeline_on_servers(args)
    server_only = [n for n, default in SERVER_DEFAULTS.items() if getattr(args, n) != default]
    if server_only:
        return _fail(f"{', '.join('--' + n.replace('_', '-') for n in server_only)} "
                     f"{'goes' if len(server_only) == 1 else 'go'} with --engine vllm-server")

    if args.max_rate is not None and not args.soak:
        return _fail("--max-rate goes with --soak (the soak runs at half of it)")
    if args.max_rate is not None and args.rate is not None:
        return _fail("give the soak's --rate or the --max-rate it halves, not both")
    duration = args.duration or (SOAK_DURATION_S if args.soak else DEFAULT_DURATION_S)
    from natsched.hosting.supervisor import router_count

    if args.floor and (args.inline_routing or args.routers is not None or args.admitters != 1 or args.no_credit):
        return _fail("--floor puts a bare relay in place of the admitters and routers: "
                     "leave out --admitters, --routers, --inline-routing and --no-credit")
    try:
        routers = 0 if args.floor else router_count(args.routers, args.inline_routing)
    except ValueError as exc:
        return _fail(str(exc))
    base = PipelineRun(args.rate or DEFAULT_RATE, duration, args.admitters, routers, args.workers,
                       inline_routing=args.inline_routing, floor=args.floor, credit=not args.no_credit,
                       sync=args.sync, partitions=args.partitions,
                       sample_every_s=args.sample_every,
                       audit_max_bytes=args.audit_max_mib * 2**20 if args.audit_max_mib else None)
    try:
        if args.find_max:
            best, results = find_max(base, list(RAMP_RATES), args.nats_url)
            out = {"find_max": True, "best": best, "runs": results}
        else:
            if args.soak:
                base.rate = _soak_rate(args, base)
                if base.rate is None:
                    return _fail("no rate met p99 <= 10 ms with nothing lost, so there is no maximum to halve: "
                                 "pass the soak's --rate")
                print(f"soak: {base.duration_s:.0f} s at {base.rate:.0f}/s", file=sys.stderr, flush=True)
            results = [run_pipeline(base, args.nats_url)]
            out = results[0]
    except NatschedError as exc:
        return _fail(str(exc))
    print_table(sorted(results, key=lambda r: r["rate"]))  # (--find-max's refinement runs come last)
    if args.find_max:
        print(f"highest rate with p99 <= 10 ms and nothing lost: {best['rate']:.0f}/s" if best else
              "no rate met p99 <= 10 ms with nothing lost")
    elif "memory" in out:
        print_memory(out["memory"])
        if args.soak:
            print(soak_summary(out["memory"], out["lost"]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
