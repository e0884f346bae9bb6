"""natsched's latency-tied half-open rule is natsched's contenders' own: on the same slowed worker,
natsched's router puts it half-open and a peer's never does (natsched.sim.contenders)."""

from __future__ import annotations

import pytest

from natsched.router.health import HALF_OPEN
from natsched.sim.contenders import CONTENDERS
from natsched.sim.des import SimSettings, Simulator, WorkerEvent, make_router
from tests.factories.sim import make_trace, trace_row

BLOCK = 512
SLOW_AT = 40.0  # seconds after the first arrival
PEERS = [c for c in CONTENDERS.values() if not c.policy.startswith("natsched")]


def settings(contender: str) -> SimSettings:
    c = CONTENDERS[contender]
    return SimSettings(policy=c.policy, workers=4, router=c.router_settings(),
                       events=(WorkerEvent(SLOW_AT, "slow", "w1", factor=1 / 3, duration_s=60.0),))


def run(contender: str):
    # distinct prompts and long decodes (as tests/sim/test_slow_progress.py): w1 keeps getting work
    # under every policy, so its slowdown shows in its completions and its heartbeats
    rows = [trace_row(i * 100.0, ids=[10 * i, 10 * i + 1, 10 * i + 2], n_out=600) for i in range(900)]
    sim = Simulator(make_trace(rows), settings(contender))
    res = sim.run()
    return sim, res


def opened(sim: Simulator) -> list[str]:
    return [w for _, w, st in sim.router.health.transitions if st == HALF_OPEN]


def test_natscheds_router_opens_the_slowed_worker_and_a_peers_does_not():
    sim, res = run("natsched")
    assert "w1" in opened(sim)
    for peer in ("aibrix", "production-stack"):  # load-aware and load-blind; both send w1 work
        sim, res = run(peer)
        assert not sim.router.health.transitions and not sim.router.health.is_half_open("w1")
        t0 = res.records[0].arrival
        slowed = [r for r in res.records if r.worker == "w1" and SLOW_AT + 5 < r.arrival - t0 < SLOW_AT + 60]
        assert slowed  # it kept receiving work while slow: nothing of natsched's rule was in the way


@pytest.mark.parametrize("peer", [c.name for c in PEERS])
def test_every_peers_core_never_opens_whatever_the_evidence(peer):
    core = make_router(settings(peer), BLOCK)
    for i in range(50):  # completions and heartbeats far over slow_factor: natsched's would open
        core.health.observe("w1", 10.0, float(i))
        core.health.observe_progress("w1", 10.0, float(i))
    assert not core.health.is_half_open("w1") and not core.health.transitions


def test_natscheds_contenders_keep_it():
    for name in ("natsched", "natsched-noadmit"):
        core = make_router(settings(name), BLOCK)
        for i in range(10):
            core.health.observe("w1", 10.0, float(i))
        assert core.health.is_half_open("w1")
    assert len(PEERS) == len(CONTENDERS) - 2
