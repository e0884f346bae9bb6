"""Benchmark metrics: the reuse ceiling and the pooled LRU on hand-made traces, percentiles, migration, load CV."""

from __future__ import annotations

import math

import pytest

from natsched.sim.metrics import (RequestRecord, ceiling_hit_ratio, coefficient_of_variation, migration_rate, percentile,
                         pooled_hit_ratio, summarize)
from tests.factories.sim import make_trace, trace_row


def test_ceiling_counts_the_longest_previously_seen_prefix_per_request():
    t = make_trace([
        trace_row(0, ids=[1, 2, 3]),             # 1536 tokens, nothing seen: 0
        trace_row(1, ids=[1, 2, 9]),             # shares 2 blocks: 1024
        trace_row(2, ids=[1, 2, 3]),             # 3 seen, but the last token is always computed: 2 blocks
        trace_row(3, n_in=1600, ids=[1, 2, 3, 4]),  # 3 full blocks seen (the 4th is partial): 1536
        trace_row(4, n_in=100, ids=[1]),         # no full block: 0
        trace_row(5, ids=[2, 3]),                # ids seen, but not as a prefix: 0
    ])
    total = 1536 * 3 + 1600 + 100 + 1024
    assert ceiling_hit_ratio(t.requests, 512) == pytest.approx((1024 + 1024 + 1536) / total)


def test_ceiling_uses_arrival_order_not_file_order():
    t = make_trace([trace_row(10, ids=[1, 2, 3]), trace_row(0, ids=[1, 2, 3, 4])])
    # the 4-block request arrives first and is a miss; the later 3-block one reuses 2 (capped)
    assert ceiling_hit_ratio(t.requests, 512) == pytest.approx(1024 / (1536 + 2048))


def test_ceiling_of_distinct_requests_is_zero():
    t = make_trace([trace_row(i, ids=[i, i + 100]) for i in range(5)])
    assert ceiling_hit_ratio(t.requests, 512) == 0.0


def test_pooled_lru_evicts_a_chain_from_its_tail():
    t = make_trace([
        trace_row(0, ids=[1, 2, 3]),             # fills the 3-block cache; its first block is the most recent
        trace_row(1, ids=[7]),                   # pushes out block 3 of the chain, not block 1
        trace_row(2, n_in=2048, ids=[1, 2, 3, 4]),  # so blocks 1 and 2 are still a usable prefix: 1024
    ])
    assert pooled_hit_ratio(t.requests, 512, 3) == pytest.approx(1024 / (1536 + 512 + 2048))
    assert pooled_hit_ratio(t.requests, 512, 4) == pytest.approx(1536 / (1536 + 512 + 2048))  # nothing evicted


def test_pooled_lru_runs_from_nothing_to_the_ceiling_as_it_grows():
    import random

    rng = random.Random(3)
    rows = [trace_row(i, ids=[rng.randrange(4)] + [rng.randrange(6) for _ in range(rng.randrange(1, 6))])
            for i in range(200)]
    reqs = make_trace(rows).requests
    ratios = [pooled_hit_ratio(reqs, 512, cap) for cap in (0, 2, 5, 10, 40, 10_000)]
    assert ratios[0] == 0.0
    assert ratios == sorted(ratios) and ratios[1] < ratios[-1]
    assert ratios[-1] == pytest.approx(ceiling_hit_ratio(reqs, 512))
    assert pooled_hit_ratio(reqs, 512, None) == ceiling_hit_ratio(reqs, 512)
    with pytest.raises(ValueError, match="capacity_blocks must be >= 0"):
        pooled_hit_ratio(reqs, 512, -1)


def test_percentile_interpolates_and_handles_empty():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile(list(range(101)), 90) == 90.0
    assert percentile([1, 2], 100) == 2.0


def _rec(i, worker, first_block, routed=None):
    return RequestRecord(index=i, arrival=float(i), prompt_tokens=10, output_tokens=2, first_block=first_block,
                         worker=worker, routed=float(i) if routed is None else routed, status="ok")


def test_migration_rate_counts_moves_among_repeated_first_blocks():
    recs = [_rec(0, "a", 1), _rec(1, "a", 1), _rec(2, "b", 1), _rec(3, "b", 2), _rec(4, "b", 1),
            _rec(5, "c", None), _rec(6, None, 1)]
    # repeated first block 1: r1 (a->a stay), r2 (a->b move), r4 (b->b stay); block 2 first seen; None ignored
    assert migration_rate(recs) == pytest.approx(1 / 3)
    assert migration_rate([_rec(0, "a", 1)]) == 0.0


def test_coefficient_of_variation():
    assert coefficient_of_variation([2.0, 2.0, 2.0]) == 0.0
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(0.5)
    assert coefficient_of_variation([]) == 0.0 and coefficient_of_variation([0.0, 0.0]) == 0.0


def test_summarize_on_hand_made_records():
    recs = [
        RequestRecord(0, 0.0, 1000, 5, None, worker="a", routed=0.0, first_token=0.5, finish=1.3,
                      cached_tokens=0, status="ok"),
        RequestRecord(1, 1.0, 1000, 1, None, worker="b", routed=1.0, first_token=1.1, finish=1.1,
                      cached_tokens=500, status="ok"),
        RequestRecord(2, 2.0, 1000, 3, None, status="rejected", reason="admission"),
    ]
    m = summarize(recs, busy_time=[1.0, 3.0], busy_window=[0.5, 1.5], window=2.0)
    assert m["completed"] == 2 and m["rejected"] == 1
    assert m["ttft_p50_s"] == pytest.approx(0.3)
    assert m["tpot_p50_s"] == pytest.approx(0.2)  # only the 5-token request: 0.8 s / 4
    assert m["hit_ratio"] == pytest.approx(0.25)
    assert m["throughput_tok_s"] == pytest.approx((2000 + 6) / 1.3)
    assert m["load_cv"] == pytest.approx(0.5)
    assert m["busy"] == pytest.approx(0.5)
    assert m["migration_rate"] == 0.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in m.values())
