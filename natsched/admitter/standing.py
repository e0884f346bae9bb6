"""Standing queues: a model whose door queue does not drain is overloaded, and sheds its excess.

A queue absorbs a burst and drains. A queue that *stands* — whose oldest request has been older
than ``target_s`` for a whole ``interval_s`` — says that the model's workers serve less than
arrives. Holding more then buys nothing: every request waits the backlog (each is served as late
as the queue is long, which grows for as long as the overload lasts), and as many are refused
in the end, at ``queue_timeout_s``, after the longest wait. That is CoDel's line between a good
queue and a bad one (Nichols & Jacobson, "Controlling Queue Delay", ACM Queue 10(5), 2012),
which "Fail at Scale" (Maurer, ACM Queue 13(8), 2015) applies to a server's request queue.

Here, per (model, class) lane of the door, for the classes that wait for an answer and have no
TTFT SLO of their own (an SLO class keeps its own rule: late work is degraded, not refused;
batch and degradable work is meant to wait):

- a lane whose oldest request has waited past ``target_s`` for ``interval_s`` starts *shedding*;
- while it sheds, its queued requests older than ``target_s`` are refused (``overloaded``, with
  ``retry_after``), and an arrival is refused at once when its model's estimated wait (what is
  queued for the model ahead of it, over the model's own release rate) is past ``target_s`` —
  what is served is served soon, what is refused learns it at once, not after the timeout;
- it stops once its oldest request stayed within ``target_s`` for ``interval_s`` with nothing
  shed: the overload is over.

**Adaptive LIFO** (the same article's companion to CoDel): while a lane's oldest request is past
``target_s`` — a queue is forming — or the lane stands, the door serves that lane *newest first*
(:meth:`StandingQueues.forming`; the planner's rule 8). First-come order makes every request of a
forming queue wait the whole backlog; newest-first serves the requests that can still be served
soon, and leaves the backlog to the old ones, which the standing rule sheds (told, with
``retry_after``) once the queue stands. So a forming queue's wait falls on the fewest requests,
and for no longer than the interval plus a retry. Measured on ``hetero``, whose second model's
two L4s are offered more than they serve (docs/scenarios.md, "Adaptive LIFO at the door"). Off
with ``admission.adaptive_lifo``.

A burst the queue drains within ``interval_s`` is never shed. The defaults, and why: the
interval is one step of the capacity-following total (``DynamicTotalSettings.interval_s``, 5 s),
so a queue that stands through a whole step is not one the total was about to absorb; the
target is the least ``retry_after`` (1 s): a request held longer than a client would wait
before retrying gains nothing by being held instead of told.

Pure: the core reports each lane's oldest age and its sheds, and reads the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping


@dataclass
class StandingQueues:
    target_s: float = 1.0
    interval_s: float = 5.0
    above: dict[Hashable, float] = field(default_factory=dict)  # lane -> since when its oldest is past target
    shedding: dict[Hashable, float] = field(default_factory=dict)  # lane -> its last shed (or when it began)

    def observe(self, oldest_age: Mapping[Hashable, float], now: float) -> None:
        """The age of each lane's oldest queued request at ``now`` (absent: the lane is empty)."""
        for lane in [k for k in self.above if oldest_age.get(k, 0.0) <= self.target_s]:
            del self.above[lane]
        for lane, age in oldest_age.items():
            if age > self.target_s:
                self.above.setdefault(lane, now - (age - self.target_s))
        for lane in list(self.above):
            if now - self.above[lane] >= self.interval_s:
                self.shedding[lane] = now
        for lane in [k for k in self.shedding if not self.standing(k, now)]:
            del self.shedding[lane]

    def shed(self, lane: Hashable, now: float) -> None:
        """A request of ``lane`` was refused for its standing queue: the overload goes on."""
        self.shedding[lane] = max(self.shedding.get(lane, now), now)

    def standing(self, lane: Hashable, now: float) -> bool:
        """Its oldest has been past the target for an interval, or it shed less than an interval ago."""
        since = self.above.get(lane)
        if since is not None and now - since >= self.interval_s:
            return True
        last = self.shedding.get(lane)
        return last is not None and now - last < self.interval_s

    def forming(self, now: float) -> list[Hashable]:
        """The lanes served newest first at ``now``: their oldest request is past the target (at
        the last :meth:`observe`), or they stand."""
        return [k for k in {**self.above, **self.shedding} if k in self.above or self.standing(k, now)]

    def lanes(self, now: float) -> list[Hashable]:
        """The lanes standing at ``now``."""
        return [k for k in {**self.above, **self.shedding} if self.standing(k, now)]
