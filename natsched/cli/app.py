"""The ``natsched`` command line. Settings dataclasses are built here, once, from the flags."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


from natsched.bus.server import DEFAULT_PORT, DEFAULT_URL
from natsched.cli.gateway import add_gateway_parser
from natsched.ops.auth import add_auth_parser
from natsched.cli.bench import add_bench_parser
from natsched.bench.chaos import add_chaos_parser
from natsched.hosting.cluster import add_cluster_parser
from natsched.cli.jobs import add_parsers as add_job_parsers
from natsched.hosting.runtime import setup_logging
from natsched.ops.status import add_status_parser
from natsched.workers.calibrate import add_calibrate_flags
from natsched.workers.vllm_worker import add_server_flags, add_vllm_flags

ENGINES = ["sim", "vllm", "vllm-server", "null"]

ENV_URL = "NATSCHED_NATS_URL"
ENV_CREDENTIALS = "NATSCHED_CREDENTIALS"


def _url_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", default=os.environ.get(ENV_URL, DEFAULT_URL),
                   help=f"NATS server URL, or several comma-separated (default: ${ENV_URL} or {DEFAULT_URL})")
    p.add_argument("--credentials", type=Path, default=os.environ.get(ENV_CREDENTIALS),
                   help=f"credentials file from natsched auth init (default: ${ENV_CREDENTIALS})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="natsched",
        description="Admission control and cache-aware routing for LLM inference on NATS JetStream.",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run nats-server (embedded unless --nats-url), admitter, router and N workers",
                        description="Start the whole system in the foreground; Ctrl-C or SIGTERM stops it cleanly.")
    up.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    up.add_argument("--admitters", type=int, default=1, help="admitter replicas (default 1)")
    up.add_argument("--routers", type=int, default=None,
                    help="router replicas (default 1; 0 with --inline-routing)")
    up.add_argument("--no-credit", action="store_true",
                    help="admitters commit every allow to the shared usage (natsched admitter --no-credit)")
    up.add_argument("--inline-routing", action="store_true",
                    help="every admitter routes what it admits in its own process (admitter --route): one "
                         "stored hop and one process fewer per request; separate routers become optional")
    up.add_argument("--engine", choices=ENGINES, default="sim",
                    help="worker engine (default sim); vllm-server: one agent per --vllm-url")
    up.add_argument("--vllm-url", action="append", default=[], metavar="URL",
                    help="with --engine vllm-server: a running vllm serve (repeat for each server; one agent each)")
    up.add_argument("--kv-events", action="append", default=[], metavar="ENDPOINT",
                    help="with --engine vllm-server: each server's KV-event endpoint (tcp://HOST:PORT), in "
                         "--vllm-url order")
    up.add_argument("--nats-url", default=os.environ.get(ENV_URL),
                    help=f"use this NATS server instead of the embedded one (default: ${ENV_URL})")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="embedded server port (default 4222)")
    up.add_argument("--data-dir", type=Path, default=None,
                    help="embedded server data dir (default ~/.local/share/natsched)")
    up.add_argument("--policy", default="natsched", help="routing policy (default natsched)")
    up.add_argument("--time-scale", type=float, default=1.0, help="sim engine: multiply step times (default 1)")
    up.add_argument("--model", default=None, help="model name the workers serve (requests' --model)")
    up.add_argument("--gateway", nargs="?", type=int, const=8000, default=None, metavar="PORT",
                    help="also run the HTTP gateway on 127.0.0.1:PORT (default 8000); open as tenant 'open' "
                         "unless --gateway-keys")
    up.add_argument("--gateway-keys", type=Path, default=None, help="API keys file for the gateway")
    up.add_argument("--auth-dir", type=Path, default=None, metavar="DIR",
                    help="a directory written by natsched auth init: the embedded server enforces its "
                         "permissions and every component connects with its own role's credentials")
    up.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                    help="Prometheus metrics on PORT and the next ones: admitters, routers, workers, gateway, "
                         "in that order (each ready line names its port)")
    add_vllm_flags(up)  # passed through to every worker with --engine vllm

    adm = sub.add_parser("admitter", help="run one admitter replica", description="Run one admitter replica.")
    _url_flag(adm)
    adm.add_argument("--name", default="admitter", help="replica name in audit records")
    adm.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    adm.add_argument("--no-credit", action="store_true",
                     help="commit every allow to the shared usage (no credit reserved ahead): exact per-tenant "
                          "views across replicas, one more round trip per batch (see the README's Admission)")
    adm.add_argument("--route", action="store_true",
                     help="inline routing: route what this replica admits in its own process, straight to "
                          "the workers' WORK subjects (ADMITTED only when no worker can take a request now)")
    adm.add_argument("--policy", default="natsched", help="with --route: routing policy (default natsched)")
    adm.add_argument("--block-size", type=int, default=32, help="with --route: prefix block size (default 32)")

    rt = sub.add_parser("router", help="run one router replica", description="Run one router replica.")
    _url_flag(rt)
    rt.add_argument("--name", default="router", help="replica name in audit records")
    rt.add_argument("--policy", default="natsched", help="routing policy (default natsched)")
    rt.add_argument("--block-size", type=int, default=32, help="prefix block size in tokens (default 32)")
    rt.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")

    wk = sub.add_parser("worker", help="run a worker (or: worker drain ID)",
                        description="Run one worker agent with its engine, or send it a control command.")
    wk_sub = wk.add_subparsers(dest="action", metavar="ACTION")
    drain = wk_sub.add_parser("drain", help="stop sending a worker new work; it leaves when idle")
    drain.add_argument("worker_id")
    _url_flag(drain)
    cal = wk_sub.add_parser("calibrate", help="measure the engine's runtime-token capacity at its latency knee "
                                              "and store it in the workers bucket",
                            description="Run increasing concurrency against the engine, find the latency knee, "
                                        "store the capacity per model and deployment.")
    _url_flag(cal)
    add_calibrate_flags(cal)
    _url_flag(wk)
    wk.add_argument("--id", help="worker id (a subject token: letters, digits, - and _)")
    wk.add_argument("--engine", choices=ENGINES, default="sim",
                    help="sim (calibrated model), vllm (in this process), vllm-server (front a running vllm serve "
                         "or SGLang server: --url), or null (answers at once: for pipeline benchmarks)")
    wk.add_argument("--model", default="default", help="model name this worker serves")
    wk.add_argument("--concurrency", type=int, default=64, help="max requests in the engine at once")
    wk.add_argument("--time-scale", type=float, default=1.0, help="sim engine: multiply step times")
    wk.add_argument("--profile", default="h100-llama8b", help="sim engine profile")
    wk.add_argument("--block-size", type=int, default=32, help="KV block size in tokens (default 32)")
    wk.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval seconds (default 1)")
    wk.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    add_vllm_flags(wk)
    add_server_flags(wk)

    sm = sub.add_parser("submit", help="submit one request and print its result",
                        description="Submit one request and print the completion (or stream it).")
    _url_flag(sm)
    sm.add_argument("--tenant", required=True)
    sm.add_argument("--class", dest="cls", default="online", help="online | batch | offline (default online)")
    sm.add_argument("--prompt", required=True)
    sm.add_argument("--system-prompt", default=None)
    sm.add_argument("--model", default="default")
    sm.add_argument("--max-tokens", type=int, default=64)
    sm.add_argument("--id", default=None, help="request id (default: random); resubmitting an id is refused")
    sm.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    sm.add_argument("--json", action="store_true", help="print the result as JSON")
    sm.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for admission (default 30)")

    qt = sub.add_parser("quota", help="show or edit quotas live",
                        description="Read and edit the quotas in JetStream KV; running admitters apply them "
                                    "within a second.")
    qt_sub = qt.add_subparsers(dest="action", required=True, metavar="ACTION")
    qs = qt_sub.add_parser("show", help="print quotas and current usage")
    _url_flag(qs)
    qs.add_argument("--json", action="store_true")
    qset = qt_sub.add_parser("set", help="change quotas (validated before anything is written)")
    _url_flag(qset)
    qset.add_argument("--total", type=int, help="cluster total of runtime tokens")
    qset.add_argument("--hard-cap", type=int, help="the dynamic total never goes above this")
    qset.add_argument("--tenant", help="tenant to edit (with --floor / --weight / --cap)")
    qset.add_argument("--floor", type=float, help="tenant's guaranteed share of the total (0..1)")
    qset.add_argument("--weight", type=float, help="tenant's elastic weight for idle capacity")
    qset.add_argument("--cap", type=int, help="tenant's absolute cap in runtime tokens (-1 removes it)")
    qset.add_argument("--model", help="model to limit (with --model-limit)")
    qset.add_argument("--model-limit", type=int, help="runtime tokens the model may hold")
    qset.add_argument("--class", dest="cls", help="request class (with --queue-limit)")
    qset.add_argument("--queue-limit", type=int, help="max queued requests of the class")
    qset.add_argument("--unknown-tenant", choices=["default", "reject"],
                      help="unknown tenants get the default quota, or are rejected")

    ro = sub.add_parser("route", help="show or switch the routing policy live",
                        description="Read and change the routers' policy, weights and canary (config bucket).")
    ro_sub = ro.add_subparsers(dest="action", required=True, metavar="ACTION")
    rshow = ro_sub.add_parser("show", help="print the routing config")
    _url_flag(rshow)
    rset = ro_sub.add_parser("set", help="switch policy / weights / canary (applied within a second)")
    _url_flag(rset)
    rset.add_argument("--policy", required=True, help="live policy name")
    rset.add_argument("--weights", default=None, help='JSON object of policy weights, e.g. \'{"sticky_s": 20}\'')
    rset.add_argument("--canary", default=None, help="second policy for a share of traffic")
    rset.add_argument("--canary-share", type=float, default=0.0, help="share of requests for the canary (0..1)")

    add_gateway_parser(sub, _url_flag)
    add_status_parser(sub, _url_flag)
    add_auth_parser(sub)
    add_cluster_parser(sub)
    add_bench_parser(sub)
    add_chaos_parser(sub)
    add_job_parsers(sub)  # batch, jobs, audit, replay, offline, retention
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    from natsched.cli import commands

    handler = getattr(commands, f"cmd_{args.command}")
    try:
        return handler(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
