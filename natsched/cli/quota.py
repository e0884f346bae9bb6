"""``natsched quota show | set``: the quotas in JetStream KV, read and edited live.

Running admitters apply an edit within a second. ``set`` validates the whole result before it
writes anything and then reports each field it changed as ``old -> new``; ``show`` renders unset
values as words (``none``, ``unknown``), never as Python reprs; ``--json`` stays JSON.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from natsched.ops.persisted import UNSET, quota_changes, word
from natsched.cli.options import connect, fail, history_parsers, run, url_flag
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
    qset.add_argument("--class", dest="cls", help="request class (with --queue-limit / --class-limit)")
    qset.add_argument("--queue-limit", type=int, help="max queued requests of the class")
    qset.add_argument("--class-limit", type=int,
                      help="runtime tokens all requests of the class may hold together, cluster-wide (-1 "
                           "removes it); online borrows lower classes' unused room: docs/admission.md")
    qset.add_argument("--unknown-tenant", choices=["default", "reject"],
                      help="unknown tenants get the default quota, or are rejected")
    qset.add_argument("--set", dest="settings", action="append", default=[], metavar="GROUP.NAME=VALUE",
                      help="an admission / dynamic / scale / lease setting, live (JSON value, e.g. "
                           "admission.aging_s=5, admission.calibrated_output=true; docs/operations.md)")
    qset.add_argument("--unset", dest="unset", action="append", default=[], metavar="GROUP.NAME",
                      help="drop a live setting: the admitters' start value applies again")
    qset.set_defaults(handler=cmd_quota)
    history_parsers(qt_sub, "quota edits", cmd_quota,
                    "Write the quotas (and live settings) as they were at an earlier revision of the bucket; "
                    "default: before the last natsched quota set.")


def cmd_quota(args) -> int:
    return run(_quota(args))


async def _read_quotas(bus):
    import orjson

    from natsched.admitter.quotas import Quotas

    entries = {key: value for key, (value, _rev) in (await bus.kv(S.BUCKET_QUOTAS).snapshot()).items()}
    dynamic = entries.pop(S.KEY_DYNAMIC_TOTAL, None)
    quotas, errors = Quotas.from_kv(entries, default_total=_live_default_total(entries))
    return quotas, errors, (orjson.loads(dynamic) if dynamic else None), entries


def _live_default_total(entries: dict[str, bytes]) -> int | None:
    """``admission.default_total`` when it is set live: the total the admitters run with while
    the bucket names none (what ``quota show`` must print instead of the class default)."""
    from natsched.admitter import knobs as K

    value = K.from_kv(entries)[0].get("admission.default_total")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def _read_usage(bus):
    """The usage in flight (every partition's added when admission is partitioned) and each
    partition's use and budget; the usage is None (with a warning) when a stored value cannot be
    decoded."""
    from natsched.admitter.inflight import read_inflight

    inflight = await read_inflight(bus)
    if inflight.corrupt:
        print(f"natsched: warning: the shared usage cannot be decoded ({'; '.join(inflight.warnings)}); the "
              "admitters overwrite it at their next commit", file=sys.stderr)
        return None, inflight
    for warning in inflight.warnings:
        print(f"natsched: warning: {warning}", file=sys.stderr)
    return inflight.usage, inflight


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
    limit = getattr(args, "class_limit", None)
    if (args.cls is None) != (args.queue_limit is None and limit is None):
        raise ValueError("--class goes with --queue-limit and/or --class-limit")
    if args.cls and args.queue_limit is not None:
        q.queue_limits[args.cls] = args.queue_limit
    if args.cls and limit is not None:
        if limit < 0:
            q.class_limits.pop(args.cls, None)
        else:
            q.class_limits[args.cls] = limit
    if args.unknown_tenant:
        q.unknown_tenant = args.unknown_tenant
    q.validate()
    return q


async def _quota(args) -> int:
    from natsched.admitter.errors import QuotaError
    from natsched.errors import NatschedError

    bus = await connect(args)
    try:
        await bus.provision()
        quotas, errors, dynamic, entries = await _read_quotas(bus)
        for err in errors:
            print(f"natsched: warning: {err}", file=sys.stderr)
        if args.action in ("rollback", "history"):
            return await _rollback(bus, args)
        if args.action == "set":
            try:
                new = _edit_quotas(quotas, args)
                settings = _edit_settings(entries, args)
            except (QuotaError, ValueError, NatschedError) as exc:
                return fail(f"quota change refused, nothing written: {exc}")
            code = await _write(bus, quotas, new, entries, bool(args.settings or args.unset), args.total is not None)
            changed = [f"{n}: {word(a)} -> {word(b)}" for n, a, b in quota_changes(quotas, new)]
            changed += await _write_settings(bus, entries, settings)
            if changed:
                await _mark(bus, {"changes": changed})
            return code
        return await _show(bus, quotas, dynamic, args.json, entries)
    finally:
        await bus.close()


def _edit_settings(entries: dict[str, bytes], args) -> dict:
    """The live settings after ``--set`` / ``--unset``, checked together (SettingsError, nothing
    written, when any is bad): ``{"group.name": value}``."""
    from natsched.admitter import knobs as K

    current, errors = K.from_kv(entries)
    for err in errors:
        print(f"natsched: warning: {err}", file=sys.stderr)
    new = dict(current)
    for key in getattr(args, "unset", None) or []:
        K.split(key)
        if key not in new:
            raise ValueError(f"--unset {key}: it is not set live")
        del new[key]
    for text in getattr(args, "settings", None) or []:
        key, value = K.parse_assignment(text)
        new[key] = value
    K.apply(K.Knobs(), new)  # every value and their combination, before anything is written
    return new


async def _write_settings(bus, entries: dict[str, bytes], new: dict) -> None:
    import orjson

    from natsched.admitter import knobs as K

    old, _ = K.from_kv(entries)
    lines = []
    for key in sorted(set(old) - set(new)):
        await bus.kv(S.BUCKET_QUOTAS).delete(S.setting_key(*K.split(key)))
        lines.append(f"setting {key}: {word(old[key])} -> unset (the admitters' start value)")
    for key, value in sorted(new.items()):
        if key not in old or old[key] != value:
            await bus.kv(S.BUCKET_QUOTAS).put(S.setting_key(*K.split(key)), orjson.dumps(value))
            lines.append(f"setting {key}: {word(old.get(key), UNSET)} -> {word(value)}")
    for line in lines:
        print(line)
    return lines


async def _mark(bus, what: dict) -> int:
    """The ``change`` marker, written last: what ``quota rollback`` undoes one edit by."""
    import time

    import orjson

    return await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_QUOTA_CHANGE, orjson.dumps({"ts": time.time(), "by": "cli",
                                                                                **what}))


async def _rollback(bus, args) -> int:
    import time

    import orjson

    from natsched.bus.provision import bucket_history
    from natsched.ops.rollback import quota_plan, quota_target

    kv = bus.kv(S.BUCKET_QUOTAS)
    rows = await kv.history()
    if args.action == "history":
        marks = [(rev, orjson.loads(v)) for k, v, rev, _ in rows if k == S.KEY_QUOTA_CHANGE and v is not None]
        if not marks:
            print("no quota edit recorded")
        for rev, mark in marks:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mark.get("ts", 0)))
            what = ("rollback to revision " + str(mark["rollback_to"]) if "rollback_to" in mark
                    else "; ".join(mark.get("changes") or []))
            print(f"{rev:>6}  {when}  {what}")
        return 0
    plan = quota_plan(rows, quota_target(rows, args.to), bucket_history(S.BUCKET_QUOTAS))
    latest = {k: v for k, v, _, _ in rows}  # the last row of each key wins
    current = {k: v for k, v in latest.items()
               if v is not None and k not in (S.KEY_DYNAMIC_TOTAL, S.KEY_QUOTA_CHANGE)}
    after = {k: v for k, v in current.items() if k not in plan.delete} | plan.put
    quotas_now, _ = _quotas(current)
    quotas_then, problems = _quotas(after)
    if problems:
        raise ValueError(f"the quotas of revision {plan.target} would not apply cleanly: {'; '.join(problems)}")
    for key, value in sorted(plan.put.items()):
        await kv.put(key, value)
    for key in plan.delete:
        await kv.delete(key)
    changes = [f"{n}: {word(a)} -> {word(b)}" for n, a, b in quota_changes(quotas_now, quotas_then)]
    for key in sorted(set(plan.put) | set(plan.delete)):
        if key.startswith(S.SETTING_PREFIX):
            was, now = current.get(key), after.get(key)
            changes.append(f"setting {key[len(S.SETTING_PREFIX):]}: {word(orjson.loads(was)) if was else UNSET} -> "
                           f"{word(orjson.loads(now)) if now else UNSET}")
    await _mark(bus, {"rollback_to": plan.target})
    print(f"quotas rolled back to revision {plan.target}" + ("" if changes else " (nothing differed)"))
    for line in changes:
        print(line)
    return 0


def _quotas(entries: dict[str, bytes]):
    from natsched.admitter.quotas import Quotas

    return Quotas.from_kv(entries)


async def _write(bus, old, new, entries, settings_edited: bool = False, total_given: bool = False) -> int:
    wanted = new.to_kv()
    for key, value in wanted.items():
        if entries.get(key) == value:
            continue
        if key == S.KEY_CLUSTER_TOTAL and key not in entries and not total_given and old.total == new.total:
            continue  # never set: the admitters' admission.default_total applies (writing it would pin it)
        await bus.kv(S.BUCKET_QUOTAS).put(key, value)
    for key in sorted(set(old.to_kv()) - set(wanted)):  # a limit removed (--class-limit -1)
        await bus.kv(S.BUCKET_QUOTAS).delete(key)
    changes = quota_changes(old, new)
    if not changes and not settings_edited:
        print("quotas unchanged")
    for name, was, now in changes:
        print(f"{name}: {word(was)} -> {word(now)}")
    return 0


async def _show(bus, quotas, dynamic, as_json: bool, entries: dict | None = None) -> int:
    import orjson

    from natsched.admitter import knobs as K

    live, _ = K.from_kv(entries or {})
    usage, inflight = await _read_usage(bus)
    credit = usage.credit_by_tenant() if usage else {}
    view = {"total": quotas.total, "hard_cap": quotas.hard_cap, "dynamic_total": dynamic,
            "unknown_tenant": quotas.unknown_tenant, "default_tenant": asdict(quotas.default_tenant),
            "tenants": {t: asdict(q) | {"used": usage.tenants.get(t, 0) if usage else None,
                                        "credit": credit.get(t, 0)}
                        for t, q in sorted(quotas.tenants.items())},
            "models": dict(quotas.models), "queue_limits": dict(quotas.queue_limits),
            "classes": _class_view(quotas, usage),
            "used": usage.used if usage else None, "credit": sum(credit.values()), "settings": live,
            **inflight.to_json()}
    if as_json:
        print(orjson.dumps(view).decode())
        return 0
    print(f"cluster total {view['total']} runtime tokens (hard cap {word(view['hard_cap'])}, dynamic "
          f"{word(dynamic, 'off')}); in use {word(view['used'], 'unknown')}, of which {view['credit']} in "
          "admitters' credit blocks (reserved ahead, spent or not)")
    if inflight.partitions:
        from natsched.ops.status import render_partitions

        print(render_partitions(inflight.partitions) + f" (plan {word(inflight.plan_epoch, 'none')})")
    print(f"{'tenant':<16}{'floor':>8}{'weight':>8}{'cap':>12}{'used':>12}{'credit':>12}")
    for name, t in view["tenants"].items():
        print(f"{name:<16}{t['floor']:>8.2f}{t['weight']:>8.2f}{word(t['cap'], '-'):>12}"
              f"{word(t['used'], 'unknown'):>12}{t['credit']:>12}")
    print(f"{'class':<16}{'limit':>12}{'used':>12}{'borrowed':>18}{'lent':>18}{'queue limit':>14}")
    for name, c in view["classes"].items():
        print(f"{name:<16}{word(c['limit'], '-'):>12}{word(c['used'], 'unknown'):>12}"
              f"{_loan_word(c['borrowed'], c['borrowed_from']):>18}{_loan_word(c['lent'], c['lent_to']):>18}"
              f"{c['queue_limit']:>14}")
    print(f"unknown tenants: {quotas.unknown_tenant}; models: {word(view['models'])}")
    print(f"settings set live: {word(live) if live else 'none'}")
    return 0


def _class_view(quotas, usage) -> dict:
    """Per class: its limit, what it holds (borrowed part included), its loans both ways."""
    out = {}
    loans = usage.loans if usage else {}
    for cls in S.CLASSES:
        frm = {l: n for (b, l), n in sorted(loans.items()) if b == cls}
        to = {b: n for (b, l), n in sorted(loans.items()) if l == cls}
        out[cls] = {"limit": quotas.class_limits.get(cls), "used": usage.cls(cls) if usage else None,
                    "borrowed": sum(frm.values()), "borrowed_from": frm, "lent": sum(to.values()), "lent_to": to,
                    "queue_limit": quotas.queue_limit(cls)}
    return out


def _loan_word(total: int, parts: dict) -> str:
    """``300 (batch)`` or ``0``: the loan and whom it is with."""
    return f"{total} ({', '.join(parts)})" if parts else str(total)
