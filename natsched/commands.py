"""What each ``natsched`` subcommand does. Errors are printed as one clear line (exit 1)."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict

import orjson

from bus import subjects as S
from bus.errors import BusError, Rejected
from bus.schema import Control


def _fail(message: str, code: int = 1) -> int:
    print(f"natsched: error: {message}", file=sys.stderr)
    return code


def cmd_up(args) -> int:
    from natsched.supervisor import Supervisor, UpSettings

    settings = UpSettings(workers=args.workers, engine=args.engine, nats_url=args.nats_url, port=args.port,
                          data_dir=args.data_dir, policy=args.policy, time_scale=args.time_scale,
                          log_level=args.log_level)
    try:
        return Supervisor(settings).run()
    except BusError as exc:
        return _fail(str(exc))


def cmd_admitter(args) -> int:
    from admitter.service import AdmitterService, AdmitterServiceSettings
    from natsched.runtime import serve

    async def start(bus):
        service = AdmitterService(bus, AdmitterServiceSettings(name=args.name))
        await service.start()
        return f"total={service.core.total}"

    return _run(serve(args.nats_url, "admitter", start))


def cmd_router(args) -> int:
    from natsched.runtime import serve
    from router.core import RouterSettings
    from router.service import RouterService, RouterServiceSettings

    async def start(bus):
        settings = RouterServiceSettings(name=args.name, core=RouterSettings(policy=args.policy,
                                                                             block_size=args.block_size))
        service = RouterService(bus, settings)
        await service.start()
        return f"policy={service.core.policy.name}"

    return _run(serve(args.nats_url, "router", start))


def cmd_worker(args) -> int:
    if args.action == "drain":
        return _run(_send_control(args.nats_url, args.worker_id, "drain"))
    if not args.id:
        return _fail("worker needs --id ID (or an action: drain)")
    S.token(args.id, "worker id")
    from natsched.runtime import serve
    from workers.agent import WorkerAgent, WorkerSettings

    engine = _make_engine(args)
    holder: dict = {}

    async def start(bus):
        agent = WorkerAgent(bus, engine, WorkerSettings(id=args.id, model=args.model, concurrency=args.concurrency,
                                                        heartbeat_interval_s=args.heartbeat))
        holder["agent"] = agent
        await agent.start()
        return f"id={args.id} engine={args.engine}"

    async def stop():
        await holder["agent"].stop()

    async def until():
        while "agent" not in holder:
            await asyncio.sleep(0.1)
        await holder["agent"].wait_drained()

    return _run(serve(args.nats_url, f"worker {args.id}", start, stop, until))


def _make_engine(args):
    if args.engine == "sim":
        from workers.profiles import get_profile
        from workers.simengine import SimEngine

        return SimEngine(get_profile(args.profile), block_size=args.block_size, time_scale=args.time_scale)
    from workers.vllm_engine import VllmEngine  # noqa: the vllm extra

    return VllmEngine.from_args(args)


async def _send_control(url: str, worker: str, kind: str) -> int:
    from bus.connection import Bus

    bus = await Bus.connect(url, name="natsched-cli")
    try:
        await bus.publish(S.control(worker), Control(kind=kind, ts=time.time(), by="cli"))
        await bus.nc.flush()
    finally:
        await bus.close()
    print(f"sent {kind} to worker {worker}")
    return 0


def cmd_submit(args) -> int:
    return _run(_submit(args))


async def _submit(args) -> int:
    from bus.client import Client, Timeouts, make_request

    client = await Client.connect(args.nats_url, Timeouts(admission=args.timeout), connect_budget_s=5.0)
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


async def _quota(args) -> int:
    from bus.connection import Bus

    bus = await Bus.connect(args.nats_url, name="natsched-cli", connect_budget_s=5.0)
    try:
        await bus.provision()
        if args.action == "set":
            if args.total < 0:
                return _fail("--total must be >= 0")
            await bus.kv_put(S.BUCKET_QUOTAS, S.KEY_CLUSTER_TOTAL, orjson.dumps(args.total))
            print(f"cluster total set to {args.total} runtime tokens")
            return 0
        current = await bus.kv_get(S.BUCKET_QUOTAS, S.KEY_CLUSTER_TOTAL)
        total = orjson.loads(current[0]) if current else None
        if args.json:
            print(orjson.dumps({"total": total}).decode())
        else:
            print(f"cluster total: {total if total is not None else 'not set (admitter default)'}")
        return 0
    finally:
        await bus.close()


def cmd_route(args) -> int:
    return _run(_route(args))


async def _route(args) -> int:
    from bus.connection import Bus
    from router.policies import make_policy

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
    bus = await Bus.connect(args.nats_url, name="natsched-cli", connect_budget_s=5.0)
    try:
        await bus.provision()
        if args.action == "set":
            await bus.kv_put(S.BUCKET_CONFIG, S.KEY_ROUTER_CONFIG, orjson.dumps(config))
            print(f"routing config set: {orjson.dumps(config).decode()}")
            return 0
        current = await bus.kv_get(S.BUCKET_CONFIG, S.KEY_ROUTER_CONFIG)
        print(current[0].decode() if current else "routing config not set (routers use their --policy)")
        return 0
    finally:
        await bus.close()


def _run(coro) -> int:
    try:
        return asyncio.run(coro) or 0
    except BusError as exc:
        return _fail(str(exc))
    except (ValueError, orjson.JSONDecodeError) as exc:
        return _fail(str(exc))
