"""Load as vLLM's scheduler reports it, smoothed over a short window for heartbeats.

vLLM hands every engine step's ``SchedulerStats`` (running, waiting, KV usage) and
``IterationStats`` (preemptions) to its stat loggers, in the front-end process. A heartbeat
every second that copied the last step would jump between batches; the window's mean is what
the admitter and router should plan with. Samples are kept for ``window_s`` seconds only
(bounded memory); when no step ran for a while the last sample stands.

:class:`LoadWindow` is pure. :func:`stat_logger_factory` builds the vLLM plugin that feeds it;
it imports vLLM only when called (so this module is import-safe without the vllm extra).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class LoadSample:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1, share of KV blocks held by requests (cached-but-free excluded)


class LoadWindow:
    """Time-windowed mean of scheduler samples, plus cumulative preemption and prefix-cache counters."""

    def __init__(self, window_s: float = 2.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, LoadSample]] = deque(maxlen=max_samples)
        self.preemptions = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up in the prefix cache, found there
        self.steps = 0

    def add(self, sample: LoadSample, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, sample))
        self.steps += 1
        self._trim(now)

    def add_preemptions(self, n: int) -> None:
        self.preemptions += max(0, n)

    def add_prefix_lookups(self, queries: int, hits: int) -> None:
        self.prefix_queries += max(0, queries)
        self.prefix_hits += max(0, min(hits, queries))

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while len(self._samples) > 1 and self._samples[0][0] < cutoff:
            self._samples.popleft()

    def smoothed(self, now: float | None = None) -> LoadSample:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._samples:
            return LoadSample()
        recent = [s for t, s in self._samples if t >= now - self.window_s] or [self._samples[-1][1]]
        n = len(recent)
        return LoadSample(
            running=sum(s.running for s in recent) / n,
            waiting=sum(s.waiting for s in recent) / n,
            kv_usage=sum(s.kv_usage for s in recent) / n,
        )

    def last(self) -> LoadSample:
        return self._samples[-1][1] if self._samples else LoadSample()


def stat_logger_factory(window: LoadWindow) -> Callable[[Any, int], Any]:
    """A per-engine vLLM stat-logger factory that records into ``window``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class NatschedStatLogger(StatLoggerBase):
        """Copies what the heartbeat needs; never raises into vLLM's output loop."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            try:
                if scheduler_stats is not None:
                    window.add(LoadSample(
                        running=float(getattr(scheduler_stats, "num_running_reqs", 0)),
                        waiting=float(getattr(scheduler_stats, "num_waiting_reqs", 0))
                        + float(getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)),
                        kv_usage=float(getattr(scheduler_stats, "kv_cache_usage", 0.0)),
                    ))
                    pc = getattr(scheduler_stats, "prefix_cache_stats", None)
                    if pc is not None:
                        window.add_prefix_lookups(int(pc.queries), int(pc.hits))
                if iteration_stats is not None:
                    window.add_preemptions(int(getattr(iteration_stats, "num_preempted_reqs", 0)))
            except Exception:  # stats are best effort; the engine must keep serving
                pass

        def log_engine_initialized(self) -> None:
            pass

    return NatschedStatLogger
