"""Latency-tied health: a worker slower than its own learned prediction goes half-open. Pure, no I/O.

Why: a worker that slows down (a noisy neighbour, thermal throttling, a degraded link) keeps its
queue short for a while — it is the *time* per token that grows — so neither its heartbeats nor
its own backoff rule notice, and it keeps getting online work that then waits, times out and
is retried elsewhere: slowness turns into a retry storm. The router knows what it expected of
each request it routed (the worker's own learned cost model, :mod:`natsched.router.learned`)
and what happened (the completion's TTFT and TPOT), so it can tell "slow for this worker" from
"long request".

The state machine, per worker (the registry shows ``half_open`` over a reported ``healthy``;
see also ``docs/routing-health.md``)::

                median ratio > slow_factor over window_s (>= min_samples)
      HEALTHY  ─────────────────────────────────────────────────────────▶  HALF_OPEN
         ▲                                                                    │
         └──── median ratio < recover_factor over window_s (>= min_samples) ──┘

``ratio`` of one completion = observed / predicted, the *smaller* of the TTFT and TPOT ratios
when both exist: a slowed engine raises both, while each alone also rises for reasons that are
not the worker's (a queue the router under-estimated raises TTFT; a long prefill beside it
raises TPOT), and those rarely coincide. The *median* over a window, with a minimum of samples,
ignores a single long queue or an outlier. Only a worker whose model has learned from
``min_learned`` samples is judged: the fixed model, or a prior that has not met the worker, is
no yardstick (a 27B model is "3x slower than predicted" by the 8B constants, and healthy).
Besides completions, the router counts requests still outstanding past ``slow_factor`` x their
predicted end (:meth:`natsched.router.core.RouterCore.tick`): a slowed worker's completions come
late by the very slowdown, its overdue requests do not. An overdue request alone is weaker
evidence (it may sit in a queue nobody predicted), so going half-open also needs one *completed*
request over the factor in the window. The earliest evidence is the decode progress a worker
reports in every heartbeat (:mod:`natsched.router.progress`, :meth:`LatencyHealth.observe_progress`):
its median over ``progress_samples`` heartbeats opens the circuit seconds after a slowdown
begins; being the worker's own word, it can only add a half-open state, never end one that
completions caused. Hysteresis (``recover_factor`` < ``slow_factor``) keeps a borderline worker from
flapping.

HALF_OPEN (the circuit breaker's middle state) takes only what is cheap to run slowly and cheap
to lose: non-online classes (batch, offline), short prompts (``short_prompt_tokens``), and a
``probe_share`` of other requests (chosen by a hash of the request id, so a retry is not a new
probe) so there are completions to judge its recovery by. Half-open never leaves a request
with nowhere to go: when no other worker can take it, half-open ones can (Envoy's panic
threshold, reduced to its rule: ejecting every host helps nobody). While half-open the worker's samples
are *not learned*: the learned model must keep describing the worker as it normally is, or it
would learn the slowness and call the worker healthy again while it is still slow. After
``max_half_open_s`` the router accepts that the worker changed for good: learning resumes, the
model adapts (within a minute), the ratios fall back to ~1 and the worker is healthy again, at
its new speed.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections import deque
from dataclasses import dataclass

from natsched.router.errors import ConfigError

log = logging.getLogger(__name__)

HEALTHY, HALF_OPEN = "healthy", "half_open"


@dataclass
class HealthSettings:
    enabled: bool = True
    slow_factor: float = 2.0  # observed / predicted above this for the window: half-open
    recover_factor: float = 1.5  # ... below this for the window: healthy again
    window_s: float = 10.0  # the sustained window (long enough for a few completions per worker)
    min_samples: int = 2  # never judge on fewer samples than this (with one completion over the factor)
    min_learned: float = 50.0  # ... nor a worker whose model has learned from fewer (a prior is no yardstick)
    # a member routed on its group's pooled fit is judged by the group's samples once it has
    # this many of its own (it has shown it runs like the group; CostBook.yardstick_samples) ...
    min_own: float = 10.0
    min_group: int = 3  # ... in a group of at least this many (its heartbeats judged against its peers')
    probe_share: float = 0.1  # share of other requests a half-open worker may still take
    short_prompt_tokens: int = 1024  # prompts up to this are "short" (as for BACKOFF)
    max_half_open_s: float = 60.0  # then the worker's new speed is learned (it changed for good)
    # heartbeats of decode progress (natsched.router.progress) whose median over slow_factor
    # makes a worker half-open, and under recover_factor ends it; 0: completions only
    progress_samples: int = 5

    def __post_init__(self) -> None:
        if not 1.0 < self.recover_factor <= self.slow_factor:
            raise ConfigError("health: 1 < recover_factor <= slow_factor")
        if self.min_learned < 0 or self.min_own < 0 or self.min_group < 2:
            raise ConfigError("health: min_learned >= 0, min_own >= 0, min_group >= 2")
        if self.window_s <= 0 or self.min_samples < 1 or self.max_half_open_s <= 0 or self.progress_samples < 0:
            raise ConfigError("health: window_s > 0, min_samples >= 1, max_half_open_s > 0, progress_samples >= 0")
        if not 0.0 <= self.probe_share <= 1.0 or self.short_prompt_tokens < 0:
            raise ConfigError("health: probe_share within [0, 1], short_prompt_tokens >= 0")


def completion_ratio(ttft: float | None, pred_ttft: float, tpot: float | None, pred_tpot: float,
                     output_tokens: int = 0, interleaved_s: float = 0.0, queued: bool = False) -> float | None:
    """Observed / predicted of one completion (the smaller of TTFT's and TPOT's), or None — the
    prediction *given the queue the request met*, because queueing delay is not slowness:

    - ``interleaved_s``: seconds of prefill routed to the worker after this request (first come,
      first served: behind its first token, so computed during its decode). An engine with chunked
      prefill runs them inside the decode steps, so the request's decode took
      ``(output_tokens - 1) x pred_tpot + interleaved_s`` on a worker at its normal speed; its TPOT
      is judged against that. A loaded L4 taking one long prompt after another decoded at 1.4-1.6x
      its bare step time, healthy, and went half-open (hetero, elastic);
    - ``queued``: when it was routed the worker had requests waiting for KV room (or this one did
      not fit): its TTFT includes a wait for memory that the prefill-queue prediction does not
      know, so the TTFT is no evidence (4-5 s against a predicted 1-2 s on a full, healthy L4).
    A slowed worker still shows its slowdown: every step and every prefill of it takes longer."""
    parts = []
    if ttft is not None and ttft > 0 and pred_ttft > 0 and not queued:
        parts.append(ttft / pred_ttft)
    if tpot is not None and tpot > 0 and pred_tpot > 0:
        steps = output_tokens - 1
        allowed = pred_tpot + (interleaved_s / steps if steps > 0 and interleaved_s > 0 else 0.0)
        parts.append(tpot / allowed)
    if not parts or not all(math.isfinite(p) for p in parts):
        return None
    return min(parts)


def is_probe(request_id: str, share: float) -> bool:
    """Deterministic: the same request id is a probe (or not) on every try and every replica."""
    return zlib.crc32(b"probe:" + request_id.encode()) % 10_000 < share * 10_000


class _State:
    __slots__ = ("window", "state", "since", "changes")

    def __init__(self) -> None:
        self.window: deque[tuple[float, float]] = deque()
        self.state = HEALTHY
        self.since = 0.0
        self.changes = 0


class LatencyHealth:
    """Per-worker windows of completion ratios and the HEALTHY / HALF_OPEN state machine."""

    def __init__(self, settings: HealthSettings | None = None) -> None:
        self.settings = settings or HealthSettings()
        self._w: dict[str, _State] = {}
        self._confirmed: dict[str, float] = {}  # worker -> time of the last completion over slow_factor
        self.transitions: deque[tuple[float, str, str]] = deque(maxlen=1000)  # (t, worker, new state)
        self._progress: dict[str, deque[float]] = {}  # worker -> the last heartbeats' progress ratios
        self._slow_since: dict[str, float] = {}  # worker -> when its progress reports made it half-open

    def state(self, w: str) -> str:
        return HALF_OPEN if self.is_half_open(w) else HEALTHY

    def is_half_open(self, w: str) -> bool:
        st = self._w.get(w)
        return (st is not None and st.state == HALF_OPEN) or w in self._slow_since

    def since(self, w: str) -> float | None:
        st = self._w.get(w)
        times = [t for t in (st.since if st is not None and st.state == HALF_OPEN else None,
                             self._slow_since.get(w)) if t is not None]
        return min(times) if times else None

    def median(self, w: str) -> float | None:
        st = self._w.get(w)
        if st is None or not st.window:
            return None
        values = sorted(r for _, r in st.window)
        return values[len(values) // 2] if len(values) % 2 else 0.5 * (values[len(values) // 2 - 1]
                                                                         + values[len(values) // 2])

    def learning_frozen(self, w: str, now: float) -> bool:
        """Half-open for less than ``max_half_open_s``: its samples must not be learned."""
        since = self.since(w)
        return since is not None and now - since < self.settings.max_half_open_s

    def observe_progress(self, w: str, ratio: float, now: float) -> str | None:
        """Add one heartbeat's progress ratio (:mod:`natsched.router.progress`); returns the new
        state when it changed, else None.

        The median of the last ``progress_samples`` over ``slow_factor`` makes ``w`` half-open; under
        ``recover_factor`` it ends *that* half-open state only. The report is the worker's own
        word: it can add a half-open state, never end one its completions caused, so a worker
        cannot claim its way to more work than a silent one gets."""
        s = self.settings
        if not s.enabled or not s.progress_samples or not math.isfinite(ratio) or ratio <= 0:
            return None
        win = self._progress.get(w)
        if win is None:
            win = self._progress[w] = deque(maxlen=s.progress_samples)
        win.append(ratio)
        if len(win) < s.progress_samples:
            return None
        med = sorted(win)[len(win) // 2] if len(win) % 2 else sorted(win)[len(win) // 2 - 1]
        was = self.is_half_open(w)
        if w not in self._slow_since and med > s.slow_factor:
            self._slow_since[w] = now
            win.clear()
        elif w in self._slow_since and med < s.recover_factor:
            del self._slow_since[w]
            win.clear()
        else:
            return None
        state = self.state(w)
        if state == (HALF_OPEN if was else HEALTHY):
            return None
        log.warning("worker %s %s: decode steps at %.2fx its predicted step time (median of %d heartbeats)",
                    w, "half-open" if state == HALF_OPEN else "healthy again", med, s.progress_samples)
        self.transitions.append((now, w, state))
        return state

    def observe(self, w: str, ratio: float, now: float, completed: bool = True) -> str | None:
        """Add one ratio (a completion's, or an overdue request's with ``completed`` False);
        returns the new state when it changed, else None."""
        s = self.settings
        if not s.enabled or not math.isfinite(ratio) or ratio <= 0:
            return None
        if completed and ratio > s.slow_factor:
            self._confirmed[w] = now
        st = self._w.get(w)
        if st is None:
            st = self._w[w] = _State()
        win = st.window
        win.append((now, ratio))
        while win and win[0][0] < now - s.window_s:
            win.popleft()
        if len(win) < s.min_samples:
            return None
        med = self.median(w)
        confirmed = self._confirmed.get(w, -math.inf) >= now - s.window_s
        if st.state == HEALTHY and med > s.slow_factor and confirmed:
            return self._set(w, st, HALF_OPEN, now, med)
        if st.state == HALF_OPEN and med < s.recover_factor:
            return self._set(w, st, HEALTHY, now, med)
        return None

    def _set(self, w: str, st: _State, state: str, now: float, med: float) -> str | None:
        """The completions' verdict; a transition only if the worker's state changed with it (its
        heartbeats' progress may hold it half-open already, or still)."""
        was = self.is_half_open(w)
        st.state, st.since = state, now
        st.window.clear()  # the next verdict is on fresh completions only
        st.changes += 1
        if self.is_half_open(w) == was:
            return None
        log.warning("worker %s %s: completions at %.2fx its predicted latency (median of %d over %.0fs)",
                    w, "half-open" if state == HALF_OPEN else "healthy again", med, len(st.window),
                    self.settings.window_s)
        self.transitions.append((now, w, state))
        return state

    def forget(self, w: str) -> None:
        self._w.pop(w, None)
        self._confirmed.pop(w, None)
        self._progress.pop(w, None)
        self._slow_since.pop(w, None)

    def changes(self) -> int:
        return sum(st.changes for st in self._w.values())

    def admits(self, w: str, request_id: str, cls: str, prompt_tokens: int) -> bool:
        """May half-open ``w`` take this request? (True for a healthy one.)"""
        if not self.is_half_open(w):
            return True
        s = self.settings
        return cls != "online" or prompt_tokens <= s.short_prompt_tokens or is_probe(request_id, s.probe_share)
