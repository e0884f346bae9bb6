"""The capacity-following total: pure arithmetic, run every ``interval_s`` (5 s) by the service.

The configured ``cluster.total`` (and ``cluster.hard_cap``) are ceilings. Below them the total
follows what the workers report: their summed runtime-token capacity, times a factor that the
workers' real utilisation moves — above the high watermark (0.8) the factor tightens, below the
low watermark (0.5) it loosens. Admission estimates (max_tokens reservations, prefix caching)
then correct themselves from measurement instead of a hand-tuned constant.

When the caller also passes what the admitters have **reserved**, the factor is measured rather
than stepped: a reservation books the whole prompt twice (prefill owed + KV held) and the expected
output for the request's whole life, while a worker holds only the KV it has (and the prefill it
still owes), so ``reserved / workers_used`` runtime tokens are booked per token really held —
about 2 for prompt-heavy chat. The factor that fills the workers when the total is used up is
``reserved / workers_used``; it moves halfway there per interval (bounded as before). Full, not
the high watermark: the engines queue what does not fit themselves, and holding requests at the
door below their capacity only adds waiting (on chat traffic at 80 % of capacity, TTFT p99 5.3 s
at the watermark against 2 s without admission); overload is what the watermark steps and the
TTFT SLOs are for. A ±10 % step every 25 s needs minutes to undo a 2x over-booking, during
which requests queue at the door while the engines have room.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicTotalSettings:
    enabled: bool = True
    interval_s: float = 5.0  # cheap arithmetic on the heartbeats already read; 25 s left requests queued
    # at the door for the first half minute of every change (a burst, a new worker)
    high: float = 0.8
    low: float = 0.5
    tighten: float = 0.9
    loosen: float = 1.1
    min_factor: float = 0.5
    max_factor: float = 2.0


@dataclass
class DynamicTotal:
    settings: DynamicTotalSettings
    factor: float = 1.0

    def next_total(self, configured: int, hard_cap: int | None, capacity: int, workers_used: int,
                   reserved: int | None = None) -> int:
        """The total to admit against now; the configured total when no worker reports capacity.
        With ``reserved`` (runtime tokens the admitters hold) the factor is measured (module docstring)."""
        ceiling = configured if hard_cap is None else min(configured, hard_cap)
        if not self.settings.enabled or capacity <= 0:
            return ceiling
        util = workers_used / capacity
        s = self.settings
        if reserved is not None and reserved > 0 and workers_used > 0:
            target = reserved / workers_used
            self.factor = max(s.min_factor, min(s.max_factor, self.factor + 0.5 * (target - self.factor)))
        elif util > s.high:
            self.factor = max(s.min_factor, self.factor * s.tighten)
        elif util < s.low:
            self.factor = min(s.max_factor, self.factor * s.loosen)
        return max(0, min(ceiling, int(capacity * self.factor)))
