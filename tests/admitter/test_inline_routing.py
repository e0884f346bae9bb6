"""Inline routing (``natsched admitter --route``): the admitter routes what it admits in-process.

Against a real nats-server: allowed requests go straight to the workers' WORK subjects (ADMITTED
never stores one), the audit trail and the producer's statuses are those of the two-service path,
a request no worker can take yet falls back to ADMITTED and is routed once a worker appears, and
``natsched up --inline-routing --auth-dir`` runs the fused admitter on its own role.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest

from natsched.wire import subjects as S
from natsched.client.producer import make_request
from natsched.bus.connection import Bus
from natsched.bus.server import free_port
from natsched.wire.schema import Decision
from natsched.wire.roles import admitter_role, router_role, scheduler_role
from natsched.cli.app import build_parser
from natsched.cli.up import up_settings
from natsched.hosting.supervisor import Supervisor
from tests.factories.core import read_until_up, wait_for
from tests.factories.stack import start_stack
from tests.ops.test_auth_up import PY, auth_dir
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.profiles import H100_LLAMA8B
from natsched.workers.simengine import SimEngine


async def _decisions(bus) -> list[Decision]:
    return [Decision.decode(data) for _, data in await bus.stream_messages(S.STREAM_DECISIONS)]


async def test_allowed_requests_go_straight_to_work_and_are_audited_as_before(bus, nats_url):
    stack = await start_stack(nats_url, inline_routing=True)
    try:
        reqs = [make_request("t1", f"inline prompt {i} " * 10, max_tokens=3) for i in range(6)]
        results = await asyncio.gather(*(stack.client.submit(r) for r in reqs))
        assert all(r.status == "completed" and r.output_tokens == 3 for r in results)
        assert all(r.statuses == ["admitted", "assigned"] for r in results)  # in that order, as before
        assert {r.worker for r in results} == {"w1", "w2"}  # the inline least_loaded spreads a burst
        assert await bus.stream_last_seq(S.STREAM_ADMITTED) == 0  # no hand-off was ever stored
        assert await bus.stream_last_seq(S.STREAM_WORK) == 6
        stored = await _decisions(bus)  # one message per request: the routing record holds the admission one
        assert len(stored) == 6 and all(d.stage == "routing" and d.admission is not None for d in stored)
        decisions = [record for d in stored for record in d.unfolded()]
        assert sorted((d.stage, d.decision) for d in decisions) == (
            [("admission", "allow")] * 6 + [("routing", "assign")] * 6)
        assert {d.worker for d in decisions if d.stage == "routing"} == {"w1", "w2"}
        assert {d.by for d in decisions if d.stage == "admission"} == {stack.admitter.settings.name}
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)  # every reservation released
        assert stack.router.metrics.assignments.labels("least_loaded", "w1")._value.get() >= 1
    finally:
        await stack.close()


async def test_the_inline_router_learns_completions_from_the_admitters_own_consumer(bus, nats_url):
    """No second copy of every completion: the admitter hands each one it consumes to its router,
    which releases the load it booked and scores the cache claim, as when it watched ``done.>``."""
    stack = await start_stack(nats_url, inline_routing=True)
    try:
        results = await asyncio.gather(*(stack.client.submit(make_request("t1", f"feedback {i} " * 10, max_tokens=2))
                                         for i in range(4)))
        assert all(r.status == "completed" for r in results)
        watched = {sub.subject for sub in stack.admitter.bus.nc._subs.values()}
        assert S.COMPLETIONS_ALL not in watched and S.HEARTBEATS_ALL in watched
        assert await wait_for(lambda: not stack.router.core.registry.ledger)  # every booked load released
        seen = sum(stack.router.metrics.cached_tokens.labels(w, "actual")._value.get() for w in ("w1", "w2"))
        assert seen == sum(r.cached_tokens for r in results)
    finally:
        await stack.close()


async def test_a_request_no_worker_can_take_falls_back_to_admitted_and_runs_later(bus, nats_url):
    stack = await start_stack(nats_url, workers=0, inline_routing=True)
    agent = None
    try:
        request = make_request("t1", "nobody is here yet", max_tokens=2)
        pending = asyncio.create_task(stack.client.submit(request))
        assert await wait_for(lambda: _stored(bus, S.STREAM_ADMITTED, 1))  # handed off, not dropped
        assert not pending.done()
        engine = SimEngine(H100_LLAMA8B, block_size=32, time_scale=0.05)
        agent = WorkerAgent(await Bus.connect(nats_url, name="late-w1"), engine,
                            WorkerSettings(id="w1", heartbeat_interval_s=0.2))
        await agent.start()
        result = await asyncio.wait_for(pending, 20)  # the inline router's ADMITTED consumer retried it
        assert (result.status, result.worker) == ("completed", "w1")
        assert result.statuses == ["admitted", "assigned"]
        assert await bus.stream_last_seq(S.STREAM_ADMITTED) == 1
    finally:
        if agent is not None:
            await agent.stop()
            await agent.bus.close()
        await stack.close()


async def _stored(bus, stream: str, n: int) -> bool:
    return await bus.stream_last_seq(stream) >= n


def test_the_scheduler_role_is_exactly_an_admitter_and_a_router():
    adm, rtr, sch = admitter_role(), router_role(), scheduler_role()
    assert set(sch.publish) == set(adm.publish) | set(rtr.publish)
    assert set(sch.subscribe) == set(adm.subscribe) | set(rtr.subscribe)
    assert S.WORK_ALL in sch.publish and S.WORK_ALL not in adm.publish


@pytest.mark.parametrize("flags, routers", [([], 0), (["--routers", "1"], 1)])
def test_up_inline_routing_runs_admitters_with_route_and_routers_only_if_asked(flags, routers):
    args = build_parser().parse_args(["up", "--inline-routing", "--admitters", "2", *flags])
    settings = up_settings(args)
    assert (settings.inline_routing, settings.routers) == (True, routers)
    kids = Supervisor(settings).plan("nats://127.0.0.1:4222")
    admitters = [k for k in kids if k.name.startswith("admitter")]
    assert len(admitters) == 2 and all("--route" in k.args and k.user == "scheduler" for k in admitters)
    assert len([k for k in kids if k.name.startswith("router")]) == routers


def test_up_without_routers_needs_inline_routing():
    args = build_parser().parse_args(["up", "--routers", "0"])
    with pytest.raises(ValueError, match="--inline-routing"):
        up_settings(args)


async def test_up_inline_routing_under_auth_serves_a_request_without_a_router(tmp_path):
    auth = auth_dir(tmp_path, ["w1"])
    port = free_port()
    err = tmp_path / "up.stderr"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen([*PY, "up", "--auth-dir", str(auth), "--inline-routing", "--workers", "1",
                                 "--port", str(port), "--data-dir", str(tmp_path / "data"), "--time-scale", "0.05"],
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            lines = read_until_up(proc, 60, "natsched up --inline-routing", lambda: err.read_text())
            assert [line.split()[1] for line in lines if line.startswith("ready:")] == [
                "nats-server", "admitter", "offline", "worker"]
            env = os.environ | {"NATSCHED_NATS_URL": f"nats://127.0.0.1:{port}"}
            out = await asyncio.to_thread(
                subprocess.run, [*PY, "submit", "--credentials", str(auth / "creds" / "producer-A.json"), "--tenant",
                                 "A", "--prompt", "inline under auth", "--max-tokens", "3", "--json"],
                env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr + err.read_text()
            result = json.loads(out.stdout)
            assert (result["status"], result["output_tokens"], result["worker"]) == ("completed", 3, "w1")
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
    refused = [line for line in err.read_text().splitlines() if "permissions violation" in line.lower()]
    assert not refused, f"the inline-routing admitter was refused a permission: {refused[:3]}"


class _Held:
    """The redelivered copy's delivery: only its ack is used."""

    acked = False

    async def ack(self) -> None:
        self.acked = True


async def test_an_allow_handed_off_again_is_recorded_again_when_its_record_rode_with_the_routing_one(bus, nats_url):
    """Inline, an allow's record is stored inside the routing record, after the WORK message: an
    admitter killed between the two left no record of the allow, so the redelivered copy's
    hand-off records it again, from the reservation."""
    from natsched.admitter.shared import Reservation

    stack = await start_stack(nats_url, inline_routing=True)
    try:
        req = make_request("t1", "redelivered after its allow", max_tokens=2)
        res = Reservation(req.id, req.tenant, req.model, 40, 123.0, "admitter-dead")
        held = _Held()
        await stack.admitter._hand_off_again(req, held, res)
        assert held.acked
        records = []

        async def allow_recorded() -> bool:
            records[:] = [d for d in await _decisions(bus) if d.stage == "admission"]
            return bool(records)

        assert await wait_for(allow_recorded)
        (allow,) = records
        assert (allow.decision, allow.reason, allow.ts, allow.by, allow.runtime_tokens) == (
            "allow", "redelivered", 123.0, "admitter-dead", 40)
    finally:
        await stack.close()
