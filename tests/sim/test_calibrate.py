"""Calibration of the speed-up to a target busy fraction (on synthetic busy curves and a real run)."""

from __future__ import annotations

import math

import pytest

from natsched.sim.calibrate import find_speedup
from natsched.sim.errors import CalibrationError, SimConfigError


def curve(rate=0.4):
    """busy = 1 - exp(-rate * speedup): rises with the speed-up and saturates at 1, like a cluster."""
    calls = []

    def evaluate(speedups):
        calls.append(list(speedups))
        return [1 - math.exp(-rate * s) for s in speedups]

    return evaluate, calls


@pytest.mark.parametrize("parallel", [1, 2, 3])
@pytest.mark.parametrize("target, rate", [(0.8, 0.4), (0.7, 5.0), (0.9, 0.01)])
def test_the_speedup_found_gives_the_target_busy(parallel, target, rate):
    evaluate, calls = curve(rate)
    cal = find_speedup(target, evaluate, parallel=parallel, tol=0.005)
    exact = -math.log(1 - target) / rate
    assert cal.speedup == pytest.approx(exact, rel=0.05)
    assert cal.busy is None or abs(cal.busy - target) <= 0.005
    assert all(len(batch) <= parallel for batch in calls)
    assert len(cal.points) == sum(len(b) for b in calls)


def test_an_unreachable_target_is_a_calibration_error():
    with pytest.raises(CalibrationError, match="below"):
        find_speedup(0.5, lambda ss: [0.1 for _ in ss], max_rounds=30)
    with pytest.raises(CalibrationError, match="above"):
        find_speedup(0.5, lambda ss: [0.99 for _ in ss], max_rounds=30)


@pytest.mark.parametrize("target", [0, 1, 1.5, -0.2])
def test_target_must_be_a_fraction(target):
    with pytest.raises(SimConfigError, match="target busy"):
        find_speedup(target, lambda ss: [0.5 for _ in ss])


@pytest.mark.parametrize("parallel", [1, 2])
@pytest.mark.parametrize("off", [0.9, 1.0, 1.15])
def test_a_guess_starts_the_search_near_it_and_still_finds_the_target(parallel, off):
    evaluate, calls = curve(0.4)
    exact = -math.log(1 - 0.8) / 0.4
    cal = find_speedup(0.8, evaluate, parallel=parallel, tol=0.005, guess=exact * off)
    assert cal.speedup == pytest.approx(exact, rel=0.05)
    assert cal.busy is None or abs(cal.busy - 0.8) <= 0.005
    assert all(abs(s / (exact * off) - 1) <= 0.031 for s in calls[0])  # not the default start at 1.0
    steps = [max(b) / min(b) for b in calls[1:] if len(b) > 1]
    assert all(r < 1.25 for r in steps)  # steps of 1.1 near a guess, not doublings


@pytest.mark.parametrize("guess", [0.0, -1.0, 5000.0, float("nan")])
def test_a_guess_must_be_a_speed_up(guess):
    with pytest.raises(SimConfigError, match="calibration guess"):
        find_speedup(0.5, lambda ss: [0.5 for _ in ss], guess=guess)
