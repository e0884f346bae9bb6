"""The agent's count of decode progress between heartbeats (natsched.workers.progress)."""

from __future__ import annotations

import pytest

from natsched.workers.progress import DecodeProgress


def test_gaps_after_each_first_token_are_summed_per_token():
    p = DecodeProgress()
    p.output("a", 1, 10.0)  # a's first token: the prefill wait, not a step
    p.output("b", 1, 10.5)
    p.output("a", 1, 10.1)
    p.output("b", 3, 10.8)  # three tokens in one output: three steps in 0.3 s
    p.output("a", 0, 11.0)  # an output without tokens changes nothing
    assert p.take() == (4, pytest.approx(0.4))
    assert p.take() == (0, 0.0)  # counting starts anew
    p.output("a", 1, 10.3)  # a's gap runs on across the heartbeat
    assert p.take() == (1, pytest.approx(0.2))


def test_a_closed_request_starts_over_and_time_never_runs_backwards():
    p = DecodeProgress()
    p.output("a", 1, 5.0)
    p.close("a")
    p.output("a", 1, 6.0)  # a retry of the same id: its first token again
    p.output("a", 1, 5.5)  # a clock step backwards counts as no time
    assert p.take() == (1, 0.0)
