"""The default ``natsched`` policy and the cost model it stands on.

Numbers used below (default CostModel): prefill 35k tokens/s, so 1600 cached tokens save 45.7 ms
of prefill; at an idle cluster the locality boost doubles that to 91.4 ms.
"""

from __future__ import annotations

import pytest

from natsched.router.costmodel import CostModel
from natsched.router.deps import PolicyDeps
from natsched.router.errors import ConfigError
from natsched.router.hashring import HashRing
from natsched.router.index import IndexSettings, PrefixIndex
from natsched.router.natsched import NatschedParams, NatschedPolicy, worth_waiting
from tests.factories.router import chain, make_event, make_req, make_view

NOW = 1000.0


class Setup:
    """A natsched policy over a fresh index; ``hold`` gives a worker a precise prefix claim."""

    def __init__(self, **params):
        self.index = PrefixIndex(IndexSettings(min_prefix_blocks=1))
        self.policy = NatschedPolicy(PolicyDeps(self.index, CostModel(), 32), NatschedParams(**params))
        self._seq: dict[str, int] = {}

    def hold(self, worker: str, hashes) -> None:
        self._seq[worker] = self._seq.get(worker, 0) + 1
        assert self.index.apply(make_event(worker, self._seq[worker], hashes=hashes), 0.0)

    def route(self, req, *views, now: float = NOW):
        return self.policy.route(req, list(views), now)


REQ = make_req(hashes=chain(100, "sys"))  # 3200 prompt tokens


def test_holder_wins_at_equal_load():
    s = Setup()
    s.hold("w1", REQ.hashes[:50])
    d = s.route(REQ, make_view("w0"), make_view("w1"), make_view("w2"))
    assert d.worker == "w1" and d.reason == "cache"
    assert d.expected_cached_tokens == 1600
    assert set(d.scores) == {"w0", "w1", "w2"} and min(d.scores, key=d.scores.get) == "w1"


def test_overloaded_holder_loses_to_idle_worker():
    s = Setup()
    s.hold("w0", REQ.hashes[:50])
    d = s.route(REQ, make_view("w0", queued_prefill_tokens=100_000), make_view("w1"))
    assert d.worker == "w1" and d.reason == "load"
    assert d.expected_cached_tokens == 0


@pytest.mark.parametrize("held_blocks, winner", [(29, "w1"), (31, "w0")])
def test_match_under_min_gain_is_ignored(held_blocks, winner):
    s = Setup()  # min_gain 0.3 of a 100-block prompt
    s.hold("w0", REQ.hashes[:held_blocks])
    d = s.route(REQ, make_view("w0", queued_prefill_tokens=100), make_view("w1"))
    assert d.worker == winner


@pytest.mark.parametrize("running, winner", [(0, "w0"), (250, "w1")])
def test_locality_favoured_at_low_load_balance_at_high_load(running, winner):
    # w0 caches 1600 tokens (45.7 ms) with 800 tokens (22.9 ms) of prefill queued, but decodes a
    # heavier batch: worth it only while the locality boost (x (1 - u)) adds weight to the cache.
    s = Setup()
    s.hold("w0", REQ.hashes[:50])
    d = s.route(REQ, make_view("w0", queued_prefill_tokens=800, running=running, kv_used_blocks=2000),
                make_view("w1", running=running))
    assert d.worker == winner


def test_a_holder_queued_longer_than_its_prefix_saves_gets_no_future_value():
    # w0 caches 1600 tokens (45.7 ms) behind 2400 queued (68.6 ms): its next requests would wait
    # longer there than the prefix saves them, so keeping it there is worth nothing
    s = Setup()
    s.hold("w0", REQ.hashes[:50])
    d = s.route(REQ, make_view("w0", queued_prefill_tokens=2400), make_view("w1"))
    assert d.worker == "w1" and d.terms["w0"]["cache_bonus"] == 0.0
    # queued about half of what it saves: about half of the future value is left
    holder = make_view("w0", queued_prefill_tokens=800)
    d = s.route(REQ, holder, make_view("w1"))
    cost = CostModel()
    saved, wait = cost.prefill_ctx_s(1600), cost.wait_s(holder, NOW)
    assert 0.4 < wait / saved < 0.6
    assert d.worker == "w0" and d.terms["w0"]["cache_bonus"] == pytest.approx(6.0 * (1 - wait / saved) * saved)


def test_worth_waiting_bounds():
    assert worth_waiting(0.0, 1.0) == 1.0 and worth_waiting(0.25, 1.0) == 0.75
    assert worth_waiting(1.0, 1.0) == 0.0 and worth_waiting(3.0, 1.0) == 0.0
    assert worth_waiting(0.0, 0.0) == 0.0  # nothing cached, nothing to wait for


def test_sticky_worker_keeps_prefix_despite_small_load_difference():
    s = Setup(churn_weight=0.0)  # isolate stickiness from the cache-pressure term
    s.hold("w0", REQ.hashes[:50])
    s.hold("w1", REQ.hashes[:50])
    assert s.route(REQ, make_view("w0"), make_view("w1")).worker == "w0"  # tie -> smaller id
    views = (make_view("w0", kv_used_blocks=100), make_view("w1"))  # w0 now ~5 ms worse (a heavier batch)
    d = s.route(REQ, *views, now=NOW + 5)
    assert d.worker == "w0" and d.reason == "sticky"
    assert s.route(REQ, *views, now=NOW + 40).worker == "w1"  # window (30 s) is over


def test_without_stickiness_small_difference_moves_the_prefix():
    s = Setup(stickiness=0.0, stickiness_s=0.0, churn_weight=0.0)
    s.hold("w0", REQ.hashes[:50])
    s.hold("w1", REQ.hashes[:50])
    s.route(REQ, make_view("w0"), make_view("w1"))
    assert s.route(REQ, make_view("w0", queued_prefill_tokens=700), make_view("w1"), now=NOW + 5).worker == "w1"


def busy_holders(running: int = 0, queued: int = 20_000):  # 20k tokens: 0.57 s, more than the cache saves
    return [make_view(w, queued_prefill_tokens=queued, running=running) for w in ("w0", "w1", "w2")]


def test_replica_cap_keeps_hot_prefix_on_its_replicas():
    s = Setup()
    for w in ("w0", "w1", "w2"):
        s.hold(w, REQ.hashes[:50])
    d = s.route(REQ, *busy_holders(queued=800), make_view("w3"))  # 22.9 ms queued for 45.7 ms saved
    assert d.worker in {"w0", "w1", "w2"} and d.reason.endswith("+capped")
    assert "w3" not in d.scores


def test_replica_cap_is_lifted_when_every_holder_is_queued_longer_than_its_prefix_saves():
    s = Setup()
    for w in ("w0", "w1", "w2"):
        s.hold(w, REQ.hashes[:50])
    d = s.route(REQ, *busy_holders(), make_view("w3"))  # batch slots free, but 0.57 s queued for 45.7 ms
    assert d.worker == "w3" and not d.reason.endswith("+capped")


def test_replica_cap_is_raised_when_replicas_are_saturated():
    s = Setup()
    for w in ("w0", "w1", "w2"):
        s.hold(w, REQ.hashes[:50])
    assert s.route(REQ, *busy_holders(running=230), make_view("w3")).worker == "w3"


def test_higher_replica_cap_allows_new_replica():
    s = Setup(replica_cap=4)
    for w in ("w0", "w1", "w2"):
        s.hold(w, REQ.hashes[:50])
    assert s.route(REQ, *busy_holders(), make_view("w3")).worker == "w3"


@pytest.mark.parametrize("joined_at, winner", [(NOW - 1, "w1"), (NOW - 120, "w0")])
def test_newly_joined_worker_gets_warmup_boost(joined_at, winner):
    s = Setup(warmup_boost=1.0, warmup_s=60.0, locality_boost=1.0)
    s.hold("w0", REQ.hashes[:40])  # 1280 tokens: ~75 ms advantage at idle; the boost is ~90 ms
    d = s.route(REQ, make_view("w0"), make_view("w1", joined_at=joined_at))
    assert d.worker == winner


def test_consistent_hash_home_for_cold_prefixes():
    s = Setup(consistent_hash=True)
    views = [make_view(f"w{i}") for i in range(4)]
    ring = HashRing(160)
    ring.ensure(v.id for v in views)
    chosen = set()
    for k in range(40):
        req = make_req(f"r{k}", hashes=chain(10, f"cold{k}"), route_key=k)
        d = s.route(req, *views)
        assert d.worker == ring.owner(k) and d.reason == "home"
        chosen.add(d.worker)
    assert len(chosen) >= 3


def test_consistent_hash_home_respects_load_bound():
    s = Setup(consistent_hash=True)
    ring = HashRing(160)
    ring.ensure(f"w{i}" for i in range(4))
    home = ring.owner(7)
    views = [make_view(f"w{i}", running=100 if f"w{i}" == home else 0) for i in range(4)]
    assert s.route(make_req(hashes=chain(10, "x"), route_key=7), *views).worker != home


def test_holder_busy_with_a_long_prefill_loses_to_an_idle_worker():
    # the wait is the registry's busy-until estimate, in seconds, counting down with the clock
    s = Setup()
    s.hold("w0", REQ.hashes[:50])
    holder = make_view("w0", busy_until=NOW + 3.0)  # e.g. a 60k-token prompt still prefilling
    assert s.route(REQ, holder, make_view("w1")).worker == "w1"
    assert s.route(REQ, holder, make_view("w1"), now=NOW + 2.95).worker == "w0"


def test_cache_pressure_spreads_cold_requests():
    views = [make_view(f"w{i}") for i in range(4)]  # identical, idle: only the policy's state differs
    cold = [make_req(f"r{k}", hashes=chain(20, f"cold{k}")) for k in range(8)]
    spread = Setup()
    assert sorted(spread.route(r, *views).worker for r in cold) == ["w0", "w0", "w1", "w1", "w2", "w2", "w3", "w3"]
    blind = Setup(churn_weight=0.0)
    assert {blind.route(r, *views).worker for r in cold} == {"w0"}


def test_cache_pressure_decays_with_time():
    s = Setup(churn_window_s=60.0)
    s.policy.churn.add("w0", 1000.0, NOW)
    assert s.policy.churn.at("w0", NOW + 60.0) == pytest.approx(1000.0 / 2.718281828, rel=1e-6)
    assert s.policy.churn.at("w1", NOW) == 0.0


@pytest.mark.parametrize("decode_weight, winner", [(0.3, "w1"), (0.0, "w0")])
def test_a_heavy_decode_batch_counts_with_the_decode_weight(decode_weight, winner):
    s = Setup(decode_weight=decode_weight, churn_weight=0.0)
    heavy = make_view("w0", kv_used_blocks=10_000)  # 320k KV tokens in its batch: +16 ms a step
    assert s.route(REQ, heavy, make_view("w1")).worker == winner


def test_no_worker():
    d = Setup().route(REQ)
    assert d.worker is None and d.reason == "no_worker"


@pytest.mark.parametrize("bad", [dict(sticky_window_s=5.0), dict(sticky_window_s=61.0), dict(min_gain=1.5),
                                 dict(replica_cap=0), dict(decode_weight=-1.0), dict(churn_window_s=0.0)])
def test_invalid_params_raise(bad):
    with pytest.raises(ConfigError):
        NatschedParams(**bad)


# ---------------------------------------------------------------- cost model


def test_finish_time_grows_with_uncached_tokens_backlog_and_output():
    m, w = CostModel(), make_view("w0")
    base = m.finish_s(w, 1000, 2000, 100)
    assert m.finish_s(w, 2000, 2000, 100) == pytest.approx(base + 1000 / 35_000)
    assert m.finish_s(make_view("w0", queued_prefill_tokens=35_000), 1000, 2000, 100) == pytest.approx(base + 1.0)
    assert m.finish_s(w, 1000, 2000, 200) > base


def test_kv_wait_only_when_the_request_does_not_fit():
    m = CostModel()
    assert m.kv_wait_s(make_view("w0", runtime_tokens=390_000), 5_000) == 0.0
    assert m.kv_wait_s(make_view("w0", runtime_tokens=399_000), 5_000) > 0.0


def test_utilisation_is_max_of_kv_and_batch_slots():
    m = CostModel(max_running=100)
    assert m.utilisation(make_view("w0", runtime_tokens=100_000, running=10)) == pytest.approx(0.25)
    assert m.utilisation(make_view("w0", runtime_tokens=100_000, running=50)) == pytest.approx(0.5)
    assert m.utilisation(make_view("w0", running=500)) == 1.0


def test_capacity_falls_back_to_blocks_then_profile():
    m = CostModel(kv_capacity_tokens=1234)
    assert m.capacity_tokens(make_view("w0", capacity_tokens=0, kv_total_blocks=10, block_size=16)) == 160
    assert m.capacity_tokens(make_view("w0", capacity_tokens=0)) == 1234


def test_prefill_at_long_context_costs_more_per_token():
    m = CostModel()
    assert m.prefill_ctx_s(0) == 0.0
    short = m.prefill_ctx_s(1000)
    assert short == pytest.approx(1000 / 35_000 * (1 + 500 / 30_500))
    # the same 1000 tokens after 60k cached ones: attention roughly triples their cost
    assert m.prefill_ctx_s(1000, 60_000) / short == pytest.approx((1 + 60_500 / 30_500) / (1 + 500 / 30_500))


def test_wait_counts_down_from_busy_until_else_uses_tokens():
    m = CostModel()
    w = make_view("w0", busy_until=NOW + 2.0, queued_prefill_tokens=999_999)
    assert m.wait_s(w, NOW) == pytest.approx(2.0)
    assert m.wait_s(w, NOW + 1.5) == pytest.approx(0.5)
    assert m.wait_s(w, NOW + 3.0) == 0.0
    assert m.wait_s(make_view("w0", queued_prefill_tokens=35_000), NOW) == pytest.approx(1.0)


@pytest.mark.parametrize("held_blocks, winner", [(45, "w1"), (55, "w0")])
def test_warmup_boost_is_worth_what_as_many_cached_tokens_are(held_blocks, winner):
    """At full locality strength a new worker competes like a holder of ``warmup_boost`` of the
    prompt: it wins against a smaller match and loses to a larger one (a boost worth only the
    prefill saved lost to every match: cold workers got no work for a minute)."""
    s = Setup(warmup_boost=0.5, warmup_s=60.0, churn_weight=0.0)  # 50 of the 100 blocks, as if cached
    s.hold("w0", REQ.hashes[:held_blocks])
    assert s.route(REQ, make_view("w0"), make_view("w1", joined_at=NOW - 1e-6)).worker == winner


def test_warmup_boost_stands_in_for_a_cached_prefix_and_is_not_added_to_one():
    """A joiner that already holds the prefix is scored on what it holds: the boost counts only the
    virtual tokens beyond it, so an equally loaded old holder of the same prefix ties with it and
    a joiner holding more of the prompt than the boost gets no boost at all."""
    s = Setup(warmup_boost=0.5, warmup_s=60.0, churn_weight=0.0)
    s.hold("w0", REQ.hashes[:60])  # the old worker: 60 of the 100 blocks
    s.hold("w1", REQ.hashes[:60])  # the joiner holds the same 60, more than the boost's 50
    d = s.route(REQ, make_view("w0"), make_view("w1", joined_at=NOW - 1e-6))
    assert d.scores["w1"] == pytest.approx(d.scores["w0"])
    s2 = Setup(warmup_boost=0.5, warmup_s=60.0, churn_weight=0.0)
    s2.hold("w0", REQ.hashes[:45])
    s2.hold("w1", REQ.hashes[:35])  # 35 real blocks + 15 virtual ones = the boost's 50: beats 45
    assert s2.route(REQ, make_view("w0"), make_view("w1", joined_at=NOW - 1e-6)).worker == "w1"
    s3 = Setup(warmup_boost=0.5, warmup_s=60.0, churn_weight=0.0)
    s3.hold("w0", REQ.hashes[:55])
    s3.hold("w1", REQ.hashes[:35])  # 50 in all against 55: the real match wins
    assert s3.route(REQ, make_view("w0"), make_view("w1", joined_at=NOW - 1e-6)).worker == "w0"


def test_a_joiner_queued_past_what_its_boost_stands_for_keeps_only_the_prefill_part():
    """The warm-up boost stands in for a cached prefix, so it is worth waiting for as one is
    (:func:`worth_waiting`): its future value fades with the joiner's queue. Without that, a joiner
    kept winning every cold prompt until its queue was as long as ``1 + locality`` times the virtual
    prefill (elastic: a 9k-token prompt queued 2.3 s on a six-second-old L4)."""
    s = Setup(warmup_boost=0.5, warmup_s=60.0, churn_weight=0.0)
    cost = CostModel()
    saved = cost.prefill_ctx_s(1600)  # the boost at join time: 50 of the 100 blocks
    idle = s.route(REQ, make_view("w0"), make_view("w1", joined_at=NOW - 1e-6))
    assert idle.terms["w1"]["warmup"] == pytest.approx(7.0 * saved)  # 1 + locality 6, nothing queued
    half = make_view("w1", joined_at=NOW - 1e-6, queued_prefill_tokens=800)
    d = s.route(REQ, make_view("w0"), half)
    wait = cost.wait_s(half, NOW)
    assert d.terms["w1"]["warmup"] == pytest.approx((1.0 + 6.0 * (1 - wait / saved)) * saved)
    long = make_view("w1", joined_at=NOW - 1e-6, queued_prefill_tokens=2400)  # queued past the saving
    d = s.route(REQ, make_view("w0"), long)
    assert d.terms["w1"]["warmup"] == pytest.approx(saved) and d.worker == "w0"
