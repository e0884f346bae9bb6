"""The busy-until estimate: queued prefill in seconds, from heartbeats and our own assignments."""

from __future__ import annotations

import pytest

from natsched.router.backlog import advance, queued_prefill_s
from natsched.router.costmodel import CostModel
from tests.factories.router import chain, make_core, make_hb, make_req

M = CostModel()
NOW = 100.0


def test_nothing_queued_is_no_wait():
    assert queued_prefill_s(0, [(50_000, 50_000)], M) == 0.0


def test_queued_tokens_go_to_the_newest_assignments_first():
    # newest: a 10k cold prompt (not started); oldest: a 60k prompt with 5k left, at 55k of context
    inflight = [(10_000, 10_000), (60_000, 60_000)]
    got = queued_prefill_s(15_000, inflight, M)
    assert got == pytest.approx(M.prefill_ctx_s(10_000, 0) + M.prefill_ctx_s(5_000, 55_000))
    assert got > 15_000 / M.prefill_tokens_per_s * 1.5  # far more than the token count says


def test_work_we_do_not_know_is_costed_as_one_prompt():
    assert queued_prefill_s(8_000, [(3_000, 2_000)], M) == pytest.approx(
        M.prefill_ctx_s(2_000, 1_000) + M.prefill_ctx_s(6_000))
    assert queued_prefill_s(4_000, [], M) == pytest.approx(M.prefill_ctx_s(4_000))


def test_advance_queues_behind_the_current_work_or_starts_now():
    assert advance(NOW + 2.0, NOW, 1.0) == NOW + 3.0
    assert advance(NOW - 5.0, NOW, 1.0) == NOW + 1.0


def test_registry_tracks_busy_until_across_assignments_and_heartbeats():
    core = make_core(1, policy="least_loaded", now=NOW)
    w = core.workers["w0"]
    req = make_req("a", hashes=chain(40, "a"))  # 1280 tokens, cold
    core.route(req, NOW)
    own = M.prefill_ctx_s(1280)
    assert w.busy_until == pytest.approx(NOW + own)
    assert M.wait_s(w, NOW + own / 2) == pytest.approx(own / 2)
    # the heartbeat counts it, half done: the wait restarts from what is left, at its context
    core.on_heartbeat(make_hb("w0", seq=3, inflight=["a"], queued_prefill_tokens=640), NOW + 1.0)
    assert w.busy_until == pytest.approx(NOW + 1.0 + M.prefill_ctx_s(640, 640))
    # a request routed after that heartbeat queues behind it
    core.route(make_req("b", hashes=chain(40, "b")), NOW + 1.0)
    assert w.busy_until == pytest.approx(NOW + 1.0 + M.prefill_ctx_s(640, 640) + M.prefill_ctx_s(1280))
    # nothing queued any more: the worker is free, our assignment since still pending
    core.on_heartbeat(make_hb("w0", seq=4, inflight=["a"], queued_prefill_tokens=0), NOW + 2.0)
    assert w.busy_until == pytest.approx(NOW + 2.0 + M.prefill_ctx_s(1280))
