"""``natsched status``: the cluster view (:mod:`natsched.gateway.status`) as a terminal page, once or redrawn."""

from __future__ import annotations

import asyncio
import sys
import time

import orjson

from natsched.admitter.inflight import PartitionUsage
from natsched.gateway.status import StatusCollector, StatusSettings, StatusView
from natsched.bus.aio import raise_if_cancelled
from natsched.bus.connection import Bus
from natsched.wire import subjects as S
from natsched.wire.errors import MessageError
from natsched.wire.schema import ScaleEvent

#: a scaling signal older than this is shown as past advice, not as what holds now
SCALE_FRESH_S = 300.0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render_scale(event: ScaleEvent | None, now: float) -> str:
    """The latest scaling signal in one line (``natsched.admitter.scaling``)."""
    if event is None:
        return "SCALING  no signal yet"
    age = now - event.ts
    advice = f"add {event.add} worker(s)" if event.kind == "out" else f"drain {event.drain}"
    when = f"{age:.0f}s ago" + ("" if age < SCALE_FRESH_S else ", no longer current")
    return f"SCALING  scale {event.kind}: {advice} ({when}, {event.workers} workers, by {event.by}): {event.reason}"


async def read_scale(bus: Bus) -> ScaleEvent | None:
    """The latest scaling signal the admitters kept in KV ``config`` (None: none, or unreadable)."""
    got = await bus.kv(S.BUCKET_CONFIG).get(S.KEY_SCALE)
    if got is None:
        return None
    try:
        return ScaleEvent.decode(got[0])
    except MessageError:
        return None


def render_partitions(rows: list[PartitionUsage]) -> str:
    """Each partition's use of its budget in one line (partitioned admission only)."""
    def one(p: PartitionUsage) -> str:
        if p.budget is None:
            return f"p{p.partition} {p.used}/- (no plan)"
        return f"p{p.partition} {p.used}/{p.budget} ({_pct(p.used / p.budget if p.budget else None)})"
    return f"PARTITIONS ({len(rows)}, used/budget)  " + "   ".join(one(p) for p in rows)


def render_text(view: StatusView, scale: ScaleEvent | None = None) -> str:
    """A plain-text page: one table per section, widths fixed so ``--watch`` does not jump."""
    out = [f"natsched status  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(view.at))}   "
           f"in use {view.used} of {view.total} runtime tokens ({_pct(view.used / view.total if view.total else None)})"]
    out.append("")
    out.append(f"WORKERS ({len(view.workers)})")
    out.append(f"  {'worker':<16}{'state':<11}{'model':<16}{'run':>5}{'wait':>6}{'load':>7}{'kv':>7}"
               f"{'hit':>7}{'hb age':>9}{'prefill/s':>11}")
    for w in view.workers:
        tps = "-" if w.prefill_tps is None else f"{w.prefill_tps:,.0f}"
        out.append(f"  {w.id[:15]:<16}{w.state:<11}{w.model[:15]:<16}{w.running:>5}{w.waiting:>6}"
                   f"{_pct(w.load):>7}{_pct(w.kv_use):>7}{_pct(w.hit_ratio):>7}{w.heartbeat_age_s:>8.1f}s{tps:>11}")
    if not view.workers:
        out.append("  (no worker heartbeats)")
    out.append("")
    out.append(f"TENANTS ({len(view.tenants)})")
    out.append(f"  {'tenant':<16}{'floor':>14}{'usage':>12}{'cap':>12}")
    for t in view.tenants:
        floor = f"{t.floor_tokens} ({_pct(t.floor_share)})"
        name = t.tenant[:15] + ("" if t.configured else "*")
        out.append(f"  {name:<16}{floor:>14}{t.used:>12}{'-' if t.cap is None else t.cap:>12}")
    if not view.tenants:
        out.append("  (no quotas set and nothing in flight)")
    elif any(not t.configured for t in view.tenants):
        out.append("  * on the default quota")
    out.append("")
    if view.partitions:
        out.append(render_partitions(view.partitions))
        out.append("")
    out.append("QUEUES  " + "   ".join(f"{q.cls} {q.depth}/{q.limit}" for q in view.queues))
    out.append("")
    window = f"{view.window_s / 60:.0f} min" if view.window_s >= 60 else f"{view.window_s:.0f} s"
    if view.rejections:
        out.append(f"REJECTIONS (last {window})  " + "   ".join(f"{r} {n}" for r, n in view.rejections.items()))
    else:
        out.append(f"REJECTIONS (last {window})  none")
    out.append("")
    out.append(render_scale(scale, view.at))
    for warning in view.warnings:
        out.append(f"warning: {warning}")
    return "\n".join(out) + "\n"


async def run_status(bus: Bus, settings: StatusSettings, watch_s: float | None = None, as_json: bool = False) -> int:
    """``natsched status`` on a connected bus: print the view once (text or JSON), or redraw it every
    ``watch_s`` seconds until cancelled. Closes the bus."""
    try:
        collector = StatusCollector(bus, settings)
        await collector.start()
        await asyncio.sleep(settings.listen_s)  # every worker's heartbeat, at 1-2 s intervals
        while True:
            view = await collector.snapshot()
            scale = await read_scale(bus)
            if as_json:
                data = orjson.loads(view.to_json())
                data["scale"] = scale.to_wire() if scale is not None else None
                sys.stdout.write(orjson.dumps(data).decode() + "\n")
                return 0
            if watch_s is None:
                sys.stdout.write(render_text(view, scale))
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + render_text(view, scale))
            sys.stdout.flush()
            raise_if_cancelled()  # a Ctrl-C that a KV read below swallowed
            await asyncio.sleep(watch_s)
    finally:
        await bus.close()
