"""``natsched chaos``: kill parts of a local cluster mid-run and count what was lost (:mod:`natsched.bench.chaos`)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from natsched.cli.argtypes import positive_float, positive_int
from natsched.cli.options import fail


def add_parsers(sub) -> None:
    ch = sub.add_parser("chaos", help="kill parts of a local cluster mid-run; count lost, duplicated, leaked",
                        description="Start a 3-node JetStream cluster, 2 admitters, 2 routers and 3 sim workers as "
                                    "processes, send requests at a steady rate, SIGKILL and restart a worker, an "
                                    "admitter, a router and a NATS node at seeded random moments, and report "
                                    "lost / duplicated requests, the lease reclaim time and leaked runtime tokens.")
    ch.add_argument("--requests", type=positive_int, default=2000, help="requests to send (default 2000)")
    ch.add_argument("--rate", type=positive_float, default=50.0, help="requests per second (default 50)")
    ch.add_argument("--seed", type=int, default=1, help="seed of the kill schedule (default 1)")
    ch.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report as JSON here")
    ch.add_argument("--finish-timeout", type=positive_float, default=90.0,
                    help="seconds after the last send to wait for every outcome (default 90)")
    ch.add_argument("--inline-routing", action="store_true",
                    help="the admitters route in their own process (natsched admitter --route) and no router runs: "
                         "the admitter kill then also kills a router")
    ch.add_argument("--disconnects", type=int, default=0, metavar="N",
                    help="also N clients that leave a long stream after its first chunk and N that leave while "
                         "queued or routed; reports the tokens generated for them (natsched.bench.abandon)")
    ch.add_argument("--data-dir", type=Path, default=None,
                    help="nodes' data and the processes' logs, kept (default: a temporary dir, deleted)")
    # the names are natsched.bench.chaos.SCENARIOS' (not imported here: the parser stays light;
    # tests/bench/test_chaos.py keeps this help naming every one)
    ch.add_argument("--scenario", default="kills", metavar="NAME",
                    help="what goes wrong: kills (default: one worker, admitter, router and NATS node of a 3-node "
                         "cluster each SIGKILLed, restarted after --down s); worker-restart (a worker SIGKILLed "
                         "and restarted at once, inside its lease); server-restart (the only nats-server "
                         "SIGKILLed, restarted on its data dir after --down s); recovery (worker-restart, then "
                         "server-restart); hostile (under auth init's accounts, a tenant's producer and a worker's "
                         "credentials attack the whole run: reply-to injection, declared costs, dedup collisions, "
                         "forged completions; reports over-admission)")
    ch.add_argument("--down", type=positive_float, default=6.0, metavar="S",
                    help="seconds a killed process (or server) stays down before its restart (default 6)")
    ch.add_argument("--sync", choices=("always", "interval"), default="always",
                    help="the nodes' JetStream sync_interval, as natsched up --sync (default always)")
    ch.set_defaults(handler=cmd_chaos)


def cmd_chaos(args) -> int:
    import orjson

    from natsched.bench.chaos import SCENARIOS, ChaosRun, ChaosSettings, format_report
    from natsched.errors import NatschedError

    if args.scenario not in SCENARIOS:
        return fail(f"unknown --scenario {args.scenario!r}: one of {', '.join(SCENARIOS)}")
    settings = ChaosSettings(requests=args.requests, rate=args.rate, seed=args.seed,
                             finish_timeout_s=args.finish_timeout, data_dir=args.data_dir,
                             inline_routing=args.inline_routing, routers=0 if args.inline_routing else 2,
                             scenario=args.scenario, down_s=args.down, sync=args.sync,
                             disconnects=max(0, args.disconnects))
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: finally stops all
    # the producer's publish retries during a leader election are expected, one line per request:
    # their effect is in the report
    logging.getLogger("natsched.bus.connection").setLevel(logging.ERROR)
    try:
        report = ChaosRun(settings).run()
    except NatschedError as exc:
        return fail(str(exc))
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt
