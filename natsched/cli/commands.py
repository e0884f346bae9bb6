"""What each ``natsched`` subcommand does. Errors are printed as one clear line (exit 1)."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict

import orjson

from natsched.wire import subjects as S
from natsched.errors import NatschedError
from natsched.client.errors import Rejected
from natsched.wire.schema import Control


def run_loop(coro):
    """``asyncio.run`` on uvloop when it is installed: the services spend most of their CPU in
    the event loop and the NATS client's small reads and writes, which uvloop does in C."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _fail(message: str, code: int = 1) -> int:
    print(f"natsched: error: {message}", file=sys.stderr)
    return code


def up_settings(args):
    """``natsched up``'s flags as :class:`~natsched.hosting.supervisor.UpSettings` (ValueError: a bad combination)."""
    from natsched.hosting.supervisor import UpSettings, router_count

    if args.workers < 0 or args.admitters < 1:
        raise ValueError("--admitters must be >= 1, --workers >= 0")
    return UpSettings(workers=args.workers, admitters=args.admitters, inline_routing=args.inline_routing,
                      credit=not args.no_credit,
                      routers=router_count(args.routers, args.inline_routing), engine=args.engine,
                      nats_url=args.nats_url, port=args.port, data_dir=args.data_dir, policy=args.policy,
                      time_scale=args.time_scale, log_level=args.log_level, gateway_port=args.gateway,
                      gateway_keys=args.gateway_keys, auth_dir=args.auth_dir,
                      extra_worker_args=_worker_passthrough(args), metrics_port=args.metrics_port)


def cmd_up(args) -> int:
    from natsched.ops.auth import AuthError
    from natsched.hosting.supervisor import Supervisor

    try:
        settings = up_settings(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        return Supervisor(settings).run()
    except (NatschedError, AuthError) as exc:
        return _fail(str(exc))


def _worker_passthrough(args) -> list[str]:
    """``up``'s model and vLLM flags, handed to every worker."""
    out = ["--model", args.model] if args.model else []
    for flag in ("model_path", "max_model_len", "gpu_memory_utilization", "kv_cache_blocks", "load_format",
                 "deployment"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    for flag in ("enforce_eager", "skip_tokenizer_init", "ignore_eos"):
        if getattr(args, flag):
            out.append("--" + flag.replace("_", "-"))
    if args.kv_events_port is not None and args.workers > 1:
        raise ValueError("--kv-events-port binds one port: leave it unset with several workers")
    return out


def cmd_admitter(args) -> int:
    from natsched.admitter.credit import CreditSettings
    from natsched.admitter.metrics import AdmitterMetrics
    from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
    from natsched.hosting.runtime import serve

    async def start(bus):
        metrics, router = AdmitterMetrics(), None
        if args.route:  # inline routing: a router on this connection, its metrics beside ours
            from natsched.router.core import RouterSettings
            from natsched.router.metrics import RouterMetrics
            from natsched.router.service import RouterService, RouterServiceSettings

            router = RouterService(bus, RouterServiceSettings(
                name=args.name, core=RouterSettings(policy=args.policy, block_size=args.block_size)),
                RouterMetrics(metrics.registry))
        nonlocal service
        service = AdmitterService(bus, AdmitterServiceSettings(
            name=args.name, metrics_port=args.metrics_port, credit=CreditSettings(enabled=not args.no_credit)),
            metrics, router=router)
        await service.start()
        return f"total={service.total}" + (f" routing={router.core.policy.name}" if router else "")

    async def stop():
        if service is not None:
            await service.stop()

    service = None
    return _run(serve(args.nats_url, "admitter", start, stop=stop, credentials=args.credentials))


def cmd_router(args) -> int:
    from natsched.hosting.runtime import serve
    from natsched.router.core import RouterSettings
    from natsched.router.service import RouterService, RouterServiceSettings

    async def start(bus):
        settings = RouterServiceSettings(name=args.name, core=RouterSettings(policy=args.policy,
                                                                             block_size=args.block_size),
                                         metrics_port=args.metrics_port)
        service = RouterService(bus, settings)
        await service.start()
        return f"policy={service.core.policy.name}"

    return _run(serve(args.nats_url, "router", start, credentials=args.credentials))


def cmd_worker(args) -> int:
    if args.action == "drain":
        return _run(_send_control(args.nats_url, args.worker_id, "drain", args.credentials))
    if args.action == "calibrate":
        from natsched.workers.calibrate import calibrate_command

        return _run(calibrate_command(args, _make_engine(args)))
    if not args.id:
        return _fail("worker needs --id ID (or an action: drain, calibrate)")
    S.token(args.id, "worker id")
    from natsched.hosting.runtime import serve
    from natsched.workers.agent import WorkerAgent, WorkerSettings

    engine = _make_engine(args)
    holder: dict = {}
    deployment = args.deployment or (f"sim-{args.profile}" if args.engine == "sim" else None)

    async def start(bus):
        agent = WorkerAgent(bus, engine, WorkerSettings(id=args.id, model=args.model, concurrency=args.concurrency,
                                                        heartbeat_interval_s=args.heartbeat, deployment=deployment,
                                                        metrics_port=args.metrics_port))
        holder["agent"] = agent
        await bus.provision()  # its WORK stream may not exist yet when it starts first
        await agent.start()
        return f"id={args.id} engine={args.engine} model={args.model} capacity={agent.capacity_tokens or 'kv'}"

    async def stop():
        await holder["agent"].stop()

    async def until():
        while "agent" not in holder:
            await asyncio.sleep(0.1)
        await holder["agent"].wait_drained()

    code = _run(serve(args.nats_url, f"worker {args.id}", start, stop, until, credentials=args.credentials))
    agent = holder.get("agent")
    return 1 if code == 0 and agent is not None and agent.failure else code  # engine died: not a clean exit


def _make_engine(args):
    if args.engine == "null":
        from natsched.workers.nullengine import NullEngine

        return NullEngine(block_size=args.block_size)
    if args.engine == "sim":
        from natsched.workers.profiles import get_profile
        from natsched.workers.simengine import SimEngine

        return SimEngine(get_profile(args.profile), block_size=args.block_size, time_scale=args.time_scale)
    from natsched.workers.vllm_engine import VllmEngine  # noqa: the vllm extra

    return VllmEngine.from_args(args)


async def _send_control(url: str, worker: str, kind: str, credentials=None) -> int:
    from natsched.bus.connection import Bus

    bus = await Bus.connect(url, name="natsched-cli", credentials=credentials)
    try:
        await bus.publish(S.control(worker), Control(kind=kind, ts=time.time(), by="cli"))
        await bus.flush()
    finally:
        await bus.close()
    print(f"sent {kind} to worker {worker}")
    return 0


def cmd_submit(args) -> int:
    return _run(_submit(args))


async def _submit(args) -> int:
    from natsched.client.producer import Client, Timeouts, make_request

    client = await Client.connect(args.nats_url, Timeouts(admission=args.timeout), connect_budget_s=5.0,
                                  credentials=args.credentials)
    try:
        extra = {"id": args.id} if args.id else {}
        request = make_request(args.tenant, args.prompt, cls=args.cls, model=args.model, max_tokens=args.max_tokens,
                               system_prompt=args.system_prompt, **extra)
        if args.stream:
            stream = client.stream(request)
            async for chunk in stream:
                if not args.json:
                    print(chunk.text, end="", flush=True)
            result = stream.result
            if not args.json:
                print()
        else:
            result = await client.submit(request)
            if not args.json:
                print(result.text.strip() if result.status == "completed" else f"degraded: job {result.job_id}")
        if args.json:
            print(orjson.dumps(asdict(result)).decode())
        elif result is not None:
            print(f"[{result.request_id} on {result.worker}: {result.prompt_tokens} prompt tokens "
                  f"({result.cached_tokens} cached), {result.output_tokens} output, e2e {result.e2e:.3f}s]",
                  file=sys.stderr)
        return 0
    except Rejected as exc:
        retry = f" (retry after {exc.retry_after:.1f}s)" if exc.retry_after else ""
        return _fail(f"{exc}{retry}", 2)
    finally:
        await client.close()


def cmd_quota(args) -> int:
    return _run(_quota(args))


async def _read_quotas(bus):
    from natsched.admitter.quotas import Quotas

    entries = {}
    for key in await bus.kv(S.BUCKET_QUOTAS).keys():
        current = await bus.kv(S.BUCKET_QUOTAS).get(key)
        if current is not None:
            entries[key] = current[0]
    dynamic = entries.pop(S.KEY_DYNAMIC_TOTAL, None)
    quotas, errors = Quotas.from_kv(entries)
    return quotas, errors, (orjson.loads(dynamic) if dynamic else None), entries


async def _read_usage(bus):
    """The shared usage, or None (with a warning) when the stored value cannot be decoded."""
    from natsched.admitter.errors import UsageError
    from natsched.admitter.usage import Usage

    raw = await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE)
    try:
        return Usage.from_json(raw[0]) if raw else Usage()
    except UsageError as exc:
        print(f"natsched: warning: the shared usage cannot be decoded ({exc}); the admitters overwrite it "
              "at their next commit", file=sys.stderr)
        return None


def _edit_quotas(quotas, args):
    """Apply the flags to a copy of the quotas; raises QuotaError/ValueError on a bad edit."""
    import copy

    from natsched.admitter.quotas import TenantQuota

    q = copy.deepcopy(quotas)
    if args.total is not None:
        q.total = args.total
    if args.hard_cap is not None:
        q.hard_cap = None if args.hard_cap < 0 else args.hard_cap
    if args.tenant:
        S.token(args.tenant, "tenant")
        t = q.tenants.get(args.tenant) or TenantQuota()
        if args.floor is not None:
            t.floor = args.floor
        if args.weight is not None:
            t.weight = args.weight
        if args.cap is not None:
            t.cap = None if args.cap < 0 else args.cap
        q.tenants[args.tenant] = t
    elif any(v is not None for v in (args.floor, args.weight, args.cap)):
        raise ValueError("--floor, --weight and --cap need --tenant")
    if (args.model is None) != (args.model_limit is None):
        raise ValueError("--model and --model-limit go together")
    if args.model:
        q.models[args.model] = args.model_limit
    if (args.cls is None) != (args.queue_limit is None):
        raise ValueError("--class and --queue-limit go together")
    if args.cls:
        q.queue_limits[args.cls] = args.queue_limit
    if args.unknown_tenant:
        q.unknown_tenant = args.unknown_tenant
    q.validate()
    return q


async def _quota(args) -> int:
    from natsched.admitter.errors import QuotaError
    from natsched.bus.connection import Bus

    bus = await Bus.connect(args.nats_url, name="natsched-cli", connect_budget_s=5.0, credentials=args.credentials)
    try:
        await bus.provision()
        quotas, errors, dynamic, entries = await _read_quotas(bus)
        for err in errors:
            print(f"natsched: warning: {err}", file=sys.stderr)
        if args.action == "set":
            try:
                new = _edit_quotas(quotas, args)
            except (QuotaError, ValueError) as exc:
                return _fail(f"quota change refused, nothing written: {exc}")
            changed = {k: v for k, v in new.to_kv().items() if entries.get(k) != v}
            for key, value in changed.items():
                await bus.kv(S.BUCKET_QUOTAS).put(key, value)
            print(f"quotas updated ({len(changed)} entries): " + ", ".join(sorted(changed)) if changed
                  else "quotas unchanged")
            return 0
        usage = await _read_usage(bus)
        credit = usage.credit_by_tenant() if usage else {}
        view = {"total": quotas.total, "hard_cap": quotas.hard_cap, "dynamic_total": dynamic,
                "unknown_tenant": quotas.unknown_tenant, "default_tenant": asdict(quotas.default_tenant),
                "tenants": {t: asdict(q) | {"used": usage.tenants.get(t, 0) if usage else None,
                                            "credit": credit.get(t, 0)}
                            for t, q in sorted(quotas.tenants.items())},
                "models": dict(quotas.models), "queue_limits": dict(quotas.queue_limits),
                "used": usage.used if usage else None, "credit": sum(credit.values())}
        if args.json:
            print(orjson.dumps(view).decode())
            return 0
        print(f"cluster total {view['total']} runtime tokens (hard cap {view['hard_cap']}, dynamic {dynamic}); "
              f"in use {view['used'] if usage else 'unknown'}, of which {view['credit']} in admitters' credit "
              "blocks (reserved ahead, spent or not)")
        print(f"{'tenant':<16}{'floor':>8}{'weight':>8}{'cap':>12}{'used':>12}{'credit':>12}")
        for name, t in view["tenants"].items():
            print(f"{name:<16}{t['floor']:>8.2f}{t['weight']:>8.2f}{str(t['cap']):>12}{str(t['used']):>12}"
                  f"{t['credit']:>12}")
        print(f"unknown tenants: {quotas.unknown_tenant}; models: {view['models'] or '-'}; "
              f"queue limits: {view['queue_limits']}")
        return 0
    finally:
        await bus.close()


def cmd_gateway(args) -> int:
    from natsched.gateway.server import main

    return main(args)


def cmd_status(args) -> int:
    from natsched.ops.status import run_status

    return _run(run_status(args))


def cmd_auth(args) -> int:
    from natsched.ops.auth import AuthError, cmd_auth as run

    try:
        return run(args)
    except AuthError as exc:
        return _fail(str(exc))


def cmd_cluster(args) -> int:
    from natsched.hosting.cluster import cmd_cluster as run

    try:
        return run(args)
    except NatschedError as exc:
        return _fail(str(exc))


def cmd_bench(args) -> int:
    from natsched.cli.bench import cmd_bench as run

    return run(args)


def cmd_chaos(args) -> int:
    from natsched.bench.chaos import cmd_chaos as run

    try:
        return run(args)
    except NatschedError as exc:
        return _fail(str(exc))


def _jobs(args) -> int:
    from natsched.cli.jobs import run

    return run(args)


cmd_batch = cmd_jobs = cmd_audit = cmd_replay = cmd_offline = cmd_retention = _jobs


def cmd_route(args) -> int:
    return _run(_route(args))


async def _route(args) -> int:
    from natsched.bus.connection import Bus
    from natsched.router.policies import make_policy

    if args.action == "set":
        weights = orjson.loads(args.weights) if args.weights else {}
        if not isinstance(weights, dict):
            return _fail("--weights must be a JSON object")
        make_policy(args.policy, weights=weights or None)  # refuse unknown names/weights before writing
        if args.canary:
            make_policy(args.canary)
            if not 0 < args.canary_share <= 1:
                return _fail("--canary-share must be within (0, 1]")
        config = {"policy": args.policy, "weights": weights, "canary": args.canary,
                  "canary_share": args.canary_share if args.canary else 0.0}
    bus = await Bus.connect(args.nats_url, name="natsched-cli", connect_budget_s=5.0, credentials=args.credentials)
    try:
        await bus.provision()
        if args.action == "set":
            await bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, orjson.dumps(config))
            print(f"routing config set: {orjson.dumps(config).decode()}")
            return 0
        current = await bus.kv(S.BUCKET_CONFIG).get(S.KEY_ROUTER_CONFIG)
        print(current[0].decode() if current else "routing config not set (routers use their --policy)")
        return 0
    finally:
        await bus.close()


def _run(coro) -> int:
    from natsched.workers.errors import WorkerError

    try:
        return run_loop(coro) or 0
    except (NatschedError, WorkerError) as exc:
        return _fail(str(exc))
    except (ValueError, orjson.JSONDecodeError) as exc:
        return _fail(str(exc))
