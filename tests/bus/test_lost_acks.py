"""An ack lost on its way to the server (a NATS node dies, a leader is elected) brings the message
back after the ack wait. Nothing may run or be reserved twice because of it.

Losing one particular ack on demand is the one thing a real server cannot be asked to do, so
``lose_first_ack`` drops that single ack in the client (every other part is real).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from natsched.wire import subjects as S
from natsched.bus.connection import Bus, Delivery
from natsched.wire.schema import Admitted, Assignment, Completion
from tests.factories.core import make_completion, make_request, wait_for
from tests.admitter.test_service import start_admitter, stop
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.nullengine import NullEngine


@pytest.fixture
def lose_first_ack(monkeypatch):
    """``lost = lose_first_ack(subject_prefix, request_id)``: that message's first ack never leaves."""
    targets: dict[tuple[str, str], list[int]] = {}
    real_ack = Delivery.ack

    async def ack(self: Delivery) -> None:
        for (prefix, rid), lost in targets.items():
            if self.subject.startswith(prefix) and rid.encode() in self.data and not lost:
                lost.append(1)
                self.settled = True
                return
        await real_ack(self)

    monkeypatch.setattr(Delivery, "ack", ack)

    def arm(prefix: str, rid: str) -> list[int]:
        return targets.setdefault((prefix, rid), [])

    return arm


async def test_a_request_redelivered_after_its_completion_is_not_admitted_again(bus, nats_url, lose_first_ack):
    adm = await start_admitter(nats_url, ack_wait_s=1.0)
    try:
        req = make_request(tenant="t1")
        lost = lose_first_ack("req.", req.id)
        await bus.jpublish(S.request(req.cls, req.tenant), req, msg_id=req.id)
        assert await wait_for(lambda: req.id in adm.shared.reservations and lost, timeout=5)
        tokens = adm.shared.reservations[req.id].tokens
        await bus.jpublish(S.completion("t1", "w1"), make_completion(req.id, runtime_tokens=tokens),
                           msg_id=f"{req.id}:done")
        assert await wait_for(lambda: adm.shared.usage.used == 0, timeout=5)  # released
        info = lambda: bus.js.consumer_info(S.STREAM_REQUESTS, S.CONSUMER_ADMITTER)  # noqa: E731
        # the copy comes back after the 1 s ack wait and is acked without a second reservation
        assert await wait_for(async_pending_is_zero(info), timeout=10)
        await asyncio.sleep(0.3)
        assert adm.shared.usage.used == 0 and req.id not in adm.shared.reservations
        handed = [Admitted.decode(d).request.id for _, d in await bus.stream_messages(S.STREAM_ADMITTED)]
        assert handed == [req.id]
    finally:
        await stop(adm)


def async_pending_is_zero(info):
    async def check() -> bool:
        i = await info()
        return i.num_ack_pending == 0 and i.delivered.consumer_seq >= 2  # the copy came and was acked
    return check


async def test_a_worker_acks_a_copy_of_what_it_finished_and_does_not_run_it_again(bus, nats_url, lose_first_ack):
    worker_bus = await Bus.connect(nats_url, name="w1")
    agent = WorkerAgent(worker_bus, NullEngine(), WorkerSettings(id="w1", heartbeat_interval_s=0.2, ack_wait_s=1.0))
    await agent.start()
    try:
        req = make_request(tenant="t1", max_tokens=2)
        lost = lose_first_ack("work.", req.id)
        await bus.jpublish(S.work("w1"), Assignment(request=req, worker="w1", runtime_tokens=10, admitted_at=time.time(),
                                                   routed_at=time.time()), msg_id=f"{req.id}:work")
        assert await wait_for(lambda: lost and req.id in agent.finished, timeout=5)
        info = lambda: bus.js.consumer_info(S.STREAM_WORK, S.worker_consumer("w1"))  # noqa: E731
        assert await wait_for(async_pending_is_zero(info), timeout=10)  # the copy came back, was acked
        done = [Completion.decode(d).request_id for _, d in await bus.stream_messages(S.STREAM_COMPLETIONS)]
        runs = sum(s.value for m in agent.metrics.registry.collect() if m.name == "natsched_worker_requests"
                   for s in m.samples if s.name.endswith("_total"))
        assert done == [req.id] and runs == 1  # finished once; the copy was only acked
        assert await bus.stream_messages(S.STREAM_WORK) == []
    finally:
        await agent.stop()
        await worker_bus.close()
