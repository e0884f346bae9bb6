"""Find the arrival speed-up at which the cluster is busy a given share of the time.

``busy(speedup)`` (the mean busy fraction of the workers over the arrival window, measured by a
short simulated run) rises with the speed-up, so the target is bracketed by doubling/halving from
1.0 and then narrowed in log space. ``evaluate`` takes several speed-ups at once so the caller can
run them in parallel (two per round on a 2-core machine: the bracket shrinks to a third per round).

A short run is cheap but is not the run that is reported: on the Mooncake trace the first 1,000
requests keep ``least_loaded`` 80 % busy at a speed-up where the whole trace keeps it 77.8 %
busy. So ``natsched bench routing`` calibrates twice: on the short prefix from 1.0, then on the
whole trace from the prefix's answer (``guess``), with a tighter tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from natsched.sim.errors import CalibrationError, SimConfigError

Evaluate = Callable[[Sequence[float]], Sequence[float]]

MIN_SPEEDUP = 1 / 1024
MAX_SPEEDUP = 1024.0
GUESS_SPREAD = 0.03  # the first round around a guess: guess x (1 ± this)
GUESS_STEP = 1.1  # ... and the factor per step when it does not bracket the target


def _around(guess: float, parallel: int) -> list[float]:
    """``parallel`` speed-ups spread evenly over guess x [1 - spread, 1 + spread] (the guess alone for 1)."""
    if not (isinstance(guess, (int, float)) and MIN_SPEEDUP <= guess <= MAX_SPEEDUP):
        raise SimConfigError(f"calibration guess must be a speed-up in [{MIN_SPEEDUP:g}, {MAX_SPEEDUP:g}], "
                             f"got {guess!r}")
    if parallel == 1:
        return [guess]
    return [guess * (1 - GUESS_SPREAD + 2 * GUESS_SPREAD * i / (parallel - 1)) for i in range(parallel)]


@dataclass
class Calibration:
    target: float
    speedup: float
    busy: float | None  # measured at ``speedup`` if it was evaluated, else None (interpolated)
    points: list[tuple[float, float]] = field(default_factory=list)  # (speedup, busy) evaluated
    requests: int | None = None  # requests per evaluated run (None: not recorded)
    coarse: "Calibration | None" = None  # the shorter runs' calibration this one was refined from

    def to_json(self) -> dict:
        out = {"target_busy": self.target, "speedup": self.speedup, "busy": self.busy,
               "points": [[s, b] for s, b in self.points], "requests": self.requests}
        if self.coarse is not None:
            out["coarse"] = self.coarse.to_json()
        return out


def find_speedup(target: float, evaluate: Evaluate, parallel: int = 2, tol: float = 0.01,
                 max_rounds: int = 10, ratio_tol: float = 1.02, guess: float | None = None) -> Calibration:
    """The speed-up whose busy fraction is ``target`` (within ``tol``), see the module docstring.

    ``guess`` (a speed-up believed close, e.g. from a shorter run) replaces the start at 1.0: the
    first round measures around it (±``GUESS_SPREAD``) and the search steps by ``GUESS_STEP``
    instead of doubling, so it stays near the guess (4 rounds on the Mooncake trace)."""
    if not (isinstance(target, (int, float)) and 0.0 < target < 1.0):
        raise SimConfigError(f"target busy must be a fraction strictly between 0 and 1, got {target!r}")
    parallel = max(1, parallel)
    points: list[tuple[float, float]] = []
    lo: tuple[float, float] | None = None  # busy below target
    hi: tuple[float, float] | None = None  # busy at or above target

    def measure(speedups: list[float]) -> None:
        nonlocal lo, hi
        for s, b in zip(speedups, evaluate(speedups)):
            points.append((s, b))
            if b < target:
                if lo is None or s > lo[0]:
                    lo = (s, b)
            elif hi is None or s < hi[0]:
                hi = (s, b)

    def best() -> tuple[float, float]:
        return min(points, key=lambda p: abs(p[1] - target))

    if guess is None:
        step, first = 2.0, [1.0, 2.0][:parallel]
    else:
        step, first = GUESS_STEP, _around(guess, parallel)
    measure(first)
    rounds = 0
    while rounds < max_rounds:
        s_best, b_best = best()
        if abs(b_best - target) <= tol:
            return Calibration(target, s_best, b_best, points)
        if lo is not None and hi is not None:
            if hi[0] / lo[0] <= ratio_tol:
                break
            a, b = math.log(lo[0]), math.log(hi[0])
            cands = [math.exp(a + (b - a) * (i + 1) / (parallel + 1)) for i in range(parallel)]
        elif hi is None:  # everything measured so far is too idle: go faster
            if lo[0] >= MAX_SPEEDUP:
                raise CalibrationError(f"busy stays below {target:.2f} up to speed-up {lo[0]:g} "
                                       f"(reached {lo[1]:.3f})")
            cands = [min(MAX_SPEEDUP, lo[0] * step ** (i + 1)) for i in range(parallel)]
        else:  # too busy everywhere: go slower
            if hi[0] <= MIN_SPEEDUP:
                raise CalibrationError(f"busy stays above {target:.2f} down to speed-up {hi[0]:g} "
                                       f"(reached {hi[1]:.3f})")
            cands = [max(MIN_SPEEDUP, hi[0] / step ** (i + 1)) for i in range(parallel)]
        measure(sorted(set(cands)))
        rounds += 1
    s_best, b_best = best()
    if abs(b_best - target) <= tol:
        return Calibration(target, s_best, b_best, points)
    if lo is None or hi is None:
        raise CalibrationError(f"could not bracket busy {target:.2f} in {max_rounds} rounds; measured {points}")
    # interpolate in log space between the tightest bracket
    (s0, b0), (s1, b1) = lo, hi
    f = (target - b0) / (b1 - b0) if b1 > b0 else 0.5
    return Calibration(target, math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0))), None, points)
