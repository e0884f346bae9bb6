"""When a worker should announce ``backoff`` on its own, and when it may be healthy again.

A worker whose KV cache is (nearly) full, or which keeps preempting sequences to make room,
gets slower for everything it runs; new work makes it worse. The router only sends work to
``healthy`` workers, so announcing ``backoff`` is how a worker sheds load without refusing what
it already accepted. Hysteresis keeps it from flapping: it enters above the *high* thresholds,
leaves only once every signal is below the *low* ones, and stays at least ``min_backoff_s``.

Pure and synchronous: stats and a clock in, a state out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from natsched.workers.engine import EngineStats


@dataclass
class BackoffSettings:
    kv_high: float = 0.95  # enter when KV usage (used / total blocks) reaches this
    kv_low: float = 0.85  # ... and leave only below this
    preemptions_per_s_high: float = 2.0  # enter at this preemption rate (a "preemption storm")
    preemptions_per_s_low: float = 0.2
    waiting_high: int | None = None  # optional: enter with this many requests waiting in the engine
    waiting_low: int = 0
    rate_window_s: float = 5.0  # preemption rate measured over this window
    min_backoff_s: float = 3.0  # shortest stay in backoff
    enabled: bool = True

    def __post_init__(self) -> None:
        if not (0 < self.kv_low <= self.kv_high <= 1.0):
            raise ValueError("backoff: need 0 < kv_low <= kv_high <= 1")
        if self.preemptions_per_s_low > self.preemptions_per_s_high:
            raise ValueError("backoff: preemptions_per_s_low must be <= preemptions_per_s_high")


class BackoffMonitor:
    """Feeds on :class:`EngineStats` (one call per heartbeat); answers "backoff now?" with a reason."""

    def __init__(self, settings: BackoffSettings | None = None) -> None:
        self.settings = settings or BackoffSettings()
        self.active = False
        self.reason = ""
        self.since = 0.0
        self._preempt: deque[tuple[float, int]] = deque()

    def preemption_rate(self, now: float) -> float:
        if len(self._preempt) < 2:
            return 0.0
        t0, n0 = self._preempt[0]
        t1, n1 = self._preempt[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def update(self, st: EngineStats, now: float) -> bool:
        """Record one observation; returns whether the worker should be in backoff."""
        s = self.settings
        self._preempt.append((now, st.preemptions))
        while len(self._preempt) > 2 and self._preempt[1][0] <= now - s.rate_window_s:
            self._preempt.popleft()
        if not s.enabled:
            self.active = False
            return False
        kv = st.kv_used_blocks / st.kv_total_blocks if st.kv_total_blocks else 0.0
        rate = self.preemption_rate(now)
        if not self.active:
            why = []
            if kv >= s.kv_high:
                why.append(f"kv usage {kv:.0%} >= {s.kv_high:.0%}")
            if rate >= s.preemptions_per_s_high:
                why.append(f"{rate:.1f} preemptions/s >= {s.preemptions_per_s_high}")
            if s.waiting_high is not None and st.waiting >= s.waiting_high:
                why.append(f"{st.waiting} waiting >= {s.waiting_high}")
            if why:
                self.active, self.reason, self.since = True, "; ".join(why), now
        else:
            calm = (kv < s.kv_low and rate <= s.preemptions_per_s_low
                    and (s.waiting_high is None or st.waiting <= s.waiting_low))
            if calm and now - self.since >= s.min_backoff_s:
                self.active, self.reason = False, ""
        return self.active
