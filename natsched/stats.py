"""The one percentile: audit windows, the simulator's metrics and replays report the same figure.

A leaf module (it imports nothing of ours), so every layer may use it.
"""

from __future__ import annotations

import math
from typing import Iterable


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of the finite values; None when there are none.

    The interpolation is numpy's default ("linear"): rank ``(n - 1) * q / 100`` between the two
    nearest sorted values. Missing (None) and non-finite values are left out, not counted.
    """
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The sorted value at index ``min(n - 1, int(q * n))`` (q in [0, 1]); None when there are none.

    The pipeline and chaos benchmarks' p50/p99 (their targets, e.g. "p99 <= 10 ms", were set and
    published with this definition): always a measured value, never one interpolated between two.
    """
    xs = sorted(values)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]
