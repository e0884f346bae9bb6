"""Service entry points: the startup heap is frozen out of garbage collection before READY."""

from __future__ import annotations

import gc
import weakref

from natsched.hosting import runtime


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector can free it


def test_freeze_keeps_the_live_heap_out_of_collections_and_still_collects_later_garbage():
    kept = _Node()
    tracked = lambda obj: any(o is obj for o in gc.get_objects())  # noqa: E731 (the frozen are not listed)
    assert tracked(kept)
    before = gc.get_freeze_count()
    try:
        frozen = runtime.freeze_startup_heap()
        assert frozen > before  # (other threads of this process may free frozen objects at any time)
        assert not tracked(kept)  # no collection walks it any more
        # what is allocated afterwards is collected as before: a dropped cycle goes at the next pass
        later = _Node()
        alive = weakref.ref(later)
        del later
        gc.collect()
        assert alive() is None
        # a collection freezes nothing more (reference counting may free a frozen object meanwhile)
        assert gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()  # give the test process its collector back


async def test_serve_freezes_after_start_and_before_it_announces(nats_url, monkeypatch):
    events: list[str] = []

    async def start(bus) -> str:
        events.append("start")
        return "probe"

    async def until() -> None:
        events.append("serving")

    monkeypatch.setattr(runtime, "freeze_startup_heap", lambda: events.append("freeze") or 0)
    monkeypatch.setattr(runtime, "announce", lambda component, detail="": events.append(f"announce {detail}"))
    await runtime.serve(nats_url, "probe", start, until=until)
    assert events == ["start", "freeze", "announce probe", "serving"]
