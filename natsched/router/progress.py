"""Early slowness evidence: the decode progress a worker reports in every heartbeat. Pure, no I/O.

Why: :mod:`natsched.router.health` judges a worker by its *completions*, and a completion of a
slowed worker comes late by the very slowdown — a long decode that began before it finishes tens
of seconds later (a third of the speed: ~54 s before the first verdict in the ``elastic``
scenario), while the router keeps sending it new work. Every decoding sequence of a slowed engine
shows the slowdown at its next token, though. So each heartbeat carries what the worker saw since
the previous one (``Heartbeat.decode_tokens``, ``Heartbeat.decode_s``: the tokens its requests
produced after their first, and the sum of the gaps before each), and the router judges the mean
gap against what the worker's own learned model predicts for that batch
(:meth:`natsched.router.costmodel.CostModel.step_s` of the running sequences and their KV) plus the
prefill the engine had to interleave into those steps (chunked prefill runs it inside them): the
prefill routed to it over the interval plus the queue it started with, less the queue it ended with.

Trust: the report is the worker's own word, so it may only make the worker look *slower*.
:meth:`natsched.router.health.LatencyHealth.observe_progress` uses it to go half-open (or to leave
a half-open state that the reports themselves caused); it never shortens a cost estimate and
never ends a half-open state that completions caused. A worker that claims to be fast gains
nothing over one that reports nothing; one that claims to be slow only sheds its own work.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from natsched.router.costmodel import CostModel

#: a member's ratio counts as its group's current level for this long (router seconds)
PEER_WINDOW_S = 10.0
#: fewer recent peers than this make no level: the ratio is judged as it is
MIN_PEERS = 2

#: fewer decode tokens than this in one interval is no evidence (a gap or two is mostly noise)
MIN_DECODE_TOKENS = 8
#: an interval whose prefill allowance is more than this share of its predicted time is no
#: evidence: the prefill model (linear in the queue, a prediction per request) is far less exact
#: than the step model, and a slowed engine shows its slowdown in its decode-bound intervals too
MAX_PREFILL_SHARE = 0.5


def progress_ratio(cost: CostModel, decode_tokens: int, decode_s: float, running: int,
                   batch_kv_tokens: float, prefill_s: float) -> float | None:
    """Observed / predicted mean token gap of one heartbeat interval, or None (no evidence).

    ``prefill_s``: seconds of prefill (by ``cost``) the engine ran during the interval, spread
    over its steps: ``decode_tokens / running`` of them (every running sequence produces at most
    one token per step, so that is a lower bound, and the prefill allowance an upper one)."""
    if decode_tokens < MIN_DECODE_TOKENS or not decode_s > 0.0 or running <= 0:
        return None
    gap = decode_s / decode_tokens
    steps = decode_tokens / running
    step = cost.step_s(batch_kv_tokens, running)
    prefill = max(prefill_s, 0.0) / steps
    if prefill > MAX_PREFILL_SHARE * (step + prefill):
        return None
    predicted = step + prefill
    ratio = gap / predicted if predicted > 0.0 else math.inf
    return ratio if math.isfinite(ratio) else None


@dataclass(slots=True)
class _Mark:
    ts: float  # the previous heartbeat's timestamp
    routed_s: float  # the router's counter of prefill seconds routed to the worker, then
    queued_tokens: int  # the prefill the worker had queued, then


class ProgressWatch:
    """Per worker, what the previous heartbeat left (to tell the prefill of the interval)."""

    def __init__(self) -> None:
        self._marks: dict[str, _Mark] = {}
        self._last: dict[str, tuple[float, float]] = {}  # worker -> (its latest ratio, router time)

    def on_heartbeat(self, cost: CostModel, worker: str, ts: float, decode_tokens: int, decode_s: float,
                     running: int, batch_kv_tokens: float, queued_tokens: int, routed_s: float) -> float | None:
        """The ratio of this heartbeat's interval (None without a previous heartbeat or evidence).

        A heartbeat older than the previous one (reordered, replayed) is ignored."""
        prev = self._marks.get(worker)
        if prev is not None and ts <= prev.ts:
            return None
        self._marks[worker] = _Mark(ts, routed_s, queued_tokens)
        if prev is None:
            return None
        prefill = (routed_s - prev.routed_s) + cost.prefill_s(prev.queued_tokens) - cost.prefill_s(queued_tokens)
        return progress_ratio(cost, decode_tokens, decode_s, running, batch_kv_tokens, prefill)

    def relative(self, worker: str, ratio: float, now: float, group: frozenset[str]) -> float:
        """``ratio`` over its group's current level: the median of the latest ratios (from the last
        ``PEER_WINDOW_S``) of the group's other members, never taken below 1; ``ratio`` itself
        with fewer than ``MIN_PEERS`` of them. The raw ratio is kept as this worker's latest.

        Why: the predicted step is the group's pooled fit, and it misses what the members share.
        In the simulator a heartbeat leaves out the prefill chunk in flight, so a healthy L40S
        read 1.4-1.6 with spikes to 10 in prefill-heavy intervals, and a median of five crossed
        ``slow_factor``. A slowed member stands out from its peers; a bias they all share does
        not. A cluster slowed as a whole is not the members' fault, and half-opening all of it
        helps nobody. Trust: the floor of 1 means a member claiming fast steps cannot make its
        peers look slower than the model alone would."""
        last = self._last
        peers = [last[m][0] for m in group if m != worker and m in last and now - last[m][1] <= PEER_WINDOW_S]
        last[worker] = (ratio, now)
        if len(peers) < MIN_PEERS:
            return ratio
        level = statistics.median(peers)
        return ratio / level if level > 1.0 else ratio

    def forget(self, worker: str) -> None:
        self._marks.pop(worker, None)
        self._last.pop(worker, None)
