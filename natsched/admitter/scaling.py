"""Scaling signals: when to add workers (and how many) and which worker to drain. Pure.

The seeds' rule: scale on *queue wait*, not on GPU utilisation — a busy GPU that keeps up is no
reason to grow, a queue that makes requests wait is. So:

- **scale out** when the p95 of queue waits seen in the last ``window_s`` has stayed above
  ``out_wait_s`` for ``window_s``. The waits counted are those of requests that left the queue
  *and* the ages of those still in it (a queue that never moves has no finished waits, and is
  the worst case). By how much: the runtime-token demand (in use + queued) over the mean
  per-worker capacity the workers report, minus the workers there are (at least 1).
- **scale in** when the cluster has been idle for ``idle_window_s``: nothing queued, and the
  workers' in-use runtime tokens below ``idle_util`` of their capacity at every check, with more
  than ``min_workers`` workers. Which one: the least loaded (fewest runtime tokens in use, then
  the smallest capacity, then the name), so its drain finishes first and costs the least cache.

A signal is repeated every ``repeat_s`` while its condition holds (so a consumer that missed one
sees the next) and stops when the condition ends. :class:`ScaleAdvisor` keeps the windows; the
admitter service feeds it and publishes what it returns (``natsched.admitter.service``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from natsched.admitter.errors import SettingsError

OUT, IN = "out", "in"


@dataclass
class ScaleSettings:
    enabled: bool = True
    out_wait_s: float = 5.0  # queue-wait p95 above this ...
    window_s: float = 60.0  # ... over and for this long: scale out
    idle_util: float = 0.1  # in-use runtime tokens below this share of the capacity ...
    idle_window_s: float = 300.0  # ... with nothing queued, for this long: scale in
    min_workers: int = 1  # never advise draining below this many workers
    repeat_s: float = 60.0  # a holding condition is signalled again this often
    interval_s: float = 5.0  # how often the service checks

    def __post_init__(self) -> None:
        for name in ("out_wait_s", "window_s", "idle_window_s", "repeat_s", "interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise SettingsError(f"scale {name} must be a number > 0, got {value!r}")
        if not 0.0 <= self.idle_util < 1.0:
            raise SettingsError(f"scale idle_util must be within [0, 1), got {self.idle_util!r}")
        if not isinstance(self.min_workers, int) or self.min_workers < 1:
            raise SettingsError(f"scale min_workers must be an integer >= 1, got {self.min_workers!r}")


@dataclass
class WorkerLoad:
    worker: str
    capacity: int  # runtime tokens it can hold (its heartbeat's capacity_tokens)
    used: int  # runtime tokens in use now


@dataclass
class ScaleSignal:
    kind: str  # OUT | IN
    reason: str
    workers: int  # workers live now
    add: int = 0  # scale out: workers to add
    drain: str | None = None  # scale in: the worker to drain
    queue_wait_p95: float = 0.0
    demand_tokens: int = 0
    worker_capacity: int = 0  # mean per-worker capacity behind ``add``
    utilisation: float = 0.0


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass
class ScaleAdvisor:
    settings: ScaleSettings = field(default_factory=ScaleSettings)
    waits: deque = field(default_factory=deque)  # (when it left the queue, seconds waited)
    over_since: float | None = None
    idle_since: float | None = None
    last: dict = field(default_factory=dict)  # kind -> when last signalled
    wait_p95: float = 0.0  # at the latest check
    current: ScaleSignal | None = None  # the condition holding at the latest check (for gauges)

    def observe_wait(self, now: float, waited: float) -> None:
        self.waits.append((now, max(0.0, waited)))

    def check(self, now: float, queued_ages: list[float], queued_tokens: int, used_tokens: int,
              workers: list[WorkerLoad]) -> ScaleSignal | None:
        """The signal due now, or None. ``queued_ages``: how long each queued request has waited."""
        s = self.settings
        while self.waits and self.waits[0][0] < now - s.window_s:
            self.waits.popleft()
        if not s.enabled:
            return None
        wait95 = p95([w for _, w in self.waits] + list(queued_ages))
        self.over_since = (self.over_since if self.over_since is not None else now) if wait95 > s.out_wait_s else None
        capacity = sum(w.capacity for w in workers)
        util = sum(w.used for w in workers) / capacity if capacity > 0 else 0.0
        idle = not queued_ages and capacity > 0 and util < s.idle_util
        self.idle_since = (self.idle_since if self.idle_since is not None else now) if idle else None
        self.wait_p95 = wait95
        self.current = None
        if self.over_since is not None and now - self.over_since >= s.window_s:
            self.current = self._out(wait95, queued_tokens + used_tokens, workers, util)
        elif self.idle_since is not None and now - self.idle_since >= s.idle_window_s and len(workers) > s.min_workers:
            self.current = self._in(wait95, queued_tokens + used_tokens, workers, util)
        for kind in (OUT, IN):
            if self.current is None or self.current.kind != kind:
                self.last.pop(kind, None)  # its condition ended: the next start is signalled at once
        return self._due(now, self.current) if self.current is not None else None

    def _due(self, now: float, signal: ScaleSignal) -> ScaleSignal | None:
        last = self.last.get(signal.kind)
        if last is not None and now - last < self.settings.repeat_s:
            return None
        self.last[signal.kind] = now
        return signal

    def _out(self, wait95: float, demand: int, workers: list[WorkerLoad], util: float) -> ScaleSignal:
        known = [w.capacity for w in workers if w.capacity > 0]
        per_worker = int(sum(known) / len(known)) if known else 0
        needed = math.ceil(demand / per_worker) if per_worker else len(workers) + 1
        add = max(1, needed - len(workers))
        return ScaleSignal(OUT, f"queue wait p95 {wait95:.1f}s above {self.settings.out_wait_s:g}s for "
                                f"{self.settings.window_s:g}s; demand {demand} runtime tokens over "
                                f"{per_worker or '?'} per worker", len(workers), add=add,
                           queue_wait_p95=wait95, demand_tokens=demand, worker_capacity=per_worker, utilisation=util)

    def _in(self, wait95: float, demand: int, workers: list[WorkerLoad], util: float) -> ScaleSignal:
        pick = min(workers, key=lambda w: (w.used, w.capacity, w.worker))
        return ScaleSignal(IN, f"idle for {self.settings.idle_window_s:g}s: nothing queued, {util:.0%} of the "
                               f"capacity in use (below {self.settings.idle_util:.0%})", len(workers),
                           drain=pick.worker, queue_wait_p95=wait95, demand_tokens=demand,
                           worker_capacity=sum(w.capacity for w in workers) // max(1, len(workers)), utilisation=util)
