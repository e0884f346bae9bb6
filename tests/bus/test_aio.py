"""natsched.bus.aio: the event wait every service loop uses, and the Python 3.11 cancellation race
closed at its source (a reader cancelled as its message arrives is cancelled, the message stays
queued) and at the canceller (a swallowed cancel is sent again)."""

import asyncio

import pytest

from natsched.bus.aio import Mailbox, cancel_and_wait, raise_if_cancelled, wait_event


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


async def test_a_mailbox_reader_cancelled_as_its_message_arrives_is_cancelled_and_loses_nothing():
    box = Mailbox("resp.t.r1", 10)
    for _ in range(200):  # the put and the cancel land in the same loop turn, every time
        reader = asyncio.ensure_future(box.get(5))
        await asyncio.sleep(0)  # the reader waits on the queue
        await box.put("m")
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert await box.get(1) == "m"  # still there for whoever reads next


async def test_wait_for_swallows_that_cancel_on_this_python_so_the_race_is_real():
    """The reason for all this: the same race through ``asyncio.wait_for`` (nats-py's ``next_msg``)."""
    import sys

    queue: asyncio.Queue[str] = asyncio.Queue()
    swallowed = 0
    for _ in range(200):
        reader = asyncio.ensure_future(asyncio.wait_for(queue.get(), 5))
        await asyncio.sleep(0)
        queue.put_nowait("m")
        await asyncio.sleep(0)  # wait_for's inner get completes; the outer has not resumed yet
        reader.cancel()
        try:
            await reader
            swallowed += 1
        except asyncio.CancelledError:
            queue.get_nowait()
    if sys.version_info < (3, 12):
        assert swallowed > 0
    else:
        assert swallowed == 0


async def test_cancel_and_wait_cancels_again_until_the_task_ends():
    swallowed = asyncio.Event()

    async def stubborn() -> None:  # swallows the first cancel, as a wait_for that just finished does
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(3600)  # the second cancel ends it

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, every_s=0.01), 10)
    assert swallowed.is_set() and task.cancelled()


async def test_a_loop_that_checks_each_turn_ends_after_a_swallowed_cancel():
    """``natsched status --watch`` once redrew on after Ctrl-C: its one cancel was swallowed by a
    KV read below it. A swallowed cancel still counts in ``Task.cancelling()``."""
    turns = 0
    swallowed = asyncio.Event()

    async def watch() -> None:
        nonlocal turns
        while True:
            turns += 1
            try:
                await asyncio.sleep(3600)  # a read that swallows the cancel it meets, once
            except asyncio.CancelledError:
                if swallowed.is_set():
                    raise
                swallowed.set()
            raise_if_cancelled()

    task = asyncio.ensure_future(watch())
    await asyncio.sleep(0)
    task.cancel()  # once, as asyncio.run does on the first Ctrl-C
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert swallowed.is_set() and turns == 1
