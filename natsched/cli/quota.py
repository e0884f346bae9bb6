"""``natsched quota show | set``: the quotas in JetStream KV, read and edited live.

Running admitters apply an edit within a second. ``set`` validates the whole result before it
writes anything and then reports each field it changed as ``old -> new``; ``show`` renders unset
values as words (``none``, ``unknown``), never as Python reprs; ``--json`` stays JSON.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

from natsched.cli.options import connect, fail, run, url_flag
from natsched.wire import subjects as S


def add_parsers(sub) -> None:
    qt = sub.add_parser("quota", help="show or edit quotas live",
                        description="Read and edit the quotas in JetStream KV; running admitters apply them "
                                    "within a second.")
    qt_sub = qt.add_subparsers(dest="action", required=True, metavar="ACTION")
    qs = qt_sub.add_parser("show", help="print quotas and current usage")
    url_flag(qs)
    qs.add_argument("--json", action="store_true")
    qs.set_defaults(handler=cmd_quota)
    qset = qt_sub.add_parser("set", help="change quotas (validated before anything is written)")
    url_flag(qset)
    qset.add_argument("--total", type=int, help="cluster total of runtime tokens")
    qset.add_argument("--hard-cap", type=int, help="the dynamic total never goes above this (-1 removes it)")
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
    qset.set_defaults(handler=cmd_quota)


def cmd_quota(args) -> int:
    return run(_quota(args))


def word(value: Any, unset: str = "none") -> str:
    """A value for people: ``unset`` for None, a float without noise, a mapping as ``k=v, ...``."""
    if value is None:
        return unset
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={word(v)}" for k, v in sorted(value.items())) or "-"
    return str(value)


UNSET = "unset"  # a tenant, model or class limit that had no entry (None is a field set to "no limit")


def quota_changes(old, new) -> list[tuple[str, Any, Any]]:
    """(field, old, new) for every field that differs between two :class:`Quotas`, in a stable order."""
    from natsched.admitter.quotas import TenantQuota

    out = [(name, getattr(old, name), getattr(new, name)) for name in ("total", "hard_cap", "unknown_tenant")]
    for tenant in sorted(set(old.tenants) | set(new.tenants)):
        was, now = old.tenants.get(tenant), new.tenants.get(tenant) or TenantQuota()
        if was is None:  # a new tenant: its whole quota, in one line
            out.append((f"tenant {tenant}", UNSET, f"floor {word(now.floor)}, weight {word(now.weight)}, "
                                                  f"cap {word(now.cap)}"))
            continue
        for name in ("floor", "weight", "cap"):
            out.append((f"tenant {tenant} {name}", getattr(was, name), getattr(now, name)))
    for label, before, after in (("model", old.models, new.models), ("queue limit", old.queue_limits,
                                                                      new.queue_limits)):
        for key in sorted(set(before) | set(after)):
            out.append((f"{label} {key}", before.get(key, UNSET), after.get(key, UNSET)))
    return [(name, a, b) for name, a, b in out if a != b]


async def _read_quotas(bus):
    import orjson

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

    bus = await connect(args)
    try:
        await bus.provision()
        quotas, errors, dynamic, entries = await _read_quotas(bus)
        for err in errors:
            print(f"natsched: warning: {err}", file=sys.stderr)
        if args.action == "set":
            try:
                new = _edit_quotas(quotas, args)
            except (QuotaError, ValueError) as exc:
                return fail(f"quota change refused, nothing written: {exc}")
            return await _write(bus, quotas, new, entries)
        return await _show(bus, quotas, dynamic, args.json)
    finally:
        await bus.close()


async def _write(bus, old, new, entries) -> int:
    for key, value in new.to_kv().items():
        if entries.get(key) != value:
            await bus.kv(S.BUCKET_QUOTAS).put(key, value)
    changes = quota_changes(old, new)
    if not changes:
        print("quotas unchanged")
    for name, was, now in changes:
        print(f"{name}: {word(was)} -> {word(now)}")
    return 0


async def _show(bus, quotas, dynamic, as_json: bool) -> int:
    import orjson

    usage = await _read_usage(bus)
    credit = usage.credit_by_tenant() if usage else {}
    view = {"total": quotas.total, "hard_cap": quotas.hard_cap, "dynamic_total": dynamic,
            "unknown_tenant": quotas.unknown_tenant, "default_tenant": asdict(quotas.default_tenant),
            "tenants": {t: asdict(q) | {"used": usage.tenants.get(t, 0) if usage else None,
                                        "credit": credit.get(t, 0)}
                        for t, q in sorted(quotas.tenants.items())},
            "models": dict(quotas.models), "queue_limits": dict(quotas.queue_limits),
            "used": usage.used if usage else None, "credit": sum(credit.values())}
    if as_json:
        print(orjson.dumps(view).decode())
        return 0
    print(f"cluster total {view['total']} runtime tokens (hard cap {word(view['hard_cap'])}, dynamic "
          f"{word(dynamic, 'off')}); in use {word(view['used'], 'unknown')}, of which {view['credit']} in "
          "admitters' credit blocks (reserved ahead, spent or not)")
    print(f"{'tenant':<16}{'floor':>8}{'weight':>8}{'cap':>12}{'used':>12}{'credit':>12}")
    for name, t in view["tenants"].items():
        print(f"{name:<16}{t['floor']:>8.2f}{t['weight']:>8.2f}{word(t['cap'], '-'):>12}"
              f"{word(t['used'], 'unknown'):>12}{t['credit']:>12}")
    print(f"unknown tenants: {quotas.unknown_tenant}; models: {word(view['models'])}; "
          f"queue limits: {word(view['queue_limits'])}")
    return 0
