"""Small asyncio helpers the services' loops share.

Why not ``asyncio.wait_for(event.wait(), t)``: on Python 3.11 it swallows a cancellation that
arrives in the same loop turn as the event (it returns the result instead of raising). A loop
around it then never ends: ``Bus.close`` waited its whole budget for such a task, which kept
running afterwards. ``asyncio.timeout`` counts cancellations and passes this one on; it also
costs no extra task per wait.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """True when ``event`` is set within ``timeout`` seconds (None: no bound), False otherwise."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
