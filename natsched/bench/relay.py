"""The floor of the pipeline benchmark: a bare relay where the admitter would be.

``natsched bench pipeline --floor`` runs the same load, workers and measurement with this
process in the admitter's place. It pulls REQUESTS on the admitter's durable consumer, sends
each request to the next worker's WORK subject (round robin; one publish batch per pulled
batch, one wait for the acks) and acks what it pulled — no quota, no usage commit, no records,
no statuses, no release. Two stored JetStream hops in Python and nothing else: what any design
on this bus, this client and this machine pays before it decides anything. The distance from
here to the real pipeline's numbers is the scheduler's own work.

Run by the benchmark as ``python -m natsched.bench.relay URL WORKER [WORKER ...]``; it prints
``ready`` once its consumer is bound and runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time

from natsched.wire import subjects as S
from natsched.wire import msgids as M
from natsched.bus.connection import Bus, ConsumerSpec, Delivery
from natsched.wire.errors import MessageError
from natsched.wire.schema import Assignment, Request


class Relay:
    """Requests in, assignments out, round robin over ``workers``."""

    def __init__(self, bus: Bus, workers: list[str], batch: int = 256) -> None:
        if not workers:
            raise ValueError("the relay needs at least one worker to send to")
        self.bus = bus
        self._next = itertools.cycle(workers)
        self.spec = ConsumerSpec(S.STREAM_REQUESTS, S.CONSUMER_ADMITTER, S.REQUESTS_ALL, batch=batch)

    async def start(self) -> None:
        """Bind the admitter's consumer and relay from now on (the streams exist: the benchmark's
        system provisioned them before anything started)."""
        await self.bus.consume_batches(self.spec, self.on_batch, source="relay")

    async def on_batch(self, batch: list[Delivery]) -> None:
        out, relayed = [], []
        for d in batch:
            try:
                request = Request.decode(d.data)
            except MessageError as exc:  # as the admitter does: error reply, dead letter, term
                await self.bus.settle_failed(d, self.spec, "relay", exc)
                continue
            now = time.time()
            a = Assignment(request=request, worker=next(self._next), runtime_tokens=0, admitted_at=now,
                           routed_at=now, policy="relay")
            out.append((S.work(a.worker), a, M.work(request.id), None))
            relayed.append(d)
        await self.bus.jpublish_batch(out)
        await asyncio.gather(*(d.ack() for d in relayed))


async def _main(url: str, workers: list[str]) -> None:
    bus = await Bus.connect(url, name="bench-relay")
    try:
        await Relay(bus, workers).start()
        print("ready", flush=True)
        await asyncio.Event().wait()
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m natsched.bench.relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("workers", nargs="+")
    args = ap.parse_args(argv)
    from natsched.hosting.runtime import run_loop  # uvloop, as the services run

    run_loop(_main(args.url, args.workers))


if __name__ == "__main__":
    sys.exit(main())
