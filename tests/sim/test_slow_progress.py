"""The heartbeat's decode progress makes a slowed worker half-open within a few heartbeats
(natsched.router.progress), in the simulator that runs the router's own objects."""

from __future__ import annotations

from natsched.router.core import RouterCore, RouterSettings
from natsched.router.health import HALF_OPEN, HealthSettings
from natsched.sim.des import SimSettings, Simulator, WorkerEvent
from tests.factories.sim import make_trace, trace_row

BLOCK = 512
SLOW_AT = 40.0  # seconds after the first arrival


def run(progress_samples: int = HealthSettings().progress_samples):
    # distinct prompts (no cache affinity to pull anything anywhere), long decodes: a completion
    # of the slowed worker comes a whole decode after the slowdown began
    rows = [trace_row(i * 100.0, ids=[10 * i, 10 * i + 1, 10 * i + 2], n_out=600) for i in range(900)]
    router = RouterCore(RouterSettings(block_size=BLOCK, health=HealthSettings(progress_samples=progress_samples)))
    s = SimSettings(workers=4, events=(WorkerEvent(SLOW_AT, "slow", "w1", factor=1 / 3, duration_s=60.0),))
    sim = Simulator(make_trace(rows), s, router=router)
    return sim, sim.run()


def first_half_open(router: RouterCore, worker: str) -> float | None:
    return next((t for t, w, st in router.health.transitions if w == worker and st == HALF_OPEN), None)


def share(records, worker: str, start: float, end: float) -> float:
    picked = [r.worker for r in records if start <= r.arrival - records[0].arrival < end and r.worker]
    return picked.count(worker) / len(picked)


EARLY = (SLOW_AT + 4.0, SLOW_AT + 13.0)  # the first seconds after a verdict within a few heartbeats


def test_a_slowed_worker_goes_half_open_within_a_few_heartbeats_and_its_share_drops():
    sim, res = run()
    t0 = res.records[0].arrival
    opened = first_half_open(sim.router, "w1")
    assert opened is not None and SLOW_AT <= opened - t0 <= SLOW_AT + 6.0  # interval 1 s: 5 heartbeats
    before = share(res.records, "w1", 10.0, SLOW_AT)
    assert before > 0.2 and share(res.records, "w1", *EARLY) < before / 2  # left: probes (HealthSettings.probe_share)
    assert not any(w != "w1" and st == HALF_OPEN for _, w, st in sim.router.health.transitions)  # no false alarm


def test_without_the_signal_completions_see_it_only_later_and_it_keeps_more_work():
    sim, res = run(0)
    opened = first_half_open(sim.router, "w1")
    assert opened is None or opened - res.records[0].arrival > SLOW_AT + 13.0  # a decode later
    with_signal = share(run()[1].records, "w1", *EARLY)
    assert share(res.records, "w1", *EARLY) > with_signal * 1.5
