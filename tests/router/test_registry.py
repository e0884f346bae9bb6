"""WorkerRegistry: the state machine, staleness, restarts, and load accounting between heartbeats."""

from __future__ import annotations

import pytest

from natsched.router.errors import ConfigError
from natsched.router.registry import Assignment, RegistrySettings, WorkerRegistry, WorkerState
from tests.factories.router import make_hb, make_req


def make_registry(**kw) -> WorkerRegistry:
    return WorkerRegistry(RegistrySettings(**kw))


def assign(reg: WorkerRegistry, rid: str, worker: str = "w0", now: float = 0.0, kv: int = 1000, prefill: int = 800):
    reg.on_assigned(rid, Assignment(worker, kv, prefill, 0, now))


@pytest.mark.parametrize(
    "state, prompt_tokens, eligible",
    [
        ("healthy", 50_000, True),
        ("backoff", 1024, True),
        ("backoff", 1025, False),
        ("quiescing", 10, False),
        ("reregister", 10, False),
        ("exploded", 10, False),  # unknown state: no new work
    ],
)
def test_only_healthy_takes_all_work_and_backoff_takes_short(state, prompt_tokens, eligible):
    reg = make_registry(backoff_max_prompt_tokens=1024)
    reg.on_heartbeat(make_hb("w0", state=state), 0.0)
    view = reg.views["w0"]
    assert reg.eligible(view, make_req(prompt_tokens=prompt_tokens), 1.0) is eligible


def test_stale_heartbeat_excludes_worker_until_heard_again():
    reg = make_registry()  # default timeout 15 s; 2 periods of 10 s would be later
    reg.on_heartbeat(make_hb("w0", interval=10.0), 100.0)
    view, req = reg.views["w0"], make_req()
    assert reg.eligible(view, req, 115.0)
    assert not reg.eligible(view, req, 115.1)
    assert reg.state("w0", 115.1) is WorkerState.STALE
    reg.on_heartbeat(make_hb("w0", seq=2), 120.0)
    assert reg.eligible(view, req, 120.0)
    assert reg.state("w0", 120.0) is WorkerState.HEALTHY


def test_a_worker_silent_for_two_of_its_periods_gets_no_more_work():
    """Sooner than the admitter's lease (3 periods): what still went to a dead worker must wait
    for a rescue, so the router stops first."""
    reg = make_registry()
    reg.on_heartbeat(make_hb("w0", interval=1.0), 100.0)
    view, req = reg.views["w0"], make_req()
    assert reg.eligible(view, req, 102.0) and not reg.eligible(view, req, 102.1)
    assert reg.state("w0", 102.1) is WorkerState.STALE


def test_other_model_is_not_eligible():
    reg = make_registry()
    reg.on_heartbeat(make_hb("w0", model="llama"), 0.0)
    assert not reg.eligible(reg.views["w0"], make_req(model="qwen"), 0.0)
    assert reg.eligible(reg.views["w0"], make_req(model="llama"), 0.0)


def test_new_started_at_is_a_restart_held_in_reregister_until_fresh():
    reg = make_registry()
    assert reg.on_heartbeat(make_hb("w0", started_at=1.0), 0.0) is False
    assert reg.on_heartbeat(make_hb("w0", started_at=1.0, seq=2), 10.0) is False
    assert reg.on_heartbeat(make_hb("w0", started_at=50.0, seq=1), 60.0) is True
    view = reg.views["w0"]
    assert view.state == "reregister" and view.joined_at == 60.0
    assert not reg.eligible(view, make_req(), 60.0)
    reg.on_heartbeat(make_hb("w0", started_at=50.0, seq=2), 61.0)  # still not fresh
    assert view.state == "reregister"
    reg.mark_fresh("w0")
    assert view.state == "healthy" and reg.eligible(view, make_req(), 61.0)


def test_worker_reported_reregister_counts_as_restart_once():
    reg = make_registry()
    reg.on_heartbeat(make_hb("w0"), 0.0)
    assert reg.on_heartbeat(make_hb("w0", state="reregister", seq=2), 1.0) is True
    assert reg.on_heartbeat(make_hb("w0", state="reregister", seq=3), 2.0) is False


def test_pending_assignments_count_until_a_heartbeat_lists_them():
    reg = make_registry()
    reg.on_heartbeat(make_hb("w0"), 0.0)
    assign(reg, "r1", now=0.5)
    assign(reg, "r2", now=0.6)
    view = reg.views["w0"]
    assert (view.pending, view.pending_tokens, view.pending_prefill_tokens) == (2, 2000, 1600)
    assert view.inflight == 2
    reg.on_heartbeat(make_hb("w0", seq=2, running=1, runtime_tokens=1000, inflight=["r1"]), 1.0)
    assert (view.pending, view.pending_tokens) == (1, 1000)
    assert view.inflight == 2 and view.load_tokens == 2000


def test_pending_without_ids_clears_after_grace():
    reg = make_registry(pending_grace_s=2.0)
    reg.on_heartbeat(make_hb("w0"), 0.0)
    assign(reg, "r1", now=1.0)
    reg.on_heartbeat(make_hb("w0", seq=2), 2.0)
    assert reg.views["w0"].pending == 1  # too recent: the worker may not have it yet
    reg.on_heartbeat(make_hb("w0", seq=3), 3.5)
    assert reg.views["w0"].pending == 0


def test_completion_of_pending_request_releases_it():
    reg = make_registry()
    reg.on_heartbeat(make_hb("w0"), 0.0)
    assign(reg, "r1")
    a = reg.on_completion("r1", "w0", 1000)
    assert a is not None and a.worker == "w0"
    assert reg.views["w0"].pending == 0 and reg.views["w0"].pending_tokens == 0
    assert "r1" not in reg.ledger


def test_completion_counted_by_last_heartbeat_is_subtracted_until_next():
    reg = make_registry()
    reg.on_heartbeat(make_hb("w0", running=3, runtime_tokens=3000, inflight=["a", "b", "c"]), 0.0)
    view = reg.views["w0"]
    reg.on_completion("b", "w0", 1000)  # routed by another replica: no ledger entry
    assert view.inflight == 2 and view.load_tokens == 2000
    reg.on_completion("zzz", "w0", 1000)  # not counted by the heartbeat: nothing to subtract
    assert view.inflight == 2
    reg.on_heartbeat(make_hb("w0", seq=2, running=2, runtime_tokens=2000, inflight=["a", "c"]), 1.0)
    assert view.inflight == 2 and view.finished == 0


def test_restart_drops_pending_load():
    reg = make_registry()
    reg.on_heartbeat(make_hb("w0", started_at=1.0), 0.0)
    assign(reg, "r1")
    reg.on_heartbeat(make_hb("w0", started_at=2.0), 0.5)
    assert reg.views["w0"].pending == 0


def test_reassigning_a_request_moves_its_load():
    reg = make_registry()
    reg.on_heartbeat(make_hb("w0"), 0.0)
    reg.on_heartbeat(make_hb("w1"), 0.0)
    assign(reg, "r1", "w0")
    assign(reg, "r1", "w1")
    assert reg.views["w0"].pending == 0 and reg.views["w1"].pending == 1


def test_tick_forgets_long_silent_workers_and_old_ledger_entries():
    reg = make_registry(forget_after_s=100.0, ledger_ttl_s=50.0)
    reg.on_heartbeat(make_hb("w0"), 0.0)
    reg.on_heartbeat(make_hb("w1"), 0.0)
    assign(reg, "old", "w1", now=0.0)
    reg.on_heartbeat(make_hb("w1", seq=2), 90.0)
    assert reg.tick(60.0) == []
    assert "old" not in reg.ledger and reg.views["w1"].pending == 0
    assert reg.tick(101.0) == ["w0"]
    assert set(reg.views) == {"w1"}


def test_bad_settings_raise():
    with pytest.raises(ConfigError):
        RegistrySettings(heartbeat_timeout_s=0)
