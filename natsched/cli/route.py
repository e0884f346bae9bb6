"""``natsched route show | set``: the routers' live policy, weights and canary (config bucket)."""

from __future__ import annotations

from natsched.cli.options import connect, fail, history_parsers, run, url_flag
from natsched.wire import subjects as S


def add_parsers(sub) -> None:
    ro = sub.add_parser("route", help="show or switch the routing policy live",
                        description="Read and change the routers' policy, weights and canary (config bucket).")
    ro_sub = ro.add_subparsers(dest="action", required=True, metavar="ACTION")
    rshow = ro_sub.add_parser("show", help="print the routing config")
    url_flag(rshow)
    rshow.add_argument("--json", action="store_true", help="print the stored config as JSON")
    rshow.set_defaults(handler=cmd_route)
    rset = ro_sub.add_parser("set", help="switch policy / weights / canary (applied within a second)")
    url_flag(rset)
    rset.add_argument("--policy", required=True, help="live policy name")
    rset.add_argument("--weights", default=None, help='JSON object of policy weights, e.g. \'{"sticky_s": 20}\'')
    rset.add_argument("--canary", default=None, help="second policy for a share of traffic")
    rset.add_argument("--canary-share", type=float, default=0.0, help="share of requests for the canary (0..1)")
    rset.add_argument("--learn", default=None,
                      help='JSON object of learned-cost settings (docs/learned-cost.md), e.g. \'{"tau_s": 20}\'')
    rset.add_argument("--health", default=None,
                      help='JSON object of health settings (docs/routing-health.md), e.g. \'{"slow_factor": 3}\'')
    rset.add_argument("--json", action="store_true", help="print the config written as JSON")
    rset.set_defaults(handler=cmd_route)
    history_parsers(ro_sub, "routing configs", cmd_route,
                    "Write an earlier revision of the routing config again (the routers apply it within a "
                    "second). Default: the revision before the current.")


def cmd_route(args) -> int:
    return run(_route(args))


def describe(config: dict) -> str:
    """A routing config in one line (:func:`natsched.ops.persisted.describe_route`)."""
    from natsched.ops.persisted import describe_route

    return describe_route(config)


async def _route(args) -> int:
    import orjson

    from natsched.router.policies import make_policy

    if args.action == "set":
        weights = orjson.loads(args.weights) if args.weights else {}
        if not isinstance(weights, dict):
            return fail("--weights must be a JSON object")
        make_policy(args.policy, weights=weights or None)  # refuse unknown names/weights before writing
        if args.canary:
            make_policy(args.canary)
            if not 0 < args.canary_share <= 1:
                return fail("--canary-share must be within (0, 1]")
        config = {"policy": args.policy, "weights": weights, "canary": args.canary,
                  "canary_share": args.canary_share if args.canary else 0.0}
        from natsched.router.core import RouterCore

        for name in ("learn", "health"):  # refuse unknown or ill-typed settings before writing
            raw = getattr(args, name)
            if raw is not None:
                value = orjson.loads(raw)
                if not isinstance(value, dict):
                    return fail(f"--{name} must be a JSON object")
                RouterCore().set_learning(**{name: value})
                config[name] = value
    bus = await connect(args)
    try:
        await bus.provision()
        if args.action in ("rollback", "history"):
            return await _route_history(bus, args)
        if args.action == "set":
            await bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, orjson.dumps(config))
            print(orjson.dumps(config).decode() if args.json else f"routing config set: {describe(config)}")
            return 0
        current = await bus.kv(S.BUCKET_CONFIG).get(S.KEY_ROUTER_CONFIG)
        if current is None:
            print("null" if args.json else "routing config not set (routers use their --policy)")
        else:
            print(current[0].decode() if args.json else describe(orjson.loads(current[0])))
        return 0
    finally:
        await bus.close()


async def _route_history(bus, args) -> int:
    import orjson

    from natsched.ops.rollback import route_target

    kv = bus.kv(S.BUCKET_CONFIG)
    rows = await kv.history(S.KEY_ROUTER_CONFIG)
    if args.action == "history":
        if not rows:
            print("no routing config was ever set (routers use their --policy)")
        for _key, value, rev, op in rows:
            print(f"{rev:>6}  {describe(orjson.loads(value)) if value is not None else op.lower()}")
        return 0
    rev, value = route_target(rows, args.to)
    written = await kv.put(S.KEY_ROUTER_CONFIG, value)
    print(f"routing config rolled back to revision {rev} (now revision {written}): {describe(orjson.loads(value))}")
    return 0
