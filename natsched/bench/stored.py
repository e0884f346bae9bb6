"""``natsched bench stored``: what one request writes to JetStream, stream by stream, and every
message it puts on the wire, by kind.

Why: each stored message is a disk write (an fsync at ``--sync always``), a replication round
on a cluster and a decode at every reader, so the messages a request stores are a floor under
the scheduler's cost per request (issue 27 put it at about 17, acks included). Two counts from
one run of the real services (``natsched bench pipeline``'s harness, NullEngine workers):

- **stored**, per stream, from the server's own stream state: writes are the growth of the
  stream's last sequence (a work queue's or KV bucket's message count shrinks as messages are
  acknowledged or purged; its sequence does not), bytes the growth of what is still kept;
- **on the wire**, per kind of subject, from a core subscription to ``>`` in the benchmark
  process: publishes into streams, KV writes by key kind, the server's deliveries of them to
  consumers and watchers (apart), acks by stream and kind (``+ACK``, ``+WPI`` ...), pull
  requests, replies, and publish acks and API replies on inboxes. Traffic that is not per request (heartbeats, pull-request heartbeats, learned-cost
  records) is measured in an idle window of the same length before the load and subtracted.

Both divided by the requests completed. A request here is allowed at once and runs to its end.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from natsched.bench.pipeline import PipelineRun, drive, run_pipeline
from natsched.bus.connection import Bus
from natsched.wire import subjects as S

#: streams a request never touches here (the benchmark's own reference stream)
IGNORED_STREAMS = (S.STREAM_BENCH,)
SETTLE_S = 1.0  # the counts have settled when no stream grew for this long after the drain
SETTLE_MAX_S = 15.0


def kind_of(subject: str, data: bytes, headers: dict) -> str:
    """The kind of one message on the wire, for the second table: stream subjects by their first
    token (decisions by stage), KV writes by bucket and key kind (purges apart), acks by stream and
    ack kind, JetStream API calls by verb."""
    parts = subject.split(".")
    head = parts[0]
    if head == "$KV" and len(parts) >= 3:
        key = "res" if parts[2] == "res" else parts[2]
        op = headers.get("KV-Operation", "put").lower()
        return f"kv {parts[1]}.{key} {op}"
    if head == "$JS" and len(parts) >= 3 and parts[1] == "ACK":
        ack = data[:4].decode(errors="replace") if data else "+ACK"
        return f"ack {parts[2]} {ack}"
    if head == "$JS" and len(parts) >= 4 and parts[1] == "API":
        verb = "pull" if parts[2:5] == ["CONSUMER", "MSG", "NEXT"] else ".".join(parts[2:4])
        return f"api {verb}"
    if head == "decision" and len(parts) >= 2:
        return f"decision.{parts[1]}"
    if head == "_INBOX":
        return "_INBOX (publish acks, API replies)"
    if head == "bench" and len(parts) >= 2:
        return f"bench.{parts[1]} (replies)" if parts[1] == "resp" else f"bench.{parts[1]}"
    if head == "worker" and len(parts) >= 3:
        return f"worker.*.{parts[2]}"
    return head


class WireCount:
    """Counts every message a ``>`` subscription sees, by :func:`kind_of`, between marks; a
    message JetStream delivers to a consumer (its reply subject is an ack subject) apart from the
    publish that stored it."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    async def on_msg(self, subject: str, data: bytes, headers: dict, reply: str) -> None:
        kind = kind_of(subject, data, headers)
        self.counts[f"{kind} (delivered)" if reply.startswith("$JS.ACK.") else kind] += 1

    def take(self) -> Counter[str]:
        out, self.counts = self.counts, Counter()
        return out


async def _settled(bus: Bus) -> dict[str, dict[str, int]]:
    """The streams' state once nothing has grown for :data:`SETTLE_S` (releases, purges and acks
    follow the final reply), or after :data:`SETTLE_MAX_S`."""
    last, still = await bus.stream_sizes(), time.monotonic()
    deadline = still + SETTLE_MAX_S
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        now = await bus.stream_sizes()
        if {k: v["last_seq"] for k, v in now.items()} != {k: v["last_seq"] for k, v in last.items()}:
            last, still = now, time.monotonic()
        elif time.monotonic() - still >= SETTLE_S:
            break
    return last


def stored_per_stream(before: dict, after: dict, requests: int) -> dict[str, dict[str, float]]:
    """Per stream: writes and kept bytes per request (streams that did not change are left out)."""
    out = {}
    for name in sorted(after):
        if name in IGNORED_STREAMS:
            continue
        b = before.get(name, {"messages": 0, "bytes": 0, "last_seq": 0})
        writes, kept = after[name]["last_seq"] - b["last_seq"], after[name]["bytes"] - b["bytes"]
        if writes:
            out[name] = {"writes": writes / requests, "kept_bytes": kept / requests,
                         "kept": (after[name]["messages"] - b["messages"]) / requests}
    return out


async def count_stored(url: str, run: PipelineRun, pids: dict[str, int] | None = None,
                       admitter_ports: list[int] | None = None) -> dict[str, Any]:
    """A :func:`~natsched.bench.pipeline.drive` run with both counts around it."""
    bus = await Bus.connect(url, name="bench-stored")
    wire = WireCount()
    try:
        sub = await bus.subscribe(">", wire.on_msg, with_reply=True, pending_msgs=1_000_000)
        await bus.flush()
        wire.take()
        t = time.monotonic()
        await asyncio.sleep(run.duration_s)  # the idle baseline: background traffic of that long
        idle, idle_s = wire.take(), time.monotonic() - t
        before = await bus.stream_sizes()
        t = time.monotonic()
        result = await drive(url, run, references=False)
        after = await _settled(bus)
        load, load_s = wire.take(), time.monotonic() - t
        await sub.unsubscribe()
    finally:
        await bus.close()
    done = max(1, result["completed"])
    streams = stored_per_stream(before, after, done)
    scale = load_s / idle_s if idle_s > 0 else 0.0
    on_wire = {}
    for k in sorted(set(load) | set(idle)):
        if k.startswith("api STREAM."):
            continue  # the benchmark's reads of the streams' state
        per = (load[k] - idle[k] * scale) / done
        if per >= 0.005:
            on_wire[k] = per
    return {"requests": result["requests"], "completed": result["completed"], "lost": result["lost"],
            "rate": run.rate, "admitters": run.admitters, "routers": run.routers,
            "inline_routing": run.inline_routing, "credit": run.credit, "streams": streams,
            "stored_writes_per_request": sum(s["writes"] for s in streams.values()),
            "on_wire": on_wire, "on_wire_per_request": sum(on_wire.values())}


def run_stored(run: PipelineRun, nats_url: str | None = None) -> dict[str, Any]:
    return run_pipeline(run, nats_url, driver=count_stored)


def stored_table(res: dict[str, Any]) -> str:
    lines = [f"{'stream':<16}{'writes/req':>11}{'kept/req':>10}{'kept B/req':>12}"]
    for name, s in res["streams"].items():
        lines.append(f"{name:<16}{s['writes']:>11.2f}{s['kept']:>10.2f}{s['kept_bytes']:>12.0f}")
    lines.append(f"{'total':<16}{res['stored_writes_per_request']:>11.2f}")
    lines.append("")
    lines.append(f"{'on the wire, per request':<52}{'msgs':>7}")
    for kind, n in sorted(res["on_wire"].items(), key=lambda kv: -kv[1]):
        lines.append(f"{kind:<52}{n:>7.2f}")
    lines.append(f"{'total':<52}{res['on_wire_per_request']:>7.2f}")
    lines.append(f"({res['completed']} of {res['requests']} requests completed, {res['lost']} lost)")
    return "\n".join(lines)
