"""``natsched status``: the cluster view (:mod:`natsched.gateway.status`) as a terminal page, once or redrawn."""

from __future__ import annotations

import asyncio
import sys
import time

from natsched.gateway.status import StatusCollector, StatusSettings, StatusView
from natsched.bus.connection import Bus


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render_text(view: StatusView) -> str:
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
    out.append("QUEUES  " + "   ".join(f"{q.cls} {q.depth}/{q.limit}" for q in view.queues))
    out.append("")
    window = f"{view.window_s / 60:.0f} min" if view.window_s >= 60 else f"{view.window_s:.0f} s"
    if view.rejections:
        out.append(f"REJECTIONS (last {window})  " + "   ".join(f"{r} {n}" for r, n in view.rejections.items()))
    else:
        out.append(f"REJECTIONS (last {window})  none")
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
            if as_json:
                sys.stdout.write(view.to_json().decode() + "\n")
                return 0
            if watch_s is None:
                sys.stdout.write(render_text(view))
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + render_text(view))
            sys.stdout.flush()
            await asyncio.sleep(watch_s)
    finally:
        await bus.close()
