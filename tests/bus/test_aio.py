"""natsched.bus.aio.wait_event: the event wait every service loop uses."""

import asyncio

from natsched.bus.aio import wait_event


async def test_wait_event_says_whether_the_event_came():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5) is True
    assert await wait_event(event, None) is True  # already set: no bound needed


async def test_a_cancel_in_the_same_turn_as_the_event_ends_the_loop():
    """Python 3.11's ``wait_for(event.wait(), t)`` returned here instead of raising, so the loop
    went on after its service was closed."""
    event = asyncio.Event()
    turns = 0

    async def service_loop():
        nonlocal turns
        while True:
            await wait_event(event, 10)
            event.clear()
            turns += 1

    task = asyncio.create_task(service_loop())
    await asyncio.sleep(0)  # the loop waits on the event
    event.set()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert task in done and task.cancelled() and turns == 0
