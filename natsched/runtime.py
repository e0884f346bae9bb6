"""Entry points of the long-running services: connect, start, announce readiness, stop on a signal.

Each service prints exactly one ``READY <component> ...`` line on stdout when it serves, which
``natsched up`` waits for; logs go to stderr.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Awaitable, Callable

from bus.connection import Bus

log = logging.getLogger(__name__)

READY_PREFIX = "READY "


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("nats").setLevel(logging.WARNING)


def announce(component: str, detail: str = "") -> None:
    print(f"{READY_PREFIX}{component} {detail}".rstrip(), flush=True)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve(
    url: str,
    component: str,
    start: Callable[[Bus], Awaitable[object]],
    stop: Callable[[], Awaitable[None]] | None = None,
    until: Callable[[], Awaitable[None]] | None = None,
    credentials=None,
) -> None:
    """Connect, run ``start(bus)``, announce, then wait for SIGINT/SIGTERM (or ``until``)."""
    bus = await Bus.connect(url, name=component, credentials=credentials)
    try:
        detail = await start(bus)
        announce(component, str(detail or ""))
        waiters = [asyncio.create_task(_wait_for_signal())]
        if until is not None:
            waiters.append(asyncio.create_task(until()))
        done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        log.info("%s stopping", component)
        if stop is not None:
            await stop()
    finally:
        await bus.close()
