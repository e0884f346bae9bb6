"""``/status``: the ``natsched status`` view as an HTML page that reloads itself.

Plain server-rendered HTML with a ``<meta http-equiv="refresh">``: no script, no assets, so it
works in any browser, behind any proxy, and reads the same in a text browser. Every value is
escaped (tenant and worker ids are subject tokens, but the page must not trust that).
"""

from __future__ import annotations

import html
import time

from natsched.gateway.status import StatusView

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .2em} h2{font-size:1.05em;margin:1.4em 0 .4em}
table{border-collapse:collapse} th,td{padding:.25em .8em;text-align:right;border-bottom:1px solid #ddd}
th:first-child,td:first-child{text-align:left} th{background:#f4f4f4}
.healthy{color:#11772d} .backoff{color:#b36b00} .quiescing,.reregister{color:#555} .stale{color:#b00020}
.muted{color:#777} .bar{display:inline-block;height:.6em;background:#4a7bd0;vertical-align:middle}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def render_html(view: StatusView, refresh_s: float = 2.0) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view.at))
    share = view.used / view.total if view.total else None
    out = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f'<meta http-equiv="refresh" content="{max(1, round(refresh_s))}">',
        "<title>natsched status</title>", f"<style>{_STYLE}</style></head><body>",
        "<h1>natsched status</h1>",
        f'<p class=muted id=summary>{_e(when)} · in use <b>{view.used}</b> of <b>{view.total}</b> runtime tokens '
        f"({_pct(share)}) · refreshes every {max(1, round(refresh_s))} s</p>",
    ]
    if view.partitions:  # partitioned admission: each partition's use of its budget
        out.append(f"<h2>Partitions ({len(view.partitions)})</h2>")
        out.append("<table id=partitions><tr><th>partition</th><th>in use</th><th>budget</th><th>share</th></tr>")
        for p in view.partitions:
            budget = "–" if p.budget is None else p.budget
            used_share = _pct(p.used / p.budget) if p.budget else "–"
            out.append(f"<tr><td>{p.partition}</td><td>{p.used}</td><td>{budget}</td><td>{used_share}</td></tr>")
        out.append("</table>")
    out.append(f"<h2>Workers ({len(view.workers)})</h2>")
    if view.workers:
        out.append("<table id=workers><tr><th>worker</th><th>state</th><th>model</th><th>running</th>"
                   "<th>waiting</th><th>load</th><th>KV use</th><th>hit ratio</th><th>heartbeat age</th></tr>")
        for w in view.workers:
            out.append(
                f"<tr><td>{_e(w.id)}</td><td class={_e(w.state)}>{_e(w.state)}</td><td>{_e(w.model)}</td>"
                f"<td>{w.running}</td><td>{w.waiting}</td><td>{_pct(w.load)}</td><td>{_pct(w.kv_use)}</td>"
                f"<td>{_pct(w.hit_ratio)}</td><td>{w.heartbeat_age_s:.1f} s</td></tr>")
        out.append("</table>")
    else:
        out.append("<p id=workers class=muted>No worker heartbeats.</p>")
    out.append(f"<h2>Tenants ({len(view.tenants)})</h2>")
    if view.tenants:
        out.append("<table id=tenants><tr><th>tenant</th><th>floor</th><th>usage</th><th>cap</th><th></th></tr>")
        for t in view.tenants:
            top = t.cap or max(t.floor_tokens, t.used, 1)
            width = min(100, round(100 * t.used / top)) if top else 0
            note = "" if t.configured else " <span class=muted>(default quota)</span>"
            out.append(
                f"<tr><td>{_e(t.tenant)}{note}</td><td>{t.floor_tokens} ({_pct(t.floor_share)})</td>"
                f"<td>{t.used}</td><td>{'–' if t.cap is None else t.cap}</td>"
                f'<td style="text-align:left;width:8em"><span class=bar style="width:{width}%"></span></td></tr>')
        out.append("</table>")
    else:
        out.append("<p id=tenants class=muted>No quotas set and nothing in flight.</p>")
    out.append("<h2>Queues</h2><table id=queues><tr><th>class</th><th>queued</th><th>limit</th></tr>")
    for q in view.queues:
        out.append(f"<tr><td>{_e(q.cls)}</td><td>{q.depth}</td><td>{q.limit}</td></tr>")
    out.append("</table>")
    window = f"{view.window_s / 60:.0f} min" if view.window_s >= 60 else f"{view.window_s:.0f} s"
    out.append(f"<h2>Rejections (last {_e(window)})</h2>")
    if view.rejections:
        out.append("<table id=rejections><tr><th>reason</th><th>count</th></tr>")
        for reason, n in view.rejections.items():
            out.append(f"<tr><td>{_e(reason)}</td><td>{n}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p id=rejections class=muted>None.</p>")
    for warning in view.warnings:
        out.append(f"<p class=stale>warning: {_e(warning)}</p>")
    out.append("</body></html>")
    return "\n".join(out)
