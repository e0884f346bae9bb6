"""What a data dir carries from earlier runs that changes behaviour: quotas and the routing config.

A quota or a route canary set once lives in the JetStream data dir and applies to every later
``natsched up`` on it; nothing said so (issue 25). :func:`persisted_notes` reads both buckets and
returns one line per such setting, which ``natsched up`` prints when it starts.
"""

from __future__ import annotations

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
    from natsched.cli.quota import quota_changes, word

    notes = []
    kv = bus.kv(S.BUCKET_QUOTAS)
    entries = {}
    for key in await kv.keys():
        got = await kv.get(key)
        if got is not None and key != S.KEY_DYNAMIC_TOTAL:
            entries[key] = got[0]
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
