"""natsched.stats: the one linear percentile and the benchmarks' nearest rank."""

import math

from natsched.stats import nearest_rank, percentile


def test_percentile_interpolates_between_the_nearest_values():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 0], 100) == 10.0 and percentile([10, 0], 0) == 0.0
    assert percentile([5], 99) == 5.0


def test_percentile_leaves_out_missing_and_non_finite_values():
    assert percentile([None, 1.0, math.nan, 3.0, math.inf], 50) == 2.0
    assert percentile([], 50) is None and percentile([None, math.nan], 50) is None


def test_nearest_rank_is_always_a_measured_value():
    values = [float(i) for i in range(100)]  # 0 .. 99
    assert nearest_rank(values, 0.99) == 99.0 and nearest_rank(values, 0.5) == 50.0
    assert nearest_rank(values, 1.0) == 99.0 and nearest_rank([3.0, 1.0], 0.0) == 1.0
    assert nearest_rank([], 0.5) is None
