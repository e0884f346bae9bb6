"""Learned estimates the admission policy uses: output lengths and the release rate.

- :class:`OutputEstimator`: an EWMA of the output tokens each (tenant, model) actually produces,
  learned from COMPLETIONS. With calibration on, a request reserves this estimate (plus a margin,
  never more than its ``max_tokens``) instead of ``max_tokens``: producers ask for 4k tokens "just
  in case" and use 200, and reserving 4k would leave most of the cluster idle. The completion
  releases exactly what was reserved and moves the estimate: that is the true-up.
- :class:`ReleaseRate`: runtime tokens freed per second over a sliding window; it turns "tokens
  ahead of you" into the estimated wait a queued producer is told.

Pure module: no I/O, time is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass
class _Ewma:
    value: float
    samples: int = 1


class OutputEstimator:
    """EWMA of actual output tokens per (tenant, model)."""

    def __init__(self, alpha: float = 0.2, min_samples: int = 3) -> None:
        self.alpha = alpha
        self.min_samples = min_samples
        self._by_key: dict[tuple[str, str], _Ewma] = {}

    def observe(self, tenant: str, model: str, output_tokens: int) -> float:
        """Fold one completion's output length in; returns the new estimate."""
        key = (tenant, model)
        x = float(max(0, output_tokens))
        cur = self._by_key.get(key)
        if cur is None:
            self._by_key[key] = cur = _Ewma(x)
        else:
            cur.value += self.alpha * (x - cur.value)
            cur.samples += 1
        return cur.value

    def estimate(self, tenant: str, model: str) -> float | None:
        """The learned mean, or None until ``min_samples`` completions were seen."""
        cur = self._by_key.get((tenant, model))
        if cur is None or cur.samples < self.min_samples:
            return None
        return cur.value

    def expected_output(self, tenant: str, model: str, max_tokens: int, margin: float) -> int | None:
        """Tokens to reserve for the output: estimate × (1 + margin), at least 1, at most max_tokens."""
        est = self.estimate(tenant, model)
        if est is None:
            return None
        return max(1, min(max_tokens, math.ceil(est * (1.0 + margin))))


class ReleaseRate:
    """Runtime tokens released per second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0, min_samples: int = 5) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._first: float | None = None
        self.last = 0.0

    def add(self, now: float, tokens: int) -> None:
        if self._first is None:
            self._first = now
        self.last = max(self.last, now)
        self._events.append((now, tokens))
        self._sum += tokens
        self._prune(self.last)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            self._sum -= self._events.popleft()[1]

    def rate(self, now: float | None = None) -> float | None:
        """Tokens per second, or None until the window holds enough history to mean something."""
        now = self.last if now is None else max(now, self.last)
        self._prune(now)
        if self._first is None or len(self._events) < self.min_samples:
            return None
        span = min(self.window_s, now - self._first)
        if span < self.window_s / 2:
            return None
        return self._sum / span
