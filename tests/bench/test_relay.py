"""The pipeline benchmark's floor relay on a real server: good requests reach a worker, bad input
is dead-lettered like the admitter does it, nothing is left unacked."""

from __future__ import annotations

import asyncio

import pytest

from natsched.wire import subjects as S
from natsched.wire.schema import Assignment, DeadLetter
from natsched.bench.relay import Relay
from tests.factories.core import make_request, wait_for


async def test_requests_go_round_robin_to_the_workers_and_bad_input_is_dead_lettered(bus):
    work: list[Assignment] = []
    dead: list[tuple[str, DeadLetter]] = []

    async def on_work(subject: str, data: bytes, headers: dict) -> None:
        work.append(Assignment.decode(data))

    async def on_dead(subject: str, data: bytes, headers: dict) -> None:
        dead.append((subject, DeadLetter.decode(data)))

    await bus.subscribe(S.WORK_ALL, on_work)
    await bus.subscribe(S.DEADLETTER_ALL, on_dead)
    relay = Relay(bus, ["w1", "w2"])
    await relay.start()
    requests = [make_request("t1") for _ in range(4)]
    for r in requests:
        await bus.jpublish(S.request(S.ONLINE, "t1"), r, msg_id=r.id)
    await bus.jpublish(S.request(S.ONLINE, "t1"), b"\x00not a request", msg_id="garbage-1")
    assert await wait_for(lambda: len(work) == 4 and len(dead) == 1)
    assert [a.request.id for a in work] == [r.id for r in requests]
    assert [a.worker for a in work] == ["w1", "w2", "w1", "w2"]
    assert all(a.policy == "relay" and a.routed_at >= a.admitted_at > 0 for a in work)
    subject, letter = dead[0]
    assert subject.endswith(".relay") and letter.subject == S.request(S.ONLINE, "t1") and letter.reason

    async def settled() -> bool:  # every request acked or terminated: nothing will come back
        info = await bus.stream(S.STREAM_REQUESTS).consumer(S.CONSUMER_ADMITTER)
        return info.ack_pending == 0 and info.pending == 0

    for _ in range(50):
        if await settled():
            break
        await asyncio.sleep(0.1)
    assert await settled()


def test_a_relay_needs_a_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        Relay(None, [])  # type: ignore[arg-type]
