"""The heartbeat's decode progress as early slowness evidence: the estimator, the health rule
it feeds, and that a worker cannot use it to look faster (natsched.router.progress)."""

from __future__ import annotations

import pytest

from natsched.router.core import RouterCore, RouterSettings
from natsched.router.costmodel import CostModel
from natsched.router.health import HALF_OPEN, HEALTHY, HealthSettings, LatencyHealth
from natsched.router.progress import MAX_PREFILL_SHARE, MIN_DECODE_TOKENS, PEER_WINDOW_S, ProgressWatch, progress_ratio
from natsched.router.registry import WorkerState
from natsched.wire.schema import Completion
from tests.factories.router import make_hb, make_req

COST = CostModel(decode_step_s=0.01, decode_s_per_1k_ctx=0.0001, prefill_tokens_per_s=10_000.0)


def test_the_ratio_is_the_mean_gap_over_the_predicted_step():
    step = COST.step_s(20_000, 10)  # 10 sequences, 20k KV tokens: 12 ms
    assert progress_ratio(COST, 100, 100 * step, 10, 20_000, 0.0) == pytest.approx(1.0)
    assert progress_ratio(COST, 100, 300 * step, 10, 20_000, 0.0) == pytest.approx(3.0)


def test_prefill_run_inside_the_steps_is_allowed_for():
    step = COST.step_s(20_000, 10)
    # 100 tokens of 10 sequences: 10 steps; 0.1 s of prefill among them: 10 ms more per step
    gap = step + 0.01
    assert progress_ratio(COST, 100, 100 * gap, 10, 20_000, 0.1) == pytest.approx(1.0)
    assert progress_ratio(COST, 100, 100 * gap, 10, 20_000, 0.0) > 1.8  # without it: "slow"


def test_an_interval_mostly_of_prefill_is_no_evidence():
    step = COST.step_s(20_000, 10)
    prefill = 10 * step * MAX_PREFILL_SHARE / (1 - MAX_PREFILL_SHARE)  # exactly the share allowed
    assert progress_ratio(COST, 100, 100 * 5 * step, 10, 20_000, prefill) is not None
    assert progress_ratio(COST, 100, 100 * 5 * step, 10, 20_000, prefill * 1.1) is None


@pytest.mark.parametrize("tokens,seconds,running", [(MIN_DECODE_TOKENS - 1, 1.0, 4), (100, 0.0, 4), (100, 1.0, 0)])
def test_too_little_progress_is_no_evidence(tokens, seconds, running):
    assert progress_ratio(COST, tokens, seconds, running, 0, 0.0) is None


def test_the_watch_counts_the_interval_prefill_from_what_was_routed_and_the_queue():
    watch, step = ProgressWatch(), COST.step_s(0, 4)
    assert watch.on_heartbeat(COST, "w", 1.0, 40, 40 * step, 4, 0, 5_000, 0.0) is None  # no interval yet
    # routed 0.02 s of prefill; the queue fell from 1k to 0.8k tokens (0.02 s): 0.04 s over 10 steps
    watch.on_heartbeat(COST, "w", 1.5, 40, 40 * step, 4, 0, 1_000, 0.0)
    r = watch.on_heartbeat(COST, "w", 2.0, 40, 40 * (step + 0.004), 4, 0, 800, 0.02)
    assert r == pytest.approx(1.0)
    assert watch.on_heartbeat(COST, "w", 1.5, 40, 40 * step, 4, 0, 0, 0.2) is None  # older: ignored
    watch.forget("w")
    assert watch.on_heartbeat(COST, "w", 3.0, 40, 40 * step, 4, 0, 0, 0.2) is None  # starts anew


def test_sustained_slow_progress_opens_and_fast_progress_closes_it():
    h = LatencyHealth(HealthSettings(progress_samples=3))
    assert h.observe_progress("w", 3.0, 1.0) is None and h.observe_progress("w", 3.0, 2.0) is None
    assert h.observe_progress("w", 3.0, 3.0) == HALF_OPEN
    assert h.since("w") == 3.0 and h.learning_frozen("w", 4.0)
    assert h.observe_progress("w", 1.0, 4.0) is None and h.observe_progress("w", 1.1, 5.0) is None
    assert h.observe_progress("w", 0.9, 6.0) == HEALTHY


def test_one_slow_heartbeat_among_normal_ones_is_no_verdict():
    h = LatencyHealth(HealthSettings(progress_samples=3))
    for t, r in enumerate([1.0, 9.0, 1.1, 1.0, 8.0, 0.9]):
        assert h.observe_progress("w", r, float(t)) is None
    assert h.state("w") == HEALTHY


def test_progress_never_ends_a_half_open_state_its_completions_caused():
    h = LatencyHealth(HealthSettings(window_s=10.0, min_samples=2, progress_samples=3))
    h.observe("w", 3.0, 1.0), h.observe("w", 3.0, 2.0)
    assert h.is_half_open("w")
    for t in range(3, 10):  # the worker claims it runs at a tenth of its predicted step time
        assert h.observe_progress("w", 0.1, float(t)) is None
    assert h.is_half_open("w")


def test_progress_samples_zero_turns_it_off():
    h = LatencyHealth(HealthSettings(progress_samples=0))
    for t in range(10):
        assert h.observe_progress("w", 5.0, float(t)) is None
    assert h.state("w") == HEALTHY


# --- in the core: learned workers only, and a hostile worker's claims --------------------------------

def learned_core(progress_samples: int = 3) -> RouterCore:
    core = RouterCore(RouterSettings(policy="natsched", heartbeat_timeout_s=600.0, health=HealthSettings(
        window_s=10.0, min_samples=2, min_learned=5, progress_samples=progress_samples)))
    for w in ("w0", "w1"):
        core.on_heartbeat(make_hb(w, seq=1, ts=0.0, interval=600.0), 0.0)
    return core


def warm(core: RouterCore, t: float, n: int = 40, slow: dict | None = None) -> float:
    for i in range(n):
        rid = f"warm{t}-{i}"
        d = core.route(make_req(rid, prompt_tokens=2048, n_blocks=64, tag=rid), t)
        a = core.assignment(rid)
        f = (slow or {}).get(d.worker, 1.0)
        core.on_completion(Completion(request_id=rid, tenant="t", status="ok", runtime_tokens=0, worker=d.worker,
                                      prompt_tokens=2048, output_tokens=50, ttft=a.pred_ttft_s * f,
                                      tpot=a.pred_tpot_s * f), t + 0.5)
        t += 0.2
    return t


def progress_hb(core: RouterCore, w: str, seq: int, ts: float, factor: float | None):
    """A heartbeat whose decode progress is ``factor`` x the step time w's model predicts (None: not reported)."""
    if factor is None:
        return make_hb(w, seq=seq, ts=ts, interval=600.0, running=8)
    step = core.costs.of(w).step_s(0, 8)
    return make_hb(w, seq=seq, ts=ts, interval=600.0, running=8, decode_tokens=80, decode_s=80 * step * factor)


def test_a_learned_worker_reporting_slow_steps_goes_half_open_in_three_heartbeats():
    core = learned_core()
    t = warm(core, 1.0)
    for seq in range(2, 6):
        core.on_heartbeat(progress_hb(core, "w1", seq, t, 3.0), t)
        t += 1.0
    assert core.registry.state("w1", t) == WorkerState.HALF_OPEN
    assert core.health.state("w0") == HEALTHY


def test_the_prior_is_no_yardstick_for_progress():
    core = learned_core()  # nothing learned yet
    for seq in range(2, 8):
        core.on_heartbeat(progress_hb(core, "w1", seq, float(seq), 5.0), float(seq))
    assert core.health.state("w1") == HEALTHY


def test_a_worker_claiming_fast_steps_gets_no_more_work_than_a_silent_one():
    """Hostile: w1 is slow by its completions and claims a tenth of its step time in every heartbeat."""
    decisions = {}
    for claims in (False, True):
        core = learned_core()
        t = warm(core, 1.0)
        t = warm(core, t + 11.0, n=10, slow={"w1": 3.0})  # its completions show it 3x slower
        assert core.health.is_half_open("w1")
        picks = []
        for i in range(30):
            core.on_heartbeat(progress_hb(core, "w1", 2 + i, t, 0.1 if claims else None), t)
            d = core.route(make_req(f"o{i}", prompt_tokens=8000, n_blocks=250, tag=f"o{i}"), t)
            picks.append(d.worker)
            t += 0.1
        assert core.health.is_half_open("w1")  # its claims did not end what its completions showed
        decisions[claims] = picks
    assert decisions[True] == decisions[False]  # the claims changed no routing decision


def test_a_healthy_worker_claiming_fast_steps_changes_no_decision():
    decisions = {}
    for claims in (False, True):
        core = learned_core()
        t = warm(core, 1.0)
        picks = []
        for i in range(30):
            core.on_heartbeat(progress_hb(core, "w1", 2 + i, t, 0.01 if claims else None), t)
            picks.append(core.route(make_req(f"o{i}", prompt_tokens=4000, n_blocks=125, tag=f"o{i}"), t).worker)
            t += 0.1
        decisions[claims] = picks
    assert "w1" in decisions[False] and decisions[True] == decisions[False]


def test_a_state_both_signals_agree_on_is_one_transition_and_lasts_while_either_holds_it():
    h = LatencyHealth(HealthSettings(window_s=10.0, min_samples=2, progress_samples=3))
    for t in (1.0, 2.0, 3.0):
        h.observe_progress("w", 3.0, t)
    h.observe("w", 3.0, 4.0), h.observe("w", 3.0, 5.0)  # completions agree: no second transition
    assert [st for _, _, st in h.transitions] == [HALF_OPEN]
    h.observe("w", 1.0, 16.0), h.observe("w", 1.0, 17.0)  # completions recover; the progress still slow
    assert h.is_half_open("w") and [st for _, _, st in h.transitions] == [HALF_OPEN]
    for t in (18.0, 19.0, 20.0):
        h.observe_progress("w", 1.0, t)
    assert h.state("w") == HEALTHY and [st for _, _, st in h.transitions] == [HALF_OPEN, HEALTHY]


# --- judged against the group's current level -------------------------------------------------------

GROUP = frozenset({"w0", "w1", "w2", "w3"})


def test_a_ratio_is_judged_against_its_peers_current_level():
    watch = ProgressWatch()
    for w in ("w1", "w2", "w3"):
        watch.relative(w, 1.5, 10.0, GROUP)  # a bias every member shares
    assert watch.relative("w0", 1.5, 11.0, GROUP) == pytest.approx(1.0)
    assert watch.relative("w0", 6.0, 11.0, GROUP) == pytest.approx(4.0)  # slowed: stands out


def test_too_few_recent_peers_leave_the_ratio_as_it_is():
    watch = ProgressWatch()
    watch.relative("w1", 1.5, 0.0, GROUP)
    watch.relative("w2", 1.5, 0.0, GROUP)
    watch.relative("other", 3.0, 20.0, frozenset({"other"}))  # not of the group
    assert watch.relative("w0", 3.0, 1.0, GROUP) == pytest.approx(2.0)
    assert watch.relative("w0", 3.0, 1.0 + PEER_WINDOW_S + 1.0, GROUP) == 3.0  # the peers' ratios are stale
    assert watch.relative("w9", 3.0, 1.0, frozenset()) == 3.0  # no group


def test_peers_claiming_fast_steps_cannot_make_a_member_look_slower():
    watch = ProgressWatch()
    for w in ("w1", "w2", "w3"):
        watch.relative(w, 0.2, 10.0, GROUP)  # hostile: far faster than the model
    assert watch.relative("w0", 2.5, 11.0, GROUP) == 2.5  # judged against the model alone


def pooled_core() -> RouterCore:
    """Four workers of one deployment, the default min_learned (50)."""
    core = RouterCore(RouterSettings(policy="natsched", heartbeat_timeout_s=600.0,
                                     health=HealthSettings(window_s=10.0, min_samples=2, progress_samples=3)))
    for w in sorted(GROUP):
        core.on_heartbeat(make_hb(w, seq=1, ts=0.0, interval=600.0, deployment="l4"), 0.0)
    return core


def pooled_hb(core: RouterCore, w: str, seq: int, ts: float, factor: float):
    step = core.costs.of(w).step_s(0, 8)
    return make_hb(w, seq=seq, ts=ts, interval=600.0, running=8, decode_tokens=80, decode_s=80 * step * factor,
                   deployment="l4")


def test_a_lightly_used_member_of_a_pool_is_judged_by_the_pools_estimate():
    core = pooled_core()
    t = warm(core, 1.0, n=120)
    own = {w: core.costs.samples(w) for w in GROUP}
    slow = max(GROUP, key=lambda w: own[w])
    assert 10 <= own[slow] < core.health.settings.min_learned  # under the bar on its own samples
    for seq in range(2, 7):
        for w in sorted(GROUP):
            core.on_heartbeat(pooled_hb(core, w, seq, t, 4.0 if w == slow else 1.5), t)
        t += 1.0
    assert core.health.state(slow) == HALF_OPEN
    assert all(core.health.state(w) == HEALTHY for w in GROUP - {slow})  # 1.5x, shared by all: no fault


def test_a_pool_slowed_as_a_whole_is_not_half_opened():
    core = pooled_core()
    t = warm(core, 1.0, n=120)
    for seq in range(2, 7):
        for w in sorted(GROUP):
            core.on_heartbeat(pooled_hb(core, w, seq, t, 3.0), t)
        t += 1.0
    assert all(core.health.state(w) == HEALTHY for w in GROUP)
