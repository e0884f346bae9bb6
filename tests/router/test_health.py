"""Latency-tied health: the HEALTHY / HALF_OPEN state machine, its admission rule and the core's use of it."""

from __future__ import annotations

import pytest

from natsched.router.core import RouterCore, RouterSettings
from natsched.router.errors import ConfigError
from natsched.router.learned import LearnSettings
from natsched.router.health import HALF_OPEN, HEALTHY, HealthSettings, LatencyHealth, completion_ratio, is_probe
from natsched.router.registry import WorkerState
from natsched.wire.schema import Completion
from tests.factories.router import make_hb, make_req

S = HealthSettings(window_s=10.0, min_samples=2)


def test_sustained_slowness_opens_and_recovery_closes():
    h = LatencyHealth(S)
    assert h.observe("w", 3.0, 0.0) is None  # one sample is no verdict
    assert h.observe("w", 3.2, 1.0) == HALF_OPEN
    assert h.is_half_open("w") and h.since("w") == 1.0
    assert h.observe("w", 1.8, 2.0) is None and h.observe("w", 1.7, 3.0) is None  # not yet under 1.5: hysteresis
    assert h.observe("w", 1.0, 4.0) is None and h.observe("w", 0.9, 5.0) == HEALTHY
    assert list(h.transitions) == [(1.0, "w", HALF_OPEN), (5.0, "w", HEALTHY)]


def test_a_lone_outlier_or_an_old_sample_is_no_verdict():
    h = LatencyHealth(S)
    for t, r in enumerate([1.0, 1.1, 9.0, 0.9, 1.0]):
        assert h.observe("w", r, float(t)) is None
    h.observe("v", 3.0, 0.0)
    assert h.observe("v", 3.0, 20.0) is None  # the first one left the window


def test_overdue_requests_alone_do_not_open_the_circuit():
    h = LatencyHealth(S)
    assert h.observe("w", 4.0, 0.0, completed=False) is None
    assert h.observe("w", 3.0, 1.0, completed=False) is None  # a queue nobody predicted, perhaps
    assert h.observe("w", 2.5, 2.0) == HALF_OPEN  # a completion confirms it


def test_half_open_admits_batch_short_and_probe_requests_only():
    h = LatencyHealth(S)
    h.observe("w", 3.0, 0.0), h.observe("w", 3.0, 1.0)
    assert h.admits("w", "r1", "batch", 50_000) and h.admits("w", "r1", "offline", 50_000)
    assert h.admits("w", "r1", "online", S.short_prompt_tokens)
    probes = [f"r{i}" for i in range(2000) if h.admits("w", f"r{i}", "online", 50_000)]
    assert 0.05 < len(probes) / 2000 < 0.15 and all(is_probe(r, S.probe_share) for r in probes)
    assert h.admits("healthy-one", "r1", "online", 50_000)


def test_learning_is_frozen_while_half_open_then_resumes():
    h = LatencyHealth(HealthSettings(window_s=10.0, min_samples=2, max_half_open_s=60.0))
    h.observe("w", 3.0, 0.0), h.observe("w", 3.0, 1.0)
    assert h.learning_frozen("w", 30.0) and not h.learning_frozen("w", 61.5)


def test_ratio_takes_the_smaller_of_ttft_and_tpot():
    assert completion_ratio(3.0, 1.0, 0.02, 0.01) == 2.0
    assert completion_ratio(None, 1.0, 0.03, 0.01) == pytest.approx(3.0)
    assert completion_ratio(None, 1.0, None, 0.01) is None
    assert completion_ratio(float("nan"), 1.0, None, 0.0) is None


@pytest.mark.parametrize("bad", [dict(recover_factor=3.0, slow_factor=2.0), dict(recover_factor=1.0),
                                 dict(window_s=0), dict(probe_share=2.0), dict(min_samples=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        HealthSettings(**bad)


# ------------------------------------------------------------------ in the router core

def learned_core() -> RouterCore:
    core = RouterCore(RouterSettings(policy="round_robin", heartbeat_timeout_s=600.0,
                                     health=HealthSettings(window_s=10.0, min_samples=2, min_learned=5)))
    for w in ("w0", "w1"):
        core.on_heartbeat(make_hb(w, seq=1, interval=600.0), 0.0)
    return core


def complete(core: RouterCore, rid: str, now: float, slow: float, prompt: int = 2048) -> str:
    d = core.route(make_req(rid, prompt_tokens=prompt, n_blocks=prompt // 32, tag=rid), now)
    a = core.assignment(rid)
    core.on_completion(Completion(request_id=rid, tenant="t", status="ok", runtime_tokens=0, worker=d.worker,
                                  prompt_tokens=prompt, output_tokens=50, ttft=a.pred_ttft_s * slow,
                                  tpot=a.pred_tpot_s * slow), now + 0.5)
    return d.worker


def test_a_worker_slower_than_its_learned_model_goes_half_open_and_comes_back():
    core = learned_core()
    t = 1.0
    for i in range(40):  # both learn: completions as predicted
        complete(core, f"warm{i}", t, 1.0)
        t += 0.2
    assert core.health.state("w1") == HEALTHY
    t += 11.0  # w1 is now three times slower than its own model says (the window holds only that)
    for i in range(6):
        d = core.route(make_req(f"s{i}", prompt_tokens=2048, n_blocks=64, tag=f"s{i}"), t)
        a = core.assignment(f"s{i}")
        slow = 3.0 if d.worker == "w1" else 1.0
        core.on_completion(Completion(request_id=f"s{i}", tenant="t", status="ok", runtime_tokens=0, worker=d.worker,
                                      prompt_tokens=2048, output_tokens=50, ttft=a.pred_ttft_s * slow,
                                      tpot=a.pred_tpot_s * slow), t + 0.5)
        t += 0.2
    assert core.registry.state("w1", t) == WorkerState.HALF_OPEN
    assert core.stats(t)["workers"]["half_open"] == 1
    picks = {core.route(make_req(f"o{i}", prompt_tokens=8000, n_blocks=250, tag=f"o{i}"), t).worker
             for i in range(20) if not is_probe(f"o{i}", 0.1)}
    assert picks == {"w0"}  # long online work avoids it
    d = core.route(make_req("short", prompt_tokens=200, n_blocks=6, tag="short"), t)
    assert d.terms[d.worker]["cost_learned"] == 1.0  # the audit names the estimate used
    for i in range(8):  # it recovered: its probes and short requests come back on time
        req = make_req(f"p{i}", prompt_tokens=200, n_blocks=6, tag=f"p{i}")
        core.on_heartbeat(make_hb("w0", seq=2 + i, state="backoff", interval=600.0), t)  # w0 takes no long work now
        d = core.route(req, t)
        a = core.assignment(req.id)
        core.on_completion(Completion(request_id=req.id, tenant="t", status="ok", runtime_tokens=0, worker=d.worker,
                                      prompt_tokens=200, output_tokens=50, ttft=a.pred_ttft_s, tpot=a.pred_tpot_s),
                           t + 0.5)
        t += 0.3
    assert core.health.state("w1") == HEALTHY


def test_half_open_never_leaves_a_request_nowhere_to_go():
    core = learned_core()
    core.health.observe("w1", 3.0, 1.0), core.health.observe("w1", 3.0, 2.0)
    core.on_heartbeat(make_hb("w0", seq=2, state="quiescing", interval=600.0), 2.0)
    d = core.route(make_req("long", prompt_tokens=8000, n_blocks=250), 2.0)
    assert d.worker == "w1" and "half_open" in d.reason and d.terms["w1"]["half_open"] == 1.0


def test_the_fixed_model_is_no_yardstick():
    core = RouterCore(RouterSettings(policy="least_loaded", heartbeat_timeout_s=600.0,
                                     learn=LearnSettings(enabled=False)))
    core.on_heartbeat(make_hb("w0", seq=1, interval=600.0), 0.0)
    for i in range(20):
        complete(core, f"r{i}", 1.0 + i, 4.0)  # a 4x slower GPU than the constants: healthy, just slower
    assert core.health.state("w0") == HEALTHY


# ------------------------------------------------------------------ queueing delay is not slowness

def test_prefill_queued_behind_a_request_is_allowed_for_in_its_tpot():
    # 101 tokens at 10 ms a step = 1 s of decode; 2 s of other prefill ran inside its steps: 30 ms each
    assert completion_ratio(None, 0.0, 0.03, 0.01, output_tokens=101, interleaved_s=2.0) == pytest.approx(1.0)
    assert completion_ratio(None, 0.0, 0.03, 0.01, output_tokens=101) == pytest.approx(3.0)  # without: "3x slow"
    # a slowed worker is still slow: its steps and the prefill beside them both take three times as long
    assert completion_ratio(None, 0.0, 0.09, 0.01, output_tokens=101, interleaved_s=2.0) == pytest.approx(3.0)


def test_a_ttft_that_waited_for_kv_room_is_no_evidence():
    assert completion_ratio(5.0, 1.0, 0.01, 0.01, queued=True) == pytest.approx(1.0)  # the TPOT alone
    assert completion_ratio(5.0, 1.0, None, 0.0, queued=True) is None
    assert completion_ratio(5.0, 1.0, 0.01, 0.01) == pytest.approx(1.0)  # the smaller of the two, as before


def test_a_busy_healthy_worker_stays_healthy_in_the_core():
    """A full worker: requests wait for KV room (TTFT 3x the prefill-queue prediction) and each is
    followed by more prefill on the same worker, which its decode steps share (TPOT well over the
    bare step) — all of it queueing, explained by what the router itself sent there."""
    core = learned_core()
    t = 1.0
    for i in range(40):
        complete(core, f"warm{i}", t, 1.0)
        t += 0.2
    for w in ("w0", "w1"):
        core.on_heartbeat(make_hb(w, seq=2, interval=600.0, waiting=3), t)
    pending = []
    for i in range(30):
        rid = f"b{i}"
        d = core.route(make_req(rid, prompt_tokens=2048, n_blocks=64, tag=rid), t)
        pending.append((rid, d.worker, core.assignment(rid)))
        t += 0.2
    old_rule = 0
    for rid, w, a in pending[:-4]:  # completed once the work routed behind them has run too
        assert a.kv_queued
        tpot = a.pred_tpot_s + core.registry.prefill_since(w, a.prefill_mark) / 19
        old_rule += min(3.0, tpot / a.pred_tpot_s) > 2.0  # what the ratio was before queues were allowed for
        core.on_completion(Completion(request_id=rid, tenant="t", status="ok", runtime_tokens=0, worker=w,
                                      prompt_tokens=2048, output_tokens=20, ttft=a.pred_ttft_s * 3.0,
                                      tpot=tpot), t)
        t += 0.1
    assert old_rule > 13  # most of them would have looked "2x slow"
    assert core.health.changes() == 0 and core.health.state("w0") == core.health.state("w1") == HEALTHY


def test_a_prediction_made_on_the_prior_is_not_judged():
    """Long requests routed before the worker's model learned, completed after it had: their
    predictions were the prior's (here 4x too fast), not the worker's."""
    core = learned_core()
    early = []
    for i in range(4):
        d = core.route(make_req(f"early{i}", prompt_tokens=2048, n_blocks=64, tag=f"early{i}"), 0.5)
        early.append((f"early{i}", d.worker, core.assignment(f"early{i}")))
    assert not any(a.pred_learned for _, _, a in early)
    t = 1.0
    for i in range(40):
        complete(core, f"warm{i}", t, 1.0)
        t += 0.2
    t += 11.0  # the window holds only the early ones (long: the prefill routed behind them is a small allowance)
    for rid, w, a in early:
        core.on_completion(Completion(request_id=rid, tenant="t", status="ok", runtime_tokens=0, worker=w,
                                      prompt_tokens=2048, output_tokens=2000, ttft=a.pred_ttft_s * 4.0,
                                      tpot=a.pred_tpot_s * 4.0), t)
        t += 0.1
    assert core.health.changes() == 0
