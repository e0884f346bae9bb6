"""Per-model capacity in the simulator: the natsched gate feeds the shipped core each model's own
workers' KV (natsched/sim/contenders.py NatschedGate, natsched/admitter/dynamic.py ModelTotals),
as the admitter service does from heartbeats."""

from __future__ import annotations

from natsched.sim.admission import ALLOW, QUEUE
from natsched.sim.contenders import NatschedGate
from natsched.sim.des import SimSettings, Simulator, WorkerSpec
from natsched.sim.trace import Trace, TraceRequest


def _req(i: int, model: str) -> TraceRequest:  # costs ~2050 runtime tokens (2 x prompt + output)
    return TraceRequest(i, i + 1, 0.0, 0.0, 1000, 50, [], tenant="a", cls="online", model=model)


def test_the_small_pools_model_queues_while_the_big_pools_is_admitted_and_follows_its_workers():
    reqs = [_req(i, "small" if i < 3 else "big") for i in range(7)]
    specs = (WorkerSpec(model="big", kv_blocks=50), WorkerSpec(model="big", kv_blocks=50),
             WorkerSpec(model="small", kv_blocks=50))
    sim = Simulator(Trace("t", reqs, block_size=64), SimSettings(worker_specs=specs), admission=(gate := NatschedGate()))
    gate.bind(sim)
    one = sim.workers["w0"].core.kv_blocks * sim.workers["w0"].core.block_size
    assert gate.core.model_totals == {"big": 2 * one, "small": one}
    assert [gate.admit(r, 0.0) for r in reqs[:2]] == [ALLOW, QUEUE]  # 2 x 2050 > the one small worker's KV
    assert [gate.admit(r, 0.0) for r in reqs[3:6]] == [ALLOW] * 3  # the big pool's go in past it
    assert gate.core.usage.model("small") < one < gate.core.usage.used

    sim._kill(sim.workers["w2"], 1.0)  # the small model's only worker dies
    gate.on_cluster_change(1.0)
    assert "small" not in gate.core.model_totals
    gate.on_finish(reqs[0], False, 1.5)  # its request failed with it
    assert gate.release(1.5) == []  # nothing of the small model goes to a pool with no worker
    assert gate.admit(reqs[2], 1.5) == QUEUE
