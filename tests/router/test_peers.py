"""Baseline and peer policies: each one's documented rule, and make_policy for every name."""

from __future__ import annotations

from collections import Counter

import pytest

from natsched.router.costmodel import CostModel
from natsched.router.deps import PolicyDeps
from natsched.router.errors import ConfigError, UnknownPolicyError
from natsched.router.index import IndexSettings, PrefixIndex
from natsched.router.peers import (AibrixParams, AibrixPrefix, DynamoKv, DynamoParams, LlmdAffinity,
                                   LlmdAffinityParams, LlmdScorers, PrebleE2, SmetricParams, VllmSmetric)
from natsched.router.policies import POLICIES, ConsistentHash, LeastLoaded, RoundRobin, make_policy
from natsched.router.sglang import SglangCacheAware, SglangParams
from tests.factories.router import chain, make_event, make_req, make_view

NOW = 1000.0
ALL = {"natsched", "round_robin", "least_loaded", "consistent_hash", "sglang_cache_aware", "dynamo_kv",
       "llmd_scorers", "preble_e2", "llmd_affinity", "vllm_smetric", "aibrix_prefix"}


def make_deps(**holdings) -> PolicyDeps:
    """Deps over an index where ``worker=hashes`` are precise claims."""
    idx = PrefixIndex(IndexSettings(min_prefix_blocks=1))
    for w, hashes in holdings.items():
        assert idx.apply(make_event(w, 1, hashes=hashes), 0.0)
    return PolicyDeps(idx, CostModel(), 32)


def views(n: int = 3, **overrides):
    """``n`` idle views; ``w1=dict(waiting=3)`` overrides one of them."""
    return [make_view(f"w{i}", **overrides.get(f"w{i}", {})) for i in range(n)]


# ---------------------------------------------------------------- registry of names


def test_every_policy_name_is_registered_and_buildable():
    assert set(POLICIES) == ALL
    for name in ALL:
        p = make_policy(name)
        assert p.name == name
        d = p.route(make_req(), views(), NOW)
        assert d.worker in {"w0", "w1", "w2"} and d.policy == name
        assert p.route(make_req(), [], NOW).worker is None


def test_make_policy_errors():
    with pytest.raises(UnknownPolicyError) as e:
        make_policy("nope")
    assert isinstance(e.value, ValueError)
    with pytest.raises(ConfigError):
        make_policy("round_robin", weights={"x": 1})
    with pytest.raises(ConfigError):
        make_policy("natsched", weights={"no_such_weight": 1.0})
    with pytest.raises(ConfigError):
        make_policy("natsched", weights={"min_gain": "high"})
    with pytest.raises(ConfigError):
        make_policy("natsched", weights={"consistent_hash": 1})


def test_make_policy_applies_weights():
    p = make_policy("llmd_scorers", weights={"prefix_weight": 5})
    assert p.p.prefix_weight == 5 and p.p.queue_weight == 2.0


# ---------------------------------------------------------------- baselines


def test_round_robin_cycles_in_id_order():
    p = RoundRobin()
    ws = [make_view("b"), make_view("a"), make_view("c")]
    assert [p.route(make_req(), ws, NOW).worker for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_picks_fewest_inflight():
    d = LeastLoaded().route(make_req(), views(w0=dict(running=5), w1=dict(waiting=1), w2=dict(pending=3)), NOW)
    assert d.worker == "w1" and d.scores == {"w0": 5.0, "w1": 1.0, "w2": 3.0}


def test_consistent_hash_is_sticky_and_moves_only_the_lost_workers_keys():
    p = ConsistentHash()
    four, three = views(4), views(3)
    before = {k: p.route(make_req(route_key=k), four, NOW).worker for k in range(2000)}
    counts = Counter(before.values())
    assert len(counts) == 4 and min(counts.values()) > 2000 * 0.15  # 160 vnodes spread well
    after = {k: p.route(make_req(route_key=k), three, NOW).worker for k in range(2000)}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k, w in before.items() if w == "w3"}


def test_consistent_hash_key_falls_back_to_first_block():
    p = ConsistentHash()
    a = p.route(make_req(hashes=chain(5, "s") + chain(3, "x")), views(4), NOW).worker
    b = p.route(make_req(hashes=chain(5, "s") + chain(3, "y")), views(4), NOW).worker
    assert a == b


# ---------------------------------------------------------------- sglang


def test_sglang_balanced_high_match_goes_to_best_matching_tree():
    p = SglangCacheAware(make_deps())
    first = p.route(make_req("a", hashes=chain(10, "s")), views(), NOW)
    assert first.reason == "smallest_tree"
    again = p.route(make_req("b", hashes=chain(6, "s") + chain(4, "t")), views(w0=dict(running=5)), NOW)
    assert again.worker == first.worker and again.reason == "cache"  # 60 % > 0.5
    assert again.expected_cached_tokens == 6 * 32


def test_sglang_low_match_goes_to_smallest_tree():
    p = SglangCacheAware(make_deps())
    p.route(make_req("a", hashes=chain(10, "s")), views(2), NOW)  # w0 gets 10 blocks
    d = p.route(make_req("b", hashes=chain(4, "s") + chain(6, "t")), views(2), NOW)  # 40 %
    assert d.worker == "w1" and d.reason == "smallest_tree"


@pytest.mark.parametrize("w0_running, imbalanced", [(32, False), (33, True)])
def test_sglang_imbalance_thresholds(w0_running, imbalanced):
    p = SglangCacheAware(make_deps())
    p.route(make_req("a", hashes=chain(10, "s")), views(2), NOW)  # w0's tree has the prefix
    d = p.route(make_req("b", hashes=chain(10, "s")), views(2, w0=dict(running=w0_running)), NOW)
    assert d.worker == ("w1" if imbalanced else "w0")
    if imbalanced:
        assert d.reason == "imbalanced" and p.tree_blocks("w1") == 10  # still inserted


def test_sglang_relative_threshold_matters():
    p = SglangCacheAware(make_deps(), SglangParams(balance_rel_threshold=2.0))
    p.route(make_req("a", hashes=chain(10, "s")), views(2), NOW)
    d = p.route(make_req("b", hashes=chain(10, "s")), views(2, w0=dict(running=70), w1=dict(running=36)), NOW)
    assert d.worker == "w0"  # 70 - 36 > 32 but 70 < 2 x 36: balanced


def test_sglang_trees_are_trimmed_lru():
    p = SglangCacheAware(make_deps(), SglangParams(max_tree_size=8 * 32))
    p.route(make_req("a", hashes=chain(6, "a")), views(1), NOW)
    p.route(make_req("b", hashes=chain(6, "b")), views(1), NOW)
    assert p.tree_blocks("w0") == 8
    assert p._match("w0", chain(6, "b")) == 6 and p._match("w0", chain(6, "a")) == 2


# ---------------------------------------------------------------- dynamo


def test_dynamo_cost_is_uncached_prefill_blocks_plus_decode_blocks():
    req = make_req(hashes=chain(10, "s"))  # 320 tokens, 10 blocks
    deps = make_deps(w0=chain(6, "s"))
    d = DynamoKv(deps).route(req, views(2, w0=dict(runtime_tokens=64 * 32)), NOW)
    assert d.scores == {"w0": pytest.approx(4 + 64 + 10), "w1": pytest.approx(10 + 0 + 10)}
    assert d.worker == "w1"
    d = DynamoKv(deps).route(req, views(2, w0=dict(runtime_tokens=2 * 32)), NOW)
    assert d.worker == "w0" and d.expected_cached_tokens == 6 * 32


def test_dynamo_overlap_weight_zero_is_pure_load():
    deps = make_deps(w0=chain(10, "s"))
    p = DynamoKv(deps, DynamoParams(overlap_score_weight=0.0))
    assert p.route(make_req(hashes=chain(10, "s")), views(2, w0=dict(runtime_tokens=32)), NOW).worker == "w1"


def test_dynamo_temperature_samples_but_favours_low_cost():
    deps = make_deps(w0=chain(10, "s"))
    p = DynamoKv(deps, DynamoParams(temperature=1.0, seed=1))
    picks = Counter(p.route(make_req(hashes=chain(10, "s")), views(2), NOW).worker for _ in range(300))
    assert picks["w0"] > picks["w1"] > 0


# ---------------------------------------------------------------- llm-d


def test_llmd_weighted_scorers():
    deps = make_deps(w0=chain(5, "s"))
    req = make_req(hashes=chain(10, "s"))
    ws = views(2, w0=dict(waiting=4, runtime_tokens=200_000), w1=dict(waiting=0))
    d = LlmdScorers(deps).route(req, ws, NOW)
    # w0: 3 x 0.5 + 2 x 0 + 2 x 0.5 = 2.5 ; w1: 0 + 2 x 1 + 2 x 1 = 4
    assert d.scores == {"w0": pytest.approx(2.5), "w1": pytest.approx(4.0)} and d.worker == "w1"
    d = LlmdScorers(deps).route(req, views(2, w1=dict(waiting=1)), NOW)
    assert d.worker == "w0"  # 3 x 0.5 + 2 + 2 = 5.5 > 0 + 0 + 2 = 2


# ---------------------------------------------------------------- preble


def test_preble_exploits_when_cached_exceeds_remaining():
    deps = make_deps(w0=chain(6, "s"))
    d = PrebleE2(deps).route(make_req(hashes=chain(10, "s")), views(2, w0=dict(queued_prefill_tokens=50_000)), NOW)
    assert d.worker == "w0" and d.reason == "exploit" and d.expected_cached_tokens == 192


def test_preble_explores_by_cost_when_cache_is_short():
    deps = make_deps(w0=chain(4, "s"))
    d = PrebleE2(deps).route(make_req(hashes=chain(10, "s")), views(2, w0=dict(queued_prefill_tokens=50_000)), NOW)
    assert d.worker == "w1" and d.reason == "explore"
    d = PrebleE2(deps).route(make_req(hashes=chain(10, "s")), views(2), NOW)
    assert d.worker == "w0"  # equal load: the shorter prefill wins


# ---------------------------------------------------------------- llm-d affinity filter + token load


def test_llmd_affinity_keeps_warm_endpoints_and_picks_the_least_token_loaded_of_them():
    hashes = chain(10)
    deps = make_deps(w0=hashes, w1=hashes[:9], w2=hashes[:5])  # scores 1.0, 0.9, 0.5
    ws = views(3, w0=dict(queued_prefill_tokens=4000), w1=dict(queued_prefill_tokens=1000))
    d = LlmdAffinity(deps).route(make_req(hashes=hashes, prompt_tokens=320), ws, NOW)
    assert (d.worker, d.reason) == ("w1", "sticky")  # w2 is idle but below the 0.80 threshold


def test_llmd_affinity_load_gate_reopens_the_pool():
    hashes = chain(10)
    deps = make_deps(w0=hashes)
    rate = deps.cost.prefill_tokens_per_s
    p = LlmdAffinity(deps, LlmdAffinityParams(max_ttft_penalty_s=1.0))
    busy = views(2, w0=dict(queued_prefill_tokens=int(2 * rate)))  # 2 s behind an idle w1
    d = p.route(make_req(hashes=hashes, prompt_tokens=320), busy, NOW)
    assert (d.worker, d.reason) == ("w1", "load_gate")
    ok = views(2, w0=dict(queued_prefill_tokens=int(0.5 * rate)))
    assert p.route(make_req(hashes=hashes, prompt_tokens=320), ok, NOW).worker == "w0"
    # no match anywhere: the whole pool, least token load
    d = p.route(make_req(hashes=chain(4, "other"), prompt_tokens=128), ok, NOW)
    assert (d.worker, d.reason) == ("w1", "no_match")


# ---------------------------------------------------------------- vllm-project/router smetric


def test_smetric_keeps_affinity_while_the_slo_holds_then_takes_the_fastest():
    hashes = chain(64)  # 2048 tokens, all cached on w0
    deps = make_deps(w0=hashes)
    rate = deps.cost.prefill_tokens_per_s
    p = VllmSmetric(deps, SmetricParams(ttft_slo_s=1.0))
    ws = views(2, w0=dict(queued_prefill_tokens=int(0.5 * rate)))
    d = p.route(make_req(hashes=hashes, prompt_tokens=2048), ws, NOW)
    assert (d.worker, d.reason) == ("w0", "affinity")
    ws = views(2, w0=dict(queued_prefill_tokens=int(1.5 * rate)))  # the holder would miss the SLO
    d = p.route(make_req(hashes=hashes, prompt_tokens=2048), ws, NOW)
    assert (d.worker, d.reason) == ("w1", "ttft")
    with pytest.raises(ConfigError):
        SmetricParams(ttft_slo_s=0)


# ---------------------------------------------------------------- AIBrix prefix-cache


def test_aibrix_imbalance_sends_to_least_running():
    hashes = chain(8)
    deps = make_deps(w0=hashes)
    ws = views(3, w0=dict(running=20), w1=dict(running=2), w2=dict(running=5))
    d = AibrixPrefix(deps).route(make_req(hashes=hashes), ws, NOW)
    assert (d.worker, d.reason) == ("w1", "imbalanced")  # 20 - 2 > 16: the match is ignored


def test_aibrix_prefers_the_best_match_within_mean_plus_two_std():
    hashes = chain(8)
    deps = make_deps(w0=hashes, w1=hashes[:4])
    ws = views(3, w0=dict(running=3), w1=dict(running=1), w2=dict(running=0))
    d = AibrixPrefix(deps).route(make_req(hashes=hashes), ws, NOW)
    assert (d.worker, d.reason) == ("w0", "prefix")
    # load_factor 0: only holders at or below the mean qualify -> w1 (1 <= 1.33), the shorter match
    d = AibrixPrefix(deps, AibrixParams(load_factor=0.0)).route(make_req(hashes=hashes), ws, NOW)
    assert (d.worker, d.reason) == ("w1", "prefix")
    d = AibrixPrefix(deps).route(make_req(hashes=chain(3, "cold")), ws, NOW)
    assert (d.worker, d.reason) == ("w2", "least_request")
