"""``natsched up | admitter | router | worker``: the whole system, or one service process.

Every service prints one ``READY <component> ...`` line when it serves
(:func:`natsched.hosting.runtime.serve`) and stops cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from natsched.bus.server import DEFAULT_PORT, DEFAULT_SYNC, SYNC_CHOICES
from natsched.cli.argtypes import positive_float
from natsched.cli.options import ENV_SERVER_API_KEY, ENV_URL, connect, fail, run, url_flag

#: worker engines: a calibrated model, vLLM in the worker's process, a running vllm serve (or SGLang)
#: the worker fronts over HTTP, and none (answers at once)
ENGINES = ["sim", "vllm", "vllm-server", "null"]


def add_parsers(sub) -> None:
    _up_parser(sub)
    _admitter_parser(sub)
    _coordinator_parser(sub)
    _router_parser(sub)
    _worker_parser(sub)


SET_HELP = ("an admission / dynamic / scale / lease setting at start (JSON value, e.g. admission.aging_s=5); "
            "the quotas bucket's live settings (natsched quota set --set) win over it; docs/operations.md")


def start_knobs(assignments: list[str]):
    """``--set`` flags as settings (SettingsError naming the bad one, before anything starts)."""
    from natsched.admitter import knobs as K

    return K.apply(K.Knobs(), dict(K.parse_assignment(a) for a in assignments))


def _up_parser(sub) -> None:
    up = sub.add_parser("up", help="run nats-server (embedded unless --nats-url), admitter, router and N workers",
                        description="Start the whole system in the foreground; Ctrl-C or SIGTERM stops it cleanly.")
    up.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    up.add_argument("--admitters", type=int, default=1, help="admitter replicas (default 1; per partition with "
                                                              "--partitions)")
    up.add_argument("--partitions", type=int, default=1, metavar="P",
                    help="partitioned admission: requests spread over P partitions by tenant, each with its own "
                         "admitters and usage key, the total split by a budget coordinator (default 1; "
                         "docs/fleet.md)")
    up.add_argument("--routers", type=int, default=None,
                    help="router replicas (default 1; 0 with --inline-routing; per pool with --router-pools)")
    up.add_argument("--router-pools", default="", metavar="SPEC",
                    help="router pools per model: 'a=model1,model2;b=model3,*' runs --routers replicas per pool, "
                         "each routing only its pool's models and workers (* = every model no pool names; "
                         "docs/fleet.md)")
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
    up.add_argument("--kv-replay", action="append", default=[], metavar="ENDPOINT",
                    help="with --engine vllm-server: each server's KV-event replay socket (its replay_endpoint, "
                         "tcp://HOST:PORT), in --vllm-url order")
    up.add_argument("--vllm-metrics-url", action="append", default=[], metavar="URL",
                    help="with --engine vllm-server: each server's Prometheus page, in --vllm-url order "
                         "(default URL/metrics)")
    up.add_argument("--flavor", choices=["vllm", "sglang"], default=None,
                    help="with --engine vllm-server: the servers' kind (default vllm); their API key is read "
                         f"from ${ENV_SERVER_API_KEY}, which every agent inherits")
    add_leave_flag(up)
    up.add_argument("--nats-url", default=os.environ.get(ENV_URL),
                    help=f"use this NATS server instead of the embedded one (default: ${ENV_URL})")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="embedded server port (default 4222)")
    up.add_argument("--data-dir", type=Path, default=None,
                    help="embedded server data dir (default ~/.local/share/natsched)")
    up.add_argument("--sync", choices=SYNC_CHOICES, default=DEFAULT_SYNC,
                    help=f"embedded server: JetStream fsyncs every write before acknowledging it (always), or "
                         f"every 2 minutes (interval, the server's default: a power failure or OS crash can lose "
                         f"acknowledged writes); default {DEFAULT_SYNC} (docs/reliability.md)")
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
    up.add_argument("--set", dest="settings", action="append", default=[], metavar="GROUP.NAME=VALUE",
                    help=SET_HELP + " (passed to every admitter)")
    up.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                    help="Prometheus metrics on PORT and the next ones: admitters, routers, workers, gateway, "
                         "in that order (each ready line names its port)")
    add_vllm_flags(up)  # passed through to every worker with --engine vllm
    up.set_defaults(handler=cmd_up)


def _admitter_parser(sub) -> None:
    adm = sub.add_parser("admitter", help="run one admitter replica", description="Run one admitter replica.")
    url_flag(adm)
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
    adm.add_argument("--set", dest="settings", action="append", default=[], metavar="GROUP.NAME=VALUE",
                     help=SET_HELP)
    adm.add_argument("--partitions", type=int, default=1, metavar="P",
                     help="partitioned admission: how many partitions requests are spread over (default 1)")
    adm.add_argument("--partition", type=int, default=0, metavar="K",
                     help="with --partitions: the partition this replica admits for, 0..P-1")
    adm.add_argument("--no-coordinator", action="store_true",
                     help="with --partitions: run no budget-coordinator candidate in this process")
    pools_flag(adm)
    adm.set_defaults(handler=cmd_admitter)


def _coordinator_parser(sub) -> None:
    co = sub.add_parser("coordinator", help="run a budget-coordinator candidate (partitioned admission)",
                        description="Split the cluster total between admission partitions; one candidate holds "
                                    "the lease, the others stand by (docs/fleet.md).")
    url_flag(co)
    co.add_argument("--name", default="coordinator", help="candidate name (the lease holder's)")
    co.add_argument("--partitions", type=int, required=True, metavar="P", help="partitions to split the total into")
    co.set_defaults(handler=cmd_coordinator)


def pools_flag(p) -> None:
    p.add_argument("--pools", default=None, metavar="SPEC",
                   help="store the router pool map first (config key pools): 'a=model1,model2;b=model3,*' "
                        "(* = every model no pool names; a group without = is one model, its pool named after it)")


def pools_of(args):
    """``--pools`` as a PoolMap (None: not given); PoolError (a ValueError) says what is wrong."""
    from natsched.wire.pools import PoolMap

    return PoolMap.parse(args.pools) if args.pools is not None else None


async def store_given_pools(bus, pools) -> None:
    """Store ``--pools`` before the service reads it: nothing goes out under an older map."""
    from natsched.bus.pools import store_pools

    if pools is not None:
        await bus.provision()
        await store_pools(bus, pools)


def _router_parser(sub) -> None:
    rt = sub.add_parser("router", help="run one router replica", description="Run one router replica.")
    url_flag(rt)
    rt.add_argument("--name", default="router", help="replica name in audit records")
    rt.add_argument("--policy", default="natsched", help="routing policy (default natsched)")
    rt.add_argument("--block-size", type=int, default=32, help="prefix block size in tokens (default 32)")
    rt.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    rt.add_argument("--pool", default=None, metavar="NAME",
                    help="route only router pool NAME (its consumer router-NAME reads adm.NAME.>, only the workers "
                         "serving its models are registered); default: the one pool of every model")
    pools_flag(rt)
    rt.set_defaults(handler=cmd_router)


def _worker_parser(sub) -> None:
    wk = sub.add_parser("worker", help="run a worker (or: worker drain ID)",
                        description="Run one worker agent with its engine, or send it a control command.")
    wk_sub = wk.add_subparsers(dest="action", metavar="ACTION")
    drain = wk_sub.add_parser("drain", help="stop sending a worker new work; it leaves when idle")
    drain.add_argument("worker_id")
    url_flag(drain)
    drain.set_defaults(handler=cmd_drain)
    cal = wk_sub.add_parser("calibrate", help="measure the engine's runtime-token capacity at its latency knee "
                                              "and store it in the workers bucket",
                            description="Run increasing concurrency against the engine, find the latency knee, "
                                        "store the capacity per model and deployment.")
    url_flag(cal)
    add_calibrate_flags(cal)
    cal.set_defaults(handler=cmd_calibrate)
    url_flag(wk)
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
    wk.set_defaults(handler=cmd_worker)


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """The vLLM engine flags of ``natsched worker``, ``worker calibrate`` and ``up`` (passed through)."""
    p.add_argument("--model-path", default=None, help="model directory or HF id vLLM loads (default: --model)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="GPU share for weights+KV (0.9)")
    p.add_argument("--kv-cache-blocks", type=int, default=None, help="force the number of KV blocks")
    p.add_argument("--kv-events-port", type=int, default=None, help="port our KV-event socket binds (default: any)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (fast start, slower steps)")
    p.add_argument("--load-format", default=None, help="vLLM load format ('dummy' = random weights, no download)")
    p.add_argument("--dtype", default=None, help="vLLM weight/activation dtype (default: auto)")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="token-id prompts only")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens (benchmarks, tests)")
    p.add_argument("--deployment", default=None, help="calibration key part (default: device + KV size)")


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """``--engine vllm-server``: the server to front (:mod:`natsched.workers.vllm_server`)."""
    p.add_argument("--url", default=None, help="vllm-server: the server's http://HOST:PORT")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="vllm-server: the server's ZMQ KV-event endpoint, tcp://HOST:PORT (vllm serve "
                        "--kv-events-config with endpoint tcp://*:PORT); without it no cache summaries")
    p.add_argument("--kv-replay", default=None, metavar="ENDPOINT",
                   help="vllm-server: its KV-event replay socket (replay_endpoint), tcp://HOST:PORT: batches "
                        "missed before connecting or in a gap are fetched again")
    p.add_argument("--metrics-url", default=None, help="vllm-server: its Prometheus page (default URL/metrics)")
    p.add_argument("--flavor", choices=["vllm", "sglang"], default="vllm", help="vllm-server: the server's kind")
    p.add_argument("--api-key", default=os.environ.get(ENV_SERVER_API_KEY),
                   help=f"vllm-server: the server's --api-key (default ${ENV_SERVER_API_KEY}: not in argv, "
                        "which every local user can read)")
    p.add_argument("--server-block-size", type=int, default=None,
                   help="vllm-server: its KV block size (default: read from its /metrics, else 32)")
    add_leave_flag(p)


def add_leave_flag(p: argparse.ArgumentParser) -> None:
    """How long an engine server may be silent before its agent leaves (``natsched worker`` and ``up``)."""
    from natsched.workers.engine import UNREACHABLE_LEAVE_S as default

    p.add_argument("--unreachable-leave", type=positive_float, default=default, metavar="SECONDS",
                   help=f"vllm-server: seconds the server may not answer before the agent leaves (quiescing, "
                        f"back by itself when it answers); it backs off at once (default {default:g})")


def add_calibrate_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``natsched worker calibrate`` (engine choice and sweep)."""
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    p.add_argument("--model", default="default", help="model name requests use (the calibration key)")
    p.add_argument("--block-size", type=int, default=32, help="KV block size in tokens (default 32)")
    p.add_argument("--concurrency", type=int, default=64, help="engine batch size (vLLM max_num_seqs)")
    p.add_argument("--profile", default="h100-llama8b", help="sim engine profile")
    p.add_argument("--time-scale", type=float, default=1.0, help="sim engine: multiply step times")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="concurrency levels, increasing (default 1..64)")
    p.add_argument("--rounds", type=int, default=3, help="requests per client and level (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (default 256)")
    p.add_argument("--output-tokens", type=int, default=64, help="output length (default 64)")
    p.add_argument("--knee-factor", type=float, default=2.0,
                   help="knee: TTFT or TPOT p90 above this × its low-load value (default 2)")
    p.add_argument("--dry-run", action="store_true", help="print the result, do not store it")
    add_vllm_flags(p)


# ------------------------------------------------------------------ settings, built once

def up_settings(args):
    """``natsched up``'s flags as :class:`~natsched.hosting.supervisor.UpSettings` (ValueError: a bad combination)."""
    from natsched.hosting.supervisor import UpSettings, router_count

    if args.workers < 0 or args.admitters < 1 or args.partitions < 1:
        raise ValueError("--admitters and --partitions must be >= 1, --workers >= 0")
    try:
        start_knobs(args.settings)  # a bad --set fails here, not in every admitter
    except ValueError as exc:
        raise ValueError(f"--set refused: {exc}") from None
    return UpSettings(admitter_settings=list(args.settings), workers=args.workers, admitters=args.admitters, inline_routing=args.inline_routing,
                      partitions=args.partitions, router_pools=args.router_pools,
                      credit=not args.no_credit,
                      routers=router_count(args.routers, args.inline_routing), engine=args.engine,
                      nats_url=args.nats_url, port=args.port, data_dir=args.data_dir, sync=args.sync,
                      policy=args.policy,
                      time_scale=args.time_scale, log_level=args.log_level, gateway_port=args.gateway,
                      gateway_keys=args.gateway_keys, auth_dir=args.auth_dir,
                      extra_worker_args=_worker_passthrough(args), metrics_port=args.metrics_port,
                      server_urls=list(args.vllm_url or []), server_kv_events=list(args.kv_events or []),
                      server_kv_replay=list(args.kv_replay or []), server_leave_s=args.unreachable_leave,
                      server_metrics_urls=list(args.vllm_metrics_url or []), server_flavor=args.flavor)


def _worker_passthrough(args) -> list[str]:
    """``up``'s model and vLLM flags, handed to every worker."""
    out = ["--model", args.model] if args.model else []
    for flag in ("model_path", "max_model_len", "gpu_memory_utilization", "kv_cache_blocks", "load_format",
                 "dtype", "deployment"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    for flag in ("enforce_eager", "skip_tokenizer_init", "ignore_eos"):
        if getattr(args, flag):
            out.append("--" + flag.replace("_", "-"))
    if args.kv_events_port is not None and args.workers > 1:
        raise ValueError("--kv-events-port binds one port: leave it unset with several workers")
    return out


def vllm_settings(args):
    """The ``natsched worker`` flags as :class:`~natsched.workers.vllm_engine.VllmEngineSettings`."""
    from natsched.workers.vllm_engine import VllmEngineSettings

    def opt(name: str, default=None):
        value = getattr(args, name, None)
        return default if value is None else value

    return VllmEngineSettings(
        model_path=opt("model_path") or args.model, model=args.model, block_size=opt("block_size", 32),
        max_num_seqs=opt("concurrency", 64), max_model_len=opt("max_model_len"),
        gpu_memory_utilization=opt("gpu_memory_utilization", 0.9), kv_cache_blocks=opt("kv_cache_blocks"),
        enforce_eager=bool(opt("enforce_eager", False)), load_format=opt("load_format", "auto"),
        dtype=opt("dtype", "auto"),
        skip_tokenizer_init=bool(opt("skip_tokenizer_init", False)), deployment=opt("deployment"),
        kv_events_port=opt("kv_events_port", 0), ignore_eos=bool(opt("ignore_eos", False)),
    )


def server_settings(args):
    """The ``natsched worker --engine vllm-server`` flags as :class:`~natsched.workers.vllm_server.ServerSettings`."""
    from natsched.workers.vllm_server import ServerSettings

    if not args.url:
        raise ValueError("--engine vllm-server needs --url http://HOST:PORT")
    return ServerSettings(
        url=args.url, kv_events=args.kv_events, kv_replay=args.kv_replay, metrics_url=args.metrics_url,
        flavor=args.flavor, model=None if args.model in (None, "default") else args.model,
        block_size=args.server_block_size, scrape_interval_s=args.heartbeat, ignore_eos=bool(args.ignore_eos),
        api_key=args.api_key)


def worker_settings(args, model: str, deployment: str | None):
    """The ``natsched worker`` flags as the agent's :class:`~natsched.workers.agent.WorkerSettings`."""
    from natsched.workers.agent import WorkerSettings

    return WorkerSettings(id=args.id, model=model, concurrency=args.concurrency, heartbeat_interval_s=args.heartbeat,
                          deployment=deployment, metrics_port=args.metrics_port,
                          unreachable_leave_s=args.unreachable_leave)


def _make_engine(args):
    if args.engine == "null":
        from natsched.workers.nullengine import NullEngine

        return NullEngine(block_size=args.block_size)
    if args.engine == "sim":
        from natsched.workers.profiles import get_profile
        from natsched.workers.simengine import SimEngine

        return SimEngine(get_profile(args.profile), block_size=args.block_size, time_scale=args.time_scale)
    if args.engine == "vllm-server":
        from natsched.workers.vllm_server import ServerEngine

        return ServerEngine(server_settings(args))
    from natsched.workers.vllm_engine import VllmEngine  # the vllm extra

    return VllmEngine(vllm_settings(args))


# ------------------------------------------------------------------ commands

def cmd_up(args) -> int:
    from natsched.errors import NatschedError
    from natsched.hosting.supervisor import Supervisor

    try:
        settings = up_settings(args)
    except ValueError as exc:
        return fail(str(exc))
    try:
        return Supervisor(settings).run()
    except NatschedError as exc:
        return fail(str(exc))


def cmd_admitter(args) -> int:
    from natsched.admitter.credit import CreditSettings
    from natsched.admitter.metrics import AdmitterMetrics
    from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
    from natsched.hosting.runtime import serve

    try:
        knobs = start_knobs(args.settings)
    except ValueError as exc:  # SettingsError: the bad knob named, nothing started
        return fail(f"--set refused: {exc}")
    if args.partitions < 1 or not 0 <= args.partition < args.partitions:
        return fail(f"--partition {args.partition} of --partitions {args.partitions}: the partition must be "
                    f"0..P-1 and P >= 1")

    try:
        pools = pools_of(args)
    except ValueError as exc:
        return fail(f"--pools refused: {exc}")

    async def start(bus):
        await store_given_pools(bus, pools)
        metrics, router = AdmitterMetrics(), None
        if args.route:  # inline routing: a router on this connection, its metrics beside ours
            from natsched.router.core import RouterSettings
            from natsched.router.metrics import RouterMetrics
            from natsched.router.service import RouterService, RouterServiceSettings

            router = RouterService(bus, RouterServiceSettings(
                name=args.name, core=RouterSettings(policy=args.policy, block_size=args.block_size)),
                RouterMetrics(metrics.registry))
        nonlocal service
        lease = knobs.lease
        service = AdmitterService(bus, AdmitterServiceSettings(
            name=args.name, metrics_port=args.metrics_port, credit=CreditSettings(enabled=not args.no_credit),
            admission=knobs.admission, dynamic=knobs.dynamic, scale=knobs.scale, lease_missed=lease.missed,
            rescue_grace_s=lease.rescue_grace_s, reconcile_interval_s=lease.reconcile_interval_s,
            orphan_after_s=lease.orphan_after_s, model_memory_s=lease.model_memory_s,
            partition=args.partition, partitions=args.partitions, coordinate=not args.no_coordinator),
            metrics, router=router)
        await service.start()
        return f"total={service.total}" + (f" routing={router.core.policy.name}" if router else "")

    async def stop():
        if service is not None:
            await service.stop()

    service = None
    return run(serve(args.nats_url, "admitter", start, stop=stop, credentials=args.credentials))


def cmd_coordinator(args) -> int:
    from natsched.admitter.coordinator import Coordinator, CoordinatorSettings
    from natsched.admitter.move import change_partitions
    from natsched.hosting.runtime import serve

    if args.partitions < 2:
        return fail("--partitions must be >= 2 (one partition has no budget to split)")

    async def start(bus):
        nonlocal coordinator
        await bus.provision()
        await change_partitions(bus, args.partitions)  # (refused while the old P holds work)
        coordinator = Coordinator(bus, CoordinatorSettings(name=args.name, partitions=args.partitions))
        await coordinator.start()
        return f"partitions={args.partitions}"

    async def stop():
        if coordinator is not None:
            await coordinator.resign()

    coordinator = None
    return run(serve(args.nats_url, "coordinator", start, stop=stop, credentials=args.credentials))


def cmd_router(args) -> int:
    from natsched.hosting.runtime import serve
    from natsched.router.core import RouterSettings
    from natsched.router.service import RouterService, RouterServiceSettings

    from natsched.wire import subjects as S

    try:
        pools = pools_of(args)
    except ValueError as exc:
        return fail(f"--pools refused: {exc}")

    async def start(bus):
        await store_given_pools(bus, pools)
        settings = RouterServiceSettings(name=args.name, core=RouterSettings(policy=args.policy,
                                                                             block_size=args.block_size),
                                         metrics_port=args.metrics_port, pool=args.pool or S.DEFAULT_POOL)
        service = RouterService(bus, settings)
        await service.start()
        return f"policy={service.core.policy.name} pool={service.pool}"

    return run(serve(args.nats_url, "router", start, credentials=args.credentials))


def cmd_drain(args) -> int:
    return run(_send_control(args, args.worker_id, "drain"))


def cmd_calibrate(args) -> int:
    return run(calibrate_command(args, _make_engine(args)))


async def calibrate_command(args: argparse.Namespace, engine) -> int:
    """``natsched worker calibrate``: start the engine, sweep, store (unless --dry-run), print JSON.

    Errors (engine cannot start, nothing measurable) are one line on stderr and exit code 1.
    """
    from natsched.wire import subjects as S
    from natsched.workers.calibrate import CalibrationSettings, calibrate, store_calibration
    from natsched.workers.errors import WorkerError

    try:
        levels = [int(x) for x in str(getattr(args, "levels", None) or "1,2,4,8,16,32,64").split(",") if x.strip()]
        settings = CalibrationSettings(  # checked before the (slow) engine start
            model=args.model, deployment="", levels=levels,
            rounds=getattr(args, "rounds", None) or 3,
            prompt_tokens=getattr(args, "prompt_tokens", None) or 256,
            output_tokens=getattr(args, "output_tokens", None) or 64,
            knee_factor=getattr(args, "knee_factor", None) or 2.0,
        )
        settings_of = getattr(engine, "settings", None)
        if settings_of is not None and hasattr(settings_of, "ignore_eos"):
            settings_of.ignore_eos = True  # every request runs to output_tokens: the load is what we asked
        await engine.start()
        try:
            # the engine's own deployment name may depend on what it found at start (KV size)
            settings.deployment = (getattr(args, "deployment", None) or getattr(engine, "deployment", None)
                                   or (f"sim-{args.profile}" if getattr(args, "engine", "") == "sim" else "default"))
            cal = await calibrate(engine, settings)
        finally:
            await engine.stop()
    except (WorkerError, ValueError) as exc:
        print(f"natsched: error: calibration failed: {exc}", file=sys.stderr)
        return 1
    print(cal.to_json().decode(), flush=True)
    if not getattr(args, "dry_run", False):
        bus = await connect(args, "natsched-calibrate")
        try:
            await bus.provision()
            await store_calibration(bus, cal)
        finally:
            await bus.close()
        print(f"stored {S.calibration_key(cal.model, cal.deployment)} in bucket {S.BUCKET_WORKERS}: "
              f"{cal.capacity_tokens} runtime tokens ({cal.knee_reason})", file=sys.stderr)
    return 0


def cmd_worker(args) -> int:
    from natsched.wire import subjects as S

    if not args.id:
        return fail("worker needs --id ID (or an action: drain, calibrate)")
    try:
        S.token(args.id, "worker id")
    except ValueError as exc:
        return fail(str(exc))
    from natsched.hosting.runtime import serve
    from natsched.workers.agent import WorkerAgent

    try:
        engine = _make_engine(args)
    except ValueError as exc:
        return fail(str(exc))
    holder: dict = {}
    deployment = args.deployment or (f"sim-{args.profile}" if args.engine == "sim" else None)

    async def start(bus):
        model = args.model
        if args.engine == "vllm-server":  # the server says what it serves: its base model is the worker's
            await engine.discover()
            model = engine.model
        agent = WorkerAgent(bus, engine, worker_settings(args, model, deployment))
        holder["agent"] = agent
        await bus.provision()  # its WORK stream may not exist yet when it starts first
        await agent.start()
        return f"id={args.id} engine={args.engine} model={model} capacity={agent.capacity_tokens or 'kv'}"

    async def stop():
        await holder["agent"].stop()

    async def until():
        while "agent" not in holder:
            await asyncio.sleep(0.1)
        await holder["agent"].wait_drained()

    code = run(serve(args.nats_url, f"worker {args.id}", start, stop, until, credentials=args.credentials))
    agent = holder.get("agent")
    if code == 0 and agent is not None and agent.drained_by is not None and not agent.failure:
        from natsched.hosting.runtime import announce_drained

        announce_drained(f"worker {args.id}", f"by={agent.drained_by}")  # natsched up leaves it stopped
    return 1 if code == 0 and agent is not None and agent.failure else code  # engine died: not a clean exit


async def _send_control(args, worker: str, kind: str) -> int:
    from natsched.wire import subjects as S
    from natsched.wire.schema import Control

    bus = await connect(args)
    try:
        await bus.publish(S.control(worker), Control(kind=kind, ts=time.time(), by="cli"))
        await bus.flush()
    finally:
        await bus.close()
    print(f"sent {kind} to worker {worker}")
    return 0
