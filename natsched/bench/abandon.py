"""Clients that leave, and what the cluster spends on them: the chaos benchmark's disconnects.

Two kinds of producer give up on long requests (``max_tokens`` in the thousands), spread over
the run beside the chaos load and its kills:

- **streams**: read the first chunk of a streamed request, then close the stream;
- **waiting**: submit, and leave as soon as their request is queued, admitted or routed (its
  first status on the reply subject), before any output.

What is counted, per abandoned request, from its completion record (``done.<tenant>``, the
tokens the worker really produced, cancelled or not):

- ``for_nobody`` = produced − read by the client: every token generated and never read, those
  already on their way (or waiting in the client's buffer) when it left included;
- ``after_leaving`` = produced − delivered to the client's connection by the moment it left:
  what was generated after the client was gone, i.e. while its cancel travelled;
- ``beyond_one_step`` = ``after_leaving`` − 1: an engine step already under way when the cancel
  arrived is unavoidable (the sim and vLLM produce one token per sequence per step).

The targets: ``beyond_one_step`` summed over all abandoned requests is 0, and every abandoned
request is accounted for: a completion (cancelled, or finished) or a final refusal (a cancel
that reached the admitter first). ``ran_to_end`` counts those that finished for nobody.

The reply subjects are watched with the benchmark's own subscription (``resp.<tenant>.>``, core
NATS): the producer's ``Client`` is used as any producer would use it.

``natsched chaos`` runs these clients in a process of their own (:func:`run_child`): a producer
is its own process, and in the chaos driver's process, which decodes every reply and assignment
of the run to check it, a client's "left" and its cancel waited behind that work. Tokens the
engine made meanwhile were counted as made after leaving, though the client had not left yet as
far as the cluster could know: the count measured the observer, not the cancel path.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from natsched.bus.connection import Bus
from natsched.client.producer import Client, Timeouts, make_request
from natsched.errors import NatschedError
from natsched.wire import subjects as S
from natsched.wire.errors import MessageError
from natsched.wire.schema import Completion, Reply, ReplyKind

log = logging.getLogger(__name__)

STREAMS, WAITING = "streams", "waiting"


@dataclass
class AbandonSettings:
    streams: int = 30  # clients that leave a stream after its first chunk
    waiting: int = 30  # clients that leave before any output
    max_tokens: int = 3000  # long enough that a lost cancel shows (thousands of tokens for nobody)
    tenant: str = "chaos-abandon"
    spread_s: float = 20.0  # the clients start at seeded moments over this long
    seed: int = 1
    settle_timeout_s: float = 60.0  # after the last client left: every abandoned request accounted for


@dataclass
class _Seen:
    """One abandoned request, as its reply subject and the completions showed it."""

    kind: str
    received: int = 0  # tokens the client had read when it left
    delivered: int = 0  # tokens that had reached the client's connection when it left
    arrived: int = 0  # tokens seen on the reply subject so far
    left_after: str | None = None  # the last status it saw: queued / admitted / assigned / token
    first_status: asyncio.Event = field(default_factory=asyncio.Event)
    refused: str | None = None  # a final error reply (e.g. rejected: cancelled)
    completion: Completion | None = None


def summarise(seen: dict[str, _Seen]) -> dict[str, Any]:
    """The report from what was seen (pure: tested on its own)."""
    out: dict[str, Any] = {}
    for kind in (STREAMS, WAITING):
        mine = {rid: s for rid, s in seen.items() if s.kind == kind}
        done = [s for s in mine.values() if s.completion is not None]
        for_nobody = [max(0, s.completion.output_tokens - s.received) for s in done]
        after = [max(0, s.completion.output_tokens - max(s.received, s.delivered)) for s in done]
        beyond = [max(0, n - 1) for n in after]
        # the split the worker reports: how long each cancel travelled, and what ran after it arrived
        transit = sorted(s.completion.cancel_transit_s for s in done if s.completion.cancel_transit_s is not None)
        at_worker = [s.completion.tokens_after_cancel or 0 for s in done]
        out[kind] = {
            "clients": len(mine),
            "left_while": _count(s.left_after for s in mine.values()),
            "cancelled": sum(1 for s in done if s.completion.reason == "cancelled"),
            "refused_before_admission": sum(1 for s in mine.values() if s.completion is None and s.refused),
            "ran_to_end": sum(1 for s in done if s.completion.status == "ok"),
            "tokens_for_nobody": sum(for_nobody),
            "tokens_after_leaving": sum(after),
            "tokens_beyond_one_step": sum(beyond),
            "max_beyond_one_step": max(beyond, default=0),
            "tokens_after_cancel_reached_worker": sum(at_worker),
            "cancel_transit_p50_s": round(transit[len(transit) // 2], 4) if transit else None,
            "cancel_transit_max_s": round(transit[-1], 4) if transit else None,
            "unaccounted": sum(1 for s in mine.values() if s.completion is None and not s.refused),
        }
    beyond_all = sum(out[k]["tokens_beyond_one_step"] for k in (STREAMS, WAITING))
    unaccounted = sum(out[k]["unaccounted"] for k in (STREAMS, WAITING))
    out["targets"] = {"abandoned_tokens_beyond_one_step": beyond_all == 0, "abandoned_unaccounted": unaccounted == 0}
    return out


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[v or "nothing"] = counts.get(v or "nothing", 0) + 1
    return counts


class Abandoners:
    """Run the leaving clients against the cluster at ``url`` (see the module docstring)."""

    def __init__(self, url: str, settings: AbandonSettings) -> None:
        self.url = url
        self.s = settings
        self.seen: dict[str, _Seen] = {}

    async def run(self) -> dict[str, Any]:
        s = self.s
        bus = await Bus.connect(self.url, name="chaos-abandon", connect_budget_s=30, publish_budget_s=30)
        try:
            await bus.subscribe(f"resp.{S.token(s.tenant, 'tenant')}.>", self._on_reply)
            await bus.subscribe(S.completions_of(s.tenant), self._on_completion)
            client = Client(bus, Timeouts(publish=30, admission=60, queued=600, idle=60))
            rng = random.Random(s.seed)
            kinds = [STREAMS] * s.streams + [WAITING] * s.waiting
            rng.shuffle(kinds)
            starts = sorted(rng.uniform(0, s.spread_s) for _ in kinds)
            t0 = time.monotonic()
            await asyncio.gather(*(self._client(client, kind, i, t0 + at) for i, (kind, at)
                                   in enumerate(zip(kinds, starts))))
            await self._settle()
        finally:
            await bus.close()
        return summarise(self.seen)

    async def _client(self, client: Client, kind: str, i: int, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        request = make_request(self.s.tenant, f"abandoned request {i}: tell a very long story. ",
                               max_tokens=self.s.max_tokens)
        seen = self.seen[request.id] = _Seen(kind)
        try:
            if kind == STREAMS:
                stream = client.stream(request).__aiter__()
                await stream.__anext__()
                seen.received, seen.left_after, seen.delivered = 1, "token", seen.arrived
                await stream.aclose()  # the client is gone: its cancel goes out
            else:
                task = asyncio.create_task(client.submit(request))
                waiter = asyncio.create_task(seen.first_status.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                seen.delivered = seen.arrived
                task.cancel()  # it leaves in whatever state it is: queued, admitted or routed
                await asyncio.gather(task, return_exceptions=True)
        except (NatschedError, StopAsyncIteration) as exc:  # refused or failed before it could leave
            seen.refused = seen.refused or f"client: {type(exc).__name__}"

    async def _settle(self) -> None:
        deadline = time.monotonic() + self.s.settle_timeout_s
        while time.monotonic() < deadline:
            if all(s.completion is not None or s.refused for s in self.seen.values()):
                return
            await asyncio.sleep(0.1)

    def _seen(self, schema: Any, data: bytes) -> tuple[Any, _Seen | None]:
        """(the decoded message, what was seen of its request), or (None, None): not one of ours."""
        try:
            msg = schema.decode(data)
        except MessageError:
            return None, None
        return msg, self.seen.get(msg.request_id)

    async def _on_reply(self, subject: str, data: bytes, headers: dict) -> None:
        reply, seen = self._seen(Reply, data)
        if seen is None:
            return
        if reply.kind == ReplyKind.STATUS and reply.status is not None and not seen.first_status.is_set():
            seen.left_after = str(reply.status)
            seen.first_status.set()
        elif reply.kind == ReplyKind.TOKEN:
            seen.arrived += len(reply.token_ids) if reply.token_ids else 1
            if not seen.first_status.is_set():
                seen.left_after = "token"
                seen.first_status.set()
        elif reply.kind == ReplyKind.ERROR and reply.final:
            seen.refused = f"{reply.status}: {reply.reason}"

    async def _on_completion(self, subject: str, data: bytes, headers: dict) -> None:
        c, seen = self._seen(Completion, data)
        if seen is not None and seen.completion is None:
            seen.completion = c


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def format_abandon(report: dict[str, Any]) -> list[str]:
    """Lines for the chaos table: one per kind of leaving client."""
    lines = ["clients that left | clients | cancelled | refused first | ran to end | tokens never read | "
             "after leaving | beyond one step (max) | unaccounted | after the cancel reached the worker | "
             "cancel transit p50 / max"]
    for kind in (STREAMS, WAITING):
        r = report[kind]
        lines.append(f"{kind} | {r['clients']} | {r['cancelled']} | {r['refused_before_admission']} | "
                     f"{r['ran_to_end']} | {r['tokens_for_nobody']} | {r['tokens_after_leaving']} | {r['tokens_beyond_one_step']} "
                     f"({r['max_beyond_one_step']}) | {r['unaccounted']} | {r.get('tokens_after_cancel_reached_worker', '-')} | "
                     f"{_s(r.get('cancel_transit_p50_s'))} / {_s(r.get('cancel_transit_max_s'))}")
    return lines


async def run_child(url: str, settings: AbandonSettings, timeout_s: float) -> dict[str, Any]:
    """:class:`Abandoners` in a child process (``python -m natsched.bench.abandon``): its report,
    read from the child's stdout (one JSON line); a child that fails or hangs raises."""
    import orjson

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "natsched.bench.abandon", url, orjson.dumps(dataclasses.asdict(settings)).decode(),
        stdout=subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"the disconnecting clients' process exited {proc.returncode}")
    return orjson.loads(out.splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """``python -m natsched.bench.abandon URL SETTINGS_JSON``: run, print the report as JSON."""
    import orjson

    ap = argparse.ArgumentParser(prog="python -m natsched.bench.abandon", description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("settings", help="AbandonSettings as a JSON object")
    args = ap.parse_args(argv)
    from natsched.hosting.runtime import run_loop  # uvloop, as the services run

    settings = AbandonSettings(**orjson.loads(args.settings))
    report = run_loop(Abandoners(args.url, settings).run())
    sys.stdout.write(orjson.dumps(report).decode() + "\n")


if __name__ == "__main__":
    sys.exit(main())
