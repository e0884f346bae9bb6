"""The benchmarks' process pool (natsched.sim.pool): clean children, the parent's state and log levels."""

from __future__ import annotations

import logging
import threading

from natsched.sim.pool import make_pool, start_method

_HELD = threading.Lock()  # held by a thread of the parent while the pool runs
_GIVEN: dict[str, object] = {}


def _given(value: object) -> None:
    _GIVEN["value"] = value


def _child_view(_: int) -> tuple[bool, object, int]:
    """In a child: can it take the lock the parent's thread holds, what did the initializer give, the level."""
    free = _HELD.acquire(timeout=5)
    if free:
        _HELD.release()
    return free, _GIVEN.get("value"), logging.getLogger("natsched.router").level


def test_children_hold_no_lock_a_thread_of_the_parent_held():
    """A forked child would inherit the held lock and wait out the timeout (a hang without one)."""
    assert start_method() != "fork"
    router = logging.getLogger("natsched.router")
    saved = router.level
    router.setLevel(logging.ERROR)
    hold, release = threading.Event(), threading.Event()

    def holder() -> None:
        with _HELD:
            hold.set()
            release.wait()

    t = threading.Thread(target=holder)
    t.start()
    hold.wait()
    try:
        with make_pool(2, _given, ({"tenants": 4},), loggers=["natsched.router"]) as pool:
            views = pool.map(_child_view, range(2))
    finally:
        release.set()
        t.join()
        router.setLevel(saved)
    assert views == [(True, {"tenants": 4}, logging.ERROR)] * 2
