"""PrefixIndex: longest-prefix matching, sequencing/trust, approximate claims, bounded memory."""

from __future__ import annotations

import pytest

from natsched.router.errors import ConfigError
from natsched.router.index import IndexSettings, PrefixIndex
from tests.factories.router import chain, make_event


def make_index(**kw) -> PrefixIndex:
    kw.setdefault("min_prefix_blocks", 1)
    return PrefixIndex(IndexSettings(**kw))


W = ["w0", "w1", "w2"]


def test_match_counts_leading_blocks_per_worker():
    idx = make_index()
    c = chain(8, "a")
    assert idx.apply(make_event("w0", 1, hashes=c[:5]), 0.0)
    assert idx.apply(make_event("w1", 1, hashes=c[:2]), 0.0)
    assert idx.apply(make_event("w2", 1, hashes=c[3:8]), 0.0)  # no root: no usable prefix
    assert idx.match(c, 1.0, W) == {"w0": 5, "w1": 2}


def test_match_stops_at_first_missing_block():
    idx = make_index()
    c = chain(6, "a")
    idx.apply(make_event("w0", 1, hashes=c[:2] + c[3:]), 0.0)
    assert idx.match(c, 0.0, W) == {"w0": 2}
    assert idx.match_one(c, "w0", 0.0) == 2


def test_only_asked_workers_are_answered():
    idx = make_index()
    c = chain(3, "a")
    idx.apply(make_event("w0", 1, hashes=c), 0.0)
    idx.apply(make_event("w1", 1, hashes=c), 0.0)
    assert idx.match(c, 0.0, ["w1"]) == {"w1": 3}


def test_short_prefixes_are_not_indexed_nor_reported():
    idx = make_index(min_prefix_blocks=3)
    c = chain(6, "a")
    idx.record_route(c[:2], "w0", 1.0)  # below the minimum: not indexed at all
    assert len(idx) == 0
    idx.apply(make_event("w1", 1, hashes=c[:2]), 1.0)
    idx.apply(make_event("w2", 1, hashes=c[:4]), 1.0)
    assert idx.match(c, 1.0, W) == {"w2": 4}  # w1's 2-block match is under the minimum
    assert idx.match_one(c, "w1", 1.0) == 0


def test_removed_and_cleared_events():
    idx = make_index()
    c = chain(5, "a")
    idx.apply(make_event("w0", 1, hashes=c), 0.0)
    idx.apply(make_event("w1", 1, hashes=c), 0.0)
    idx.apply(make_event("w0", 2, kind="removed", hashes=c[3:]), 0.0)
    assert idx.match(c, 0.0, W) == {"w0": 3, "w1": 5}
    idx.apply(make_event("w1", 2, kind="cleared"), 0.0)
    assert idx.match(c, 0.0, W) == {"w0": 3}


def test_duplicate_event_is_ignored():
    idx = make_index()
    c = chain(4, "a")
    idx.apply(make_event("w0", 1, hashes=c, ts=10.0), 0.0)
    idx.apply(make_event("w0", 2, kind="removed", hashes=c[2:], ts=11.0), 0.0)
    assert idx.apply(make_event("w0", 1, hashes=c, ts=10.0), 0.0) is True  # redelivered: no effect
    assert idx.match_one(c, "w0", 0.0) == 2


def test_sequence_gap_distrusts_worker_until_snapshot():
    idx = make_index(snapshot_retry_s=5.0)
    c, d = chain(4, "a"), chain(4, "b")
    idx.apply(make_event("w0", 1, hashes=c), 0.0)
    assert idx.apply(make_event("w0", 3, hashes=d), 1.0) is False  # seq 2 was lost
    assert not idx.is_trusted("w0")
    assert idx.match(c, 1.0, W) == {}
    # still untrusted, but the snapshot was asked for a moment ago: don't ask again yet
    assert idx.apply(make_event("w0", 4, hashes=d), 2.0) is True
    assert idx.apply(make_event("w0", 5, hashes=d), 6.5) is False  # retry interval passed
    assert idx.apply(make_event("w0", 9, kind="snapshot", hashes=d), 7.0) is True
    assert idx.is_trusted("w0")
    assert idx.match(d, 7.0, W) == {"w0": 4}
    assert idx.match(c, 7.0, W) == {}  # the snapshot replaced the old view
    assert idx.apply(make_event("w0", 10, hashes=c), 8.0) is True  # sequence continues
    assert idx.match(c, 8.0, W) == {"w0": 4}


def test_first_event_not_seq_1_means_missing_history():
    idx = make_index()
    assert idx.apply(make_event("w0", 500, hashes=chain(3)), 0.0) is False
    assert not idx.is_trusted("w0")


def test_seq_restart_at_1_drops_old_claims():
    idx = make_index()
    c, d = chain(4, "a"), chain(4, "b")
    idx.apply(make_event("w0", 1, hashes=c, ts=10.0), 0.0)
    idx.apply(make_event("w0", 2, hashes=d, ts=11.0), 0.0)
    assert idx.apply(make_event("w0", 1, hashes=d[:2], ts=20.0), 5.0) is True  # restarted
    assert idx.match(c, 5.0, W) == {}
    assert idx.match(d, 5.0, W) == {"w0": 2}


def test_approximate_claims_expire_after_ttl():
    idx = make_index(approx_ttl_s=10.0)
    c = chain(4, "a")
    idx.record_route(c, "w0", 100.0)
    assert idx.match(c, 109.0, W) == {"w0": 4}
    assert idx.match(c, 111.0, W) == {}


def test_precise_claim_outlives_approximate_ttl():
    idx = make_index(approx_ttl_s=10.0)
    c = chain(4, "a")
    idx.apply(make_event("w0", 1, hashes=c), 100.0)
    idx.record_route(c, "w0", 101.0)  # must not downgrade the precise claim
    assert idx.match(c, 500.0, W) == {"w0": 4}


def test_reset_worker_voids_all_claims_but_accepts_new_ones():
    idx = make_index()
    c, d = chain(4, "a"), chain(4, "b")
    idx.apply(make_event("w0", 1, hashes=c), 0.0)
    idx.record_route(d, "w0", 1.0)
    idx.reset_worker("w0", 2.0)
    assert idx.match(c, 2.0, W) == {} and idx.match(d, 2.0, W) == {}
    assert idx.last_seq("w0") == 0
    assert idx.apply(make_event("w0", 1, hashes=c[:2]), 3.0) is True
    idx.record_route(d, "w0", 3.0)
    assert idx.match(c, 3.0, W) == {"w0": 2}
    assert idx.match(d, 3.0, W) == {"w0": 4}


def test_lru_bound_evicts_leaves_before_roots():
    idx = make_index(max_entries=10)
    a, b = chain(6, "a"), chain(6, "b")
    idx.record_route(a, "w0", 1.0)
    idx.record_route(b, "w1", 2.0)
    assert len(idx) == 10
    assert idx.match(b, 2.0, W) == {"w1": 6}
    assert idx.match(a, 2.0, W) == {"w0": 4}  # a's two deepest blocks went first


def test_lru_bound_applies_to_event_claims_leaf_first():
    idx = make_index(max_entries=10)
    a, b = chain(6, "a"), chain(6, "b")
    idx.apply(make_event("w0", 1, hashes=a), 0.0)
    idx.apply(make_event("w0", 2, hashes=b), 0.0)
    assert idx.match(a, 0.0, W) == {"w0": 4}
    assert idx.match(b, 0.0, W) == {"w0": 6}


def test_lookup_of_shared_root_keeps_it_warm_on_write():
    idx = make_index(max_entries=8)
    root = chain(2, "sys")
    idx.record_route(root + chain(2, "u1"), "w0", 1.0)
    for i in range(2, 5):  # many users share the system prompt
        idx.record_route(root + chain(2, f"u{i}"), "w0", float(i))
    assert idx.match_one(root, "w0", 5.0) == 2


def test_distrust_hides_claims_and_is_reported_once():
    idx = make_index()
    c = chain(3, "a")
    idx.apply(make_event("w0", 1, hashes=c), 0.0)
    assert idx.distrust("w0", "test") is True
    assert idx.distrust("w0", "test") is False
    assert idx.match(c, 0.0, W) == {}
    assert idx.needs_snapshot("w0", 0.0) is True
    assert idx.needs_snapshot("w0", 1.0) is False


def test_expire_drops_only_dead_entries_from_the_front():
    idx = make_index(approx_ttl_s=10.0)
    old, new = chain(3, "old"), chain(3, "new")
    idx.record_route(old, "w0", 1.0)
    idx.record_route(new, "w1", 50.0)
    assert idx.expire(55.0) == 3
    assert len(idx) == 3
    assert idx.match(new, 55.0, W) == {"w1": 3}


def test_is_fresh_follows_sequence():
    idx = make_index()
    idx.apply(make_event("w0", 1, hashes=chain(2)), 0.0)
    assert idx.is_fresh("w0", 1)
    assert not idx.is_fresh("w0", 2)


def test_negative_time_is_rejected_and_bad_settings_raise():
    with pytest.raises(ConfigError):
        make_index().record_route(chain(3), "w0", -1.0)
    with pytest.raises(ConfigError):
        IndexSettings(max_entries=0)


# ---------------------------------------------------------------- precise matches, eviction log


def test_precise_match_ignores_our_own_routing_claims():
    idx = make_index()
    c = chain(6, "a")
    idx.apply(make_event("w0", 1, hashes=c[:2]), 0.0)
    idx.record_route(c, "w0", 1.0)
    assert idx.match_one(c, "w0", 1.0) == 6
    assert idx.match_one(c, "w0", 1.0, precise=True) == 2


def test_removed_since_tells_evictions_after_a_mark_from_earlier_ones():
    idx = make_index()
    c = chain(4, "a")
    idx.apply(make_event("w0", 1, hashes=c), 0.0)
    idx.apply(make_event("w0", 2, kind="removed", hashes=c[:1]), 0.0)
    m = idx.mark()
    assert not idx.removed_since("w0", c[0], m)  # removed before the mark
    idx.apply(make_event("w0", 3, kind="removed", hashes=c[2:3]), 0.0)
    idx.apply(make_event("w1", 1, kind="removed", hashes=c[3:]), 0.0)
    assert idx.removed_since("w0", c[2], m)
    assert not idx.removed_since("w0", c[3], m)  # another worker's eviction
    assert idx.removed_since("w1", c[3], m)


def test_a_snapshot_or_reset_counts_as_removing_everything():
    idx = make_index()
    c = chain(3, "a")
    idx.apply(make_event("w0", 1, hashes=c), 0.0)
    m = idx.mark()
    idx.apply(make_event("w0", 2, kind="snapshot", hashes=c), 1.0)
    assert idx.removed_since("w0", c[1], m)
    m2 = idx.mark()
    assert not idx.removed_since("w0", c[1], m2)
    idx.reset_worker("w0", 2.0)
    assert idx.removed_since("w0", c[1], m2)


def test_eviction_log_is_bounded_and_gives_the_benefit_of_the_doubt():
    idx = make_index(removed_log_entries=4)
    c = chain(10, "a")
    m0 = idx.mark()
    for i, h in enumerate(c):
        idx.apply(make_event("w0", i + 1, kind="removed", hashes=[h]), 0.0)
    assert idx.stats()["removed_log"] == 4
    assert idx.removed_since("w0", c[0], m0)  # forgotten, but it may have been removed after m0
    m = idx.mark()
    assert not idx.removed_since("w0", c[0], m)  # nothing dropped after m could matter
