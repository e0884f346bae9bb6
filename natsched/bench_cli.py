"""``natsched bench ...``: benchmarks are commands, not timed tests (ARCHITECTURE.md, "Benchmarks").

Wiring (natsched/cli.py)::

    from natsched.bench_cli import add_bench_parser, cmd_bench
    add_bench_parser(sub)            # in build_parser(), ``sub`` = the subcommand action
    ...                              # and dispatch args.command == "bench" to cmd_bench(args)

``natsched bench routing --trace FILE [--workers N] [--policies LIST|all] [--speedup X |
--target-busy F] [--limit N] [--profile P] [--json OUT] [--plot OUT.png]`` replays the trace in the
discrete-event simulator for every chosen policy on identical arrivals, prints a table and
optionally writes JSON and a PNG (the PNG needs matplotlib: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from workers.profiles import DEFAULT_PROFILE, PROFILES


def _fail(message: str, code: int = 1) -> int:
    print(f"natsched: error: {message}", file=sys.stderr)
    return code


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction strictly between 0 and 1 (e.g. 0.8), got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` (with its ``routing`` subcommand) to the top-level subcommands."""
    bench = subparsers.add_parser("bench", help="run a benchmark in the discrete-event simulator",
                                  description="Benchmarks: print a table, write JSON (and a PNG plot).")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    rt = bsub.add_parser(
        "routing", help="every routing policy side by side on one trace",
        description="Replay a Mooncake JSONL trace through the shipped router and simulated engines, once per "
                    "policy, on identical arrivals; print a table (and write JSON / a PNG).",
    )
    rt.add_argument("--trace", required=True, type=Path, help="Mooncake JSONL trace (timestamp ms, input_length, "
                                                              "output_length, hash_ids of 512-token blocks)")
    rt.add_argument("--workers", type=_positive_int, default=8, help="simulated workers (default 8)")
    rt.add_argument("--policies", default="all",
                    help="comma-separated routing policies, or 'all' (default: every registered policy)")
    load = rt.add_mutually_exclusive_group()
    load.add_argument("--speedup", type=_positive_float, default=None,
                      help="compress arrival times by this factor (default 1)")
    load.add_argument("--target-busy", type=_fraction, default=None, metavar="F",
                      help="pick the speed-up at which least_loaded keeps workers busy this share of the time "
                           "(e.g. 0.8), then use it for every policy")
    rt.add_argument("--limit", type=_positive_int, default=None, help="keep only the first N requests")
    rt.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                    help=f"engine profile (default {DEFAULT_PROFILE})")
    rt.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    rt.add_argument("--plot", type=Path, default=None, metavar="OUT.png",
                    help="write a PNG (TTFT CDF, hit ratio vs ceiling); needs matplotlib")
    rt.add_argument("--jobs", type=_positive_int, default=2,
                    help="policies simulated in parallel processes (default 2; 1 = in this process)")
    rt.add_argument("--calib-limit", type=_positive_int, default=1000,
                    help="requests per calibration run of --target-busy (default 1000)")
    rt.add_argument("--hb-interval", type=_positive_float, default=1.0,
                    help="virtual seconds between worker heartbeats (default 1)")
    rt.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return bench


def cmd_bench(args) -> int:
    if getattr(args, "bench", None) == "routing":
        return _cmd_routing(args)
    return _fail(f"unknown benchmark {getattr(args, 'bench', None)!r}")


def _cmd_routing(args) -> int:
    from sim.bench_routing import RoutingBenchSettings, run_routing_benchmark
    from sim.errors import SimError
    from sim.plot import plot_routing, require_matplotlib

    try:
        if args.plot is not None:
            require_matplotlib()  # say so now, not after minutes of simulation
        settings = RoutingBenchSettings(
            trace=str(args.trace), workers=args.workers, policies=args.policies, speedup=args.speedup,
            target_busy=args.target_busy, limit=args.limit, profile=args.profile, jobs=args.jobs,
            calib_limit=args.calib_limit, hb_interval=args.hb_interval, progress=not args.no_progress,
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
                         report.ceiling_hit_ratio, title)
            print(f"wrote {args.plot}", file=sys.stderr)
    except OSError as exc:
        return _fail(f"cannot write output: {exc}")
    except SimError as exc:
        return _fail(str(exc))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m natsched.bench_cli routing ...``) until ``natsched bench`` is wired."""
    parser = argparse.ArgumentParser(prog="natsched")
    add_bench_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    try:
        return cmd_bench(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
