"""What a data dir carries from earlier runs that changes behaviour: quotas and the routing config.

A quota or a route canary set once lives in the JetStream data dir and applies to every later
``natsched up`` on it; nothing said so (issue 25). :func:`persisted_notes` reads both buckets and
returns one line per such setting, which ``natsched up`` prints when it starts.
"""

from __future__ import annotations

from typing import Any

import orjson

from natsched.wire import subjects as S


def describe_route(config: dict) -> str:
    """A routing config in one line for people: policy, its weights, the canary and its share."""
    weights = config.get("weights") or {}
    text = f"policy {config.get('policy')}"
    if weights:
        text += " (weights " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in sorted(weights.items())) + ")"
    if config.get("canary"):
        text += f"; canary {config['canary']} on {float(config.get('canary_share') or 0):.0%} of requests"
    else:
        text += "; no canary"
    return text


async def persisted_notes(bus) -> list[str]:
    """One line per stored setting that differs from a fresh start (empty for a new data dir)."""
    from natsched.admitter.quotas import Quotas

    notes = []
    entries = {key: value for key, (value, _rev) in (await bus.kv(S.BUCKET_QUOTAS).snapshot()).items()
               if key != S.KEY_DYNAMIC_TOTAL}
    if entries:
        stored, _errors = Quotas.from_kv(entries)
        changed = quota_changes(Quotas(), stored)
        if changed:
            what = "; ".join(f"{name} {word(now)}" for name, _was, now in changed)
            notes.append(f"quotas set earlier apply: {what} (natsched quota show / quota rollback)")
        from natsched.admitter.knobs import from_kv

        live, _ = from_kv(entries)
        if live:
            notes.append(f"settings set live earlier apply: {word(live)} (natsched quota show / quota set --unset)")
    route = await bus.kv(S.BUCKET_CONFIG).get(S.KEY_ROUTER_CONFIG)
    if route is not None:
        try:
            config = orjson.loads(route[0])
        except orjson.JSONDecodeError:
            config = None
        if isinstance(config, dict):
            live = "a route canary is live" if config.get("canary") else "a routing config set earlier applies"
            notes.append(f"{live}: {describe_route(config)} (natsched route show / route rollback)")
    return notes


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
    for label, before, after in (("model", old.models, new.models),
                                 ("queue limit", old.queue_limits, new.queue_limits),
                                 ("class limit", old.class_limits, new.class_limits)):
        for key in sorted(set(before) | set(after)):
            out.append((f"{label} {key}", before.get(key, UNSET), after.get(key, UNSET)))
    return [(name, a, b) for name, a, b in out if a != b]
