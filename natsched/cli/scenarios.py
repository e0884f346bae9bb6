"""``natsched bench scenarios``: the command line of the scenario suite (natsched.sim.bench_scenarios)."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from natsched.cli.argtypes import positive_int
from natsched.sim.bench_scenarios import (
    CONTENDERS, OURS, QUICK_TRACE_LIMIT, ScenarioError, SuiteSettings, plot_suite, run_suite, scenario_table,
    summary_table, tail_table, to_json,
)


def add_scenarios_parser(bsub) -> None:
    """``natsched bench scenarios [FILE|DIR ...] [--only NAME] [--quick] [--sweep N] [--seeds N] [--json OUT]
    [--plot DIR] [--tails]``."""
    sp = bsub.add_parser(
        "scenarios", help="every contender (admission + routing) through the scenario suite",
        description="Run the scenario files (default: the built-in suite) with every contender on identical "
                    "arrivals and cluster events; print a table per scenario and a summary (natsched / best peer "
                    "with a paired verdict over the loads). File format: docs/scenarios.md.")
    sp.add_argument("paths", nargs="*", metavar="FILE|DIR", help="scenario files or directories (default: built-in)")
    sp.add_argument("--only", action="append", default=None, metavar="NAME",
                    help="run only this scenario (repeatable)")
    sp.add_argument("--quick", action="store_true",
                    help="shorter runs (each file's quick.scale of its duration; traces: the first "
                         f"{QUICK_TRACE_LIMIT} requests)")
    sp.add_argument("--sweep", type=positive_int, default=None, metavar="N",
                    help="loads per scenario (default: each file's sweep.points)")
    sp.add_argument("--seeds", type=positive_int, default=1, metavar="N",
                    help="traffic draws per load of a generated scenario (seeds seed .. seed+N-1); the verdict "
                         "is paired over loads x draws (default 1; a trace is not redrawn)")
    sp.add_argument("--contenders", default=None,
                    help=f"comma-separated contenders (default: the file's, else all: {', '.join(CONTENDERS)})")
    sp.add_argument("--jobs", type=positive_int, default=2, help="runs in parallel processes (default 2)")
    sp.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON here")
    sp.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write one PNG per scenario here")
    sp.add_argument("--tails", action="store_true",
                    help="also print where each contender's slowest requests spent their time (door, engine "
                         "queue, own prefill, missed cache; per model and class); the JSON always has it")
    sp.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    sp.set_defaults(handler=cmd_scenarios)


def cmd_scenarios(args) -> int:
    """Handler of ``natsched bench scenarios``."""
    from natsched.sim.errors import SimError
    from natsched.sim.scenario import find_scenarios, load_scenario

    try:
        if args.plot is not None:
            from natsched.sim.plot import require_matplotlib

            require_matplotlib()
        who = None
        if args.contenders:
            who = [c.strip() for c in args.contenders.split(",") if c.strip()]
            bad = [c for c in who if c not in CONTENDERS]
            if bad or OURS not in who:
                raise ScenarioError("--contenders", "", f"unknown {', '.join(bad)}; known: {', '.join(CONTENDERS)}"
                                    if bad else "must include natsched")
        scenarios = [load_scenario(p) for p in find_scenarios(args.paths)]
        settings = SuiteSettings(jobs=args.jobs, quick=args.quick, sweep=args.sweep, only=args.only,
                                 progress=not args.no_progress, contenders=who, seeds=args.seeds)
        report = run_suite(scenarios, settings)
    except SimError as exc:
        print(f"natsched: error: {exc}", file=sys.stderr)
        return 1
    for name, j in report["scenarios"].items():
        print(scenario_table(name, j))
        print()
        if args.tails:
            print(tail_table(name, j))
            print()
    print("summary (natsched against the best peer on each scenario's headline; verdict paired over the loads)")
    print(summary_table(report))
    print(f"wall {report['wall_s']:.1f} s" + (" (--quick)" if args.quick else ""))
    try:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_bytes(orjson.dumps(to_json(report), option=orjson.OPT_INDENT_2) + b"\n")
            print(f"wrote {args.json}", file=sys.stderr)
        if args.plot is not None:
            for p in plot_suite(report, args.plot):
                print(f"wrote {p}", file=sys.stderr)
    except OSError as exc:
        print(f"natsched: error: cannot write output: {exc}", file=sys.stderr)
        return 1
    return 0
