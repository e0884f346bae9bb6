"""RouterCore: wiring of registry, index, feedback, policies, canary and run-time switching."""

from __future__ import annotations

from collections import Counter

import pytest

from natsched.router.core import RouterCore, RouterSettings, in_canary
from natsched.router.errors import ConfigError, UnknownPolicyError
from natsched.router.index import IndexSettings
from tests.factories.router import chain, make_completion, make_core, make_event, make_hb, make_req

NOW = 100.0
PREFIX = chain(20, "sys")


def req_with_prefix(rid: str, tail: str | None = None, **kw):
    hashes = PREFIX + (chain(5, tail) if tail else [])
    return make_req(rid, hashes=hashes, **kw)


# ---------------------------------------------------------------- the service's API


def test_route_books_pending_load_so_a_burst_spreads():
    core = make_core(3, policy="least_loaded")
    picks = [core.route(make_req(f"r{i}"), NOW).worker for i in range(6)]
    assert Counter(picks) == {"w0": 2, "w1": 2, "w2": 2}
    assert core.workers["w0"].pending == 2


def test_route_records_own_decision_in_index():
    core = make_core(4)
    first = core.route(req_with_prefix("a", "u1"), NOW)
    second = core.route(req_with_prefix("b", "u2"), NOW + 0.1)
    assert second.worker == first.worker
    assert second.expected_cached_tokens == 20 * 32
    assert core.assignment("b").expected_cached == 20 * 32


def test_cache_blind_policy_still_reports_index_prediction():
    core = make_core(1, policy="round_robin")
    core.route(req_with_prefix("a"), NOW)
    d = core.route(req_with_prefix("b", "x"), NOW)
    assert d.policy == "round_robin" and d.expected_cached_tokens == 20 * 32


def test_no_candidate_gives_no_worker():
    core = make_core(2)
    d = core.route(make_req(), NOW + 60)  # every heartbeat is older than 15 s
    assert d.worker is None and d.reason == "no_worker"


def test_candidates_follow_worker_states():
    core = make_core(4)
    core.on_heartbeat(make_hb("w1", seq=3, state="quiescing"), NOW)
    core.on_heartbeat(make_hb("w2", seq=3, state="backoff"), NOW)
    short, long_ = make_req(prompt_tokens=100), make_req(prompt_tokens=5000)
    assert {w.id for w in core.candidates(short, NOW)} == {"w0", "w2", "w3"}
    assert {w.id for w in core.candidates(long_, NOW)} == {"w0", "w3"}


def test_when_every_worker_is_in_backoff_a_long_prompt_still_has_somewhere_to_go():
    """Panic: holding it in the router's retry loop only moves the engine's queue into the router
    (out of order, refused after no_worker_wait_s); quiescing workers stay out."""
    core = make_core(3)
    core.on_heartbeat(make_hb("w0", seq=3, state="backoff"), NOW)
    core.on_heartbeat(make_hb("w1", seq=3, state="backoff"), NOW)
    core.on_heartbeat(make_hb("w2", seq=3, state="quiescing"), NOW)
    assert {w.id for w in core.candidates(make_req(prompt_tokens=5000), NOW)} == {"w0", "w1"}
    core.on_heartbeat(make_hb("w0", seq=4, state="healthy"), NOW)
    assert {w.id for w in core.candidates(make_req(prompt_tokens=5000), NOW)} == {"w0"}  # not while one is healthy


def test_panic_threshold_opens_every_worker_when_fewer_than_half_may_take_the_request():
    """Envoy's panic threshold (50 %): with three of four workers in backoff, the one left would get
    every long prompt (the cascade elastic showed after its kill), so all four are candidates;
    with two of four, half may, and the backoff workers stay out. Threshold 0 (the simulated peers):
    only when none may."""
    long_ = make_req(prompt_tokens=5000)
    for threshold, backoff, want in ((0.5, ("w1", "w2", "w3"), {"w0", "w1", "w2", "w3"}),
                                     (0.5, ("w2", "w3"), {"w0", "w1"}),
                                     (0.0, ("w1", "w2", "w3"), {"w0"})):
        core = make_core(4, panic_threshold=threshold)
        for w in backoff:
            core.on_heartbeat(make_hb(w, seq=3, state="backoff"), NOW)
        assert {w.id for w in core.candidates(long_, NOW)} == want, (threshold, backoff)
    core = make_core(4)
    for w in ("w1", "w2", "w3"):
        core.on_heartbeat(make_hb(w, seq=3, state="backoff"), NOW)
    assert {w.id for w in core.candidates(make_req(prompt_tokens=100), NOW)} == {"w0", "w1", "w2", "w3"}
    core.on_heartbeat(make_hb("w0", seq=3, state="quiescing"), NOW)  # draining: never a candidate
    assert {w.id for w in core.candidates(long_, NOW)} == {"w1", "w2", "w3"}


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "half", True])
def test_a_panic_threshold_outside_zero_to_one_is_refused_by_name(bad):
    from natsched.router.core import RouterSettings
    from natsched.router.errors import ConfigError

    with pytest.raises(ConfigError, match="panic_threshold"):
        RouterSettings(panic_threshold=bad)


# ---------------------------------------------------------------- cache events


def test_sequence_gap_returns_false_then_snapshot_restores_trust():
    core = make_core(2)
    assert core.on_cache_event(make_event("w1", 1, hashes=PREFIX), NOW) is True
    assert core.route(req_with_prefix("a", "x"), NOW).worker == "w1"
    assert core.on_cache_event(make_event("w1", 3, hashes=chain(3, "z")), NOW) is False
    assert core.index.match_one(PREFIX, "w1", NOW) == 0  # w1's claims are not trusted
    d = core.route(req_with_prefix("b", "y"), NOW)
    assert d.expected_cached_tokens == 0
    assert core.on_cache_event(make_event("w1", 4, kind="snapshot", hashes=PREFIX), NOW) is True
    assert core.index.is_trusted("w1")
    assert core.index.match_one(PREFIX, "w1", NOW) == 20


def test_a_worker_first_heard_mid_stream_is_asked_for_a_snapshot_at_once():
    """A router that starts after its workers did missed their first cache events: it asks at
    the first heartbeat, not at the first delta after the load began."""
    from natsched.router.core import RouterCore, RouterSettings

    core = RouterCore(RouterSettings(policy="natsched"))
    core.on_heartbeat(make_hb("late", kv_seq=7), NOW)  # 7 events out, none seen here
    core.on_heartbeat(make_hb("fresh", kv_seq=0), NOW)  # nothing published yet: nothing missed
    core.on_cache_event(make_event("early", 1, kind="snapshot", hashes=PREFIX), NOW)
    core.on_heartbeat(make_hb("early", kv_seq=1), NOW)  # its first snapshot came before its heartbeat
    assert core.pop_snapshot_requests() == ["late"]
    core.on_heartbeat(make_hb("late", seq=2, kv_seq=7), NOW + 0.5)
    assert core.pop_snapshot_requests() == []  # asked once
    # a delta that overtakes the answer still shows the gap (and asks, in case the answer is lost)
    assert core.on_cache_event(make_event("late", 8, hashes=chain(3, "q")), NOW + 0.6) is False
    assert core.on_cache_event(make_event("late", 9, kind="snapshot", hashes=PREFIX), NOW + 1) is True
    assert core.index.is_trusted("late") and core.index.match_one(PREFIX, "late", NOW + 1) == 20


# ---------------------------------------------------------------- restart / re-register


def test_restarted_worker_loses_claims_and_waits_for_fresh_state():
    core = make_core(2)
    core.on_cache_event(make_event("w1", 1, hashes=PREFIX), NOW)
    core.on_heartbeat(make_hb("w1", seq=1, started_at=500.0, kv_seq=2), NOW + 1)  # restarted, 2 events out
    assert core.workers["w1"].state == "reregister"
    assert [w.id for w in core.candidates(make_req(), NOW + 1)] == ["w0"]
    assert core.index.match_one(PREFIX, "w1", NOW + 1) == 0
    core.on_cache_event(make_event("w1", 1, hashes=chain(3, "n")), NOW + 1.5)
    assert core.workers["w1"].state == "reregister"  # kv_seq 2 not reached yet
    core.on_cache_event(make_event("w1", 2, hashes=chain(3, "m")), NOW + 2)
    assert core.workers["w1"].state == "healthy"
    assert core.workers["w1"].joined_at == NOW + 1  # warm-up restarts


def test_restarted_worker_with_no_events_is_fresh_at_once():
    core = make_core(2)
    core.on_cache_event(make_event("w1", 1, hashes=PREFIX), NOW)
    core.on_heartbeat(make_hb("w1", seq=1, started_at=500.0, kv_seq=0), NOW + 1)
    assert core.workers["w1"].state == "healthy"
    assert core.index.match_one(PREFIX, "w1", NOW + 1) == 0


# ---------------------------------------------------------------- feedback


def route_and_complete(core: RouterCore, n: int, cached: int, tail: str = "t", start: int = 0):
    """Route ``n`` requests sharing PREFIX and complete each with ``cached`` tokens served."""
    workers = []
    for i in range(start, start + n):
        rid = f"{tail}{i}"
        d = core.route(req_with_prefix(rid, f"{tail}{i}"), NOW)
        core.on_completion(make_completion(rid, d.worker, cached=cached), NOW)
        workers.append(d.worker)
    return workers


def test_failing_claims_demote_worker_until_snapshot():
    core = make_core(1)
    core.on_cache_event(make_event("w0", 1, hashes=PREFIX), NOW)  # w0 says: I hold PREFIX
    route_and_complete(core, 4, cached=0)
    assert core.index.is_trusted("w0")  # fewer than min_samples: not judged yet
    route_and_complete(core, 1, cached=0, start=4)
    assert not core.index.is_trusted("w0")
    assert core.pop_snapshot_requests() == ["w0"]
    assert core.pop_snapshot_requests() == []
    assert core.index.match_one(PREFIX, "w0", NOW) == 0
    core.on_cache_event(make_event("w0", 2, kind="snapshot", hashes=PREFIX), NOW)
    assert core.index.is_trusted("w0") and core.claims.accuracy("w0") == 1.0


def test_our_own_routing_guesses_are_not_held_against_the_worker():
    # The bug: requests sent while an earlier one with the same prefix is still queued or
    # prefilling find less cached than our approximate claim predicted. That is not the worker's
    # word, so it must not demote the worker (and blind the router to its exact reports).
    core = make_core(1)
    core.route(req_with_prefix("first"), NOW)  # approximate claim: "w0 will hold PREFIX"
    d = core.route(req_with_prefix("probe", "p"), NOW)
    assert d.expected_cached_tokens == 20 * 32  # the guess is still used for routing
    core.on_completion(make_completion("probe", "w0", cached=0), NOW)
    route_and_complete(core, 20, cached=0)
    assert core.index.is_trusted("w0") and core.claims.accuracy("w0") == 1.0
    assert core.pop_snapshot_requests() == []


@pytest.mark.parametrize("removed, demoted", [(PREFIX[5:], False), (chain(3, "other"), True)])
def test_a_reported_eviction_explains_a_shortfall(removed, demoted):
    core = make_core(1)
    core.on_cache_event(make_event("w0", 1, hashes=PREFIX), NOW)
    rids = [f"q{i}" for i in range(6)]
    for rid in rids:
        core.route(req_with_prefix(rid, rid), NOW)
    # after routing, w0 reports evicting blocks; the engine then serves only 5 blocks
    core.on_cache_event(make_event("w0", 2, kind="removed", hashes=removed), NOW + 1)
    for rid in rids:
        core.on_completion(make_completion(rid, "w0", cached=5 * 32), NOW + 2)
    assert core.index.is_trusted("w0") is not demoted


def test_an_eviction_before_routing_does_not_excuse_a_later_shortfall():
    core = make_core(1)
    core.on_cache_event(make_event("w0", 1, hashes=PREFIX), NOW)
    core.on_cache_event(make_event("w0", 2, kind="removed", hashes=PREFIX[4:]), NOW)
    core.on_cache_event(make_event("w0", 3, hashes=PREFIX[4:]), NOW)  # stored again: claimed in full
    route_and_complete(core, 5, cached=4 * 32)  # ... yet the engine serves only the first 4 blocks
    assert not core.index.is_trusted("w0")


def test_the_engine_never_serving_the_last_prompt_token_is_not_a_failure():
    core = make_core(1)
    core.on_cache_event(make_event("w0", 1, hashes=PREFIX), NOW)
    for i in range(10):  # the prompt is exactly PREFIX: the engine must compute its last block
        rid = f"x{i}"
        assert core.route(make_req(rid, hashes=PREFIX), NOW).worker == "w0"
        assert core.assignment(rid).claimed_cached == 19 * 32
        core.on_completion(make_completion(rid, "w0", cached=19 * 32), NOW)
    assert core.claims.accuracy("w0") == 1.0


def test_completions_we_did_not_route_are_not_judged():
    core = make_core(2)
    core.on_cache_event(make_event("w0", 1, hashes=PREFIX), NOW)
    for i in range(20):  # another router replica's requests: we know nothing of its prediction
        core.on_completion(make_completion(f"c{i}", "w0", cached=0, expected=640), NOW)
    assert core.index.is_trusted("w0")


def test_accurate_or_errored_completions_do_not_demote():
    core = make_core(1)
    core.on_cache_event(make_event("w0", 1, hashes=PREFIX), NOW)
    route_and_complete(core, 20, cached=600)
    for i in range(20):
        rid = f"e{i}"
        core.route(req_with_prefix(rid, rid), NOW)
        core.on_completion(make_completion(rid, "w0", cached=0, status="error"), NOW)
    assert core.index.is_trusted("w0")
    assert core.claims.accuracy("w0") > 0.9


def test_completion_releases_pending_load():
    core = make_core(1)
    core.route(make_req("a"), NOW)
    assert core.workers["w0"].pending == 1
    core.on_completion(make_completion("a", "w0"), NOW)
    assert core.workers["w0"].pending == 0 and core.assignment("a") is None


# ---------------------------------------------------------------- switching and canary


def test_set_policy_switches_and_bad_input_keeps_old_policy():
    core = make_core(2)
    core.set_policy("dynamo_kv", {"overlap_score_weight": 2.0})
    assert core.route(make_req(), NOW).policy == "dynamo_kv"
    assert core.policy.p.overlap_score_weight == 2.0
    with pytest.raises(UnknownPolicyError):
        core.set_policy("nope")
    with pytest.raises(ConfigError):
        core.set_policy("natsched", {"bogus": 1})
    assert core.policy.name == "dynamo_kv"


def test_canary_takes_its_share_deterministically():
    core = make_core(3, policy="natsched", canary_policy="round_robin", canary_share=0.3)
    decided = {f"r{i}": core.route(make_req(f"r{i}"), NOW).policy for i in range(2000)}
    share = sum(p == "round_robin" for p in decided.values()) / len(decided)
    assert 0.25 < share < 0.35
    assert all((p == "round_robin") == in_canary(r, 0.3) for r, p in decided.items())
    core.set_canary(None)
    assert all(core.route(make_req(f"r{i}"), NOW).policy == "natsched" for i in range(50))


def test_canary_share_must_be_a_fraction():
    core = make_core(1)
    with pytest.raises(ConfigError):
        core.set_canary("round_robin", 1.5)


def test_settings_weights_reach_the_policy():
    core = RouterCore(RouterSettings(policy_weights={"natsched": {"min_gain": 0.6}}))
    assert core.policy.p.min_gain == 0.6


# ---------------------------------------------------------------- housekeeping


def test_tick_forgets_silent_workers_and_reasks_snapshots():
    core = make_core(2, forget_after_s=100.0, index=IndexSettings(snapshot_retry_s=5.0))
    assert core.on_cache_event(make_event("w0", 7, hashes=PREFIX), NOW) is False  # history missing
    core.tick(NOW + 2)
    assert core.pop_snapshot_requests() == []  # asked 2 s ago
    core.tick(NOW + 6)
    assert core.pop_snapshot_requests() == ["w0"]
    core.on_heartbeat(make_hb("w0", seq=3), NOW + 50)
    core.tick(NOW + 120)
    assert set(core.workers) == {"w0"}  # w1 silent for 120 s > 100 s: forgotten
    assert core.stats(NOW + 120)["workers"] == {"stale": 1}


def test_stats_counts_states():
    core = make_core(3)
    core.on_heartbeat(make_hb("w2", seq=3, state="backoff"), NOW)
    st = core.stats(NOW + 1.5)  # within 2 heartbeat periods (1 s)
    assert st["workers"] == {"healthy": 2, "backoff": 1} and st["policy"] == "natsched"
    assert core.stats(NOW + 20)["workers"] == {"stale": 3}


def test_a_migrated_stream_is_routed_as_prefill_of_prompt_and_output_so_far_and_decode_of_the_rest():
    """``resume_token_ids`` (natsched.client.producer.Migration): what the worker will prefill is
    the prompt plus them, and what it will generate is only the rest."""
    from natsched.router.policy import RouteRequest
    from natsched.wire.schema import Request

    plain = Request(id="m", tenant="t", cls="online", prompt_token_ids=list(range(64)), max_tokens=100)
    moved = Request(id="m", tenant="t", cls="online", prompt_token_ids=list(range(64)), max_tokens=100,
                    resume_token_ids=list(range(30)))
    a, b = RouteRequest.from_request(plain, 32), RouteRequest.from_request(moved, 32)
    assert (a.prompt_tokens, a.expected_output) == (64, 100)
    assert (b.prompt_tokens, b.expected_output) == (94, 70)
    assert b.hashes == a.hashes  # the prompt's blocks: where its prefix is cached
