"""Worker registry: each worker's state machine and load view, from heartbeats and our own routing.

States (the worker reports the first three in ``Heartbeat.state``; the router derives the rest)::

    HEALTHY     takes any new work
    BACKOFF     overloaded or erroring: takes only short requests (cheap to run, cheap to lose) —
                unless no worker of the model would take the request otherwise (panic)
    QUIESCING   draining before shutdown: takes nothing new
    REREGISTER  came back with a new ``started_at`` (or said "reregister"): its cache claims were
                dropped and it takes nothing until the router's index has its fresh state
    STALE       (derived) silent for 2 of its heartbeat periods (at most ``heartbeat_timeout_s``): excluded
    HALF_OPEN   (derived) reports healthy but its completions are much slower than its own learned
                prediction (:mod:`natsched.router.health`): takes only batch/offline work, short
                prompts and a small probe share, until its latency recovers

Load accounting, so a burst between two heartbeats does not pile onto one worker: every
assignment is *pending* until a heartbeat lists its request id in ``inflight`` (or is older than
``pending_grace_s``, for workers that do not list ids); a completion of a request that the last
heartbeat still counted is subtracted until the next heartbeat. The same ledger turns the queued
prefill a heartbeat reports into a busy-until time (:mod:`natsched.router.backlog`). Pure, no I/O.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Sequence

from natsched.wire.schema import Heartbeat, RequestId, WorkerId
from natsched.wire.ids import BlockHash
from natsched.router.backlog import advance, queued_prefill_s
from natsched.router.costmodel import CostModel
from natsched.router.errors import ConfigError
from natsched.router.health import LatencyHealth
from natsched.router.learned import CostBook, LearnSettings
from natsched.router.policy import RouteRequest, WorkerView

log = logging.getLogger(__name__)


class WorkerState(str, enum.Enum):
    HEALTHY = "healthy"
    BACKOFF = "backoff"
    QUIESCING = "quiescing"
    REREGISTER = "reregister"
    STALE = "stale"
    HALF_OPEN = "half_open"


_REPORTED = {s.value for s in (WorkerState.HEALTHY, WorkerState.BACKOFF, WorkerState.QUIESCING, WorkerState.REREGISTER)}


@dataclass
class RegistrySettings:
    heartbeat_timeout_s: float = 15.0  # a worker silent for longer is excluded
    missed_heartbeats: float = 2.0  # ... or silent for this many of its own heartbeat periods, if sooner
    backoff_max_prompt_tokens: int = 1024  # what a BACKOFF worker still accepts
    pending_grace_s: float = 2.0  # after this, a heartbeat surely counts our assignment
    forget_after_s: float = 600.0  # a worker silent this long is removed altogether
    ledger_ttl_s: float = 3600.0  # an assignment with no completion after this is dropped

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0 or self.forget_after_s < self.heartbeat_timeout_s:
            raise ConfigError("registry: heartbeat_timeout_s > 0 and forget_after_s >= it")


@dataclass(slots=True)
class Assignment:
    """One request this router sent, until its completion (the routing ledger)."""

    worker: WorkerId
    kv_tokens: int
    prefill_tokens: int
    expected_cached: int  # what the router predicted (worker reports + its own decisions)
    routed_at: float
    pending: bool = True  # not yet counted by a heartbeat of its worker
    # for the claim feedback (natsched.router.core): the part of the prediction the worker itself reported,
    # the request's chain and the index's removal mark at routing time
    claimed_cached: int = 0
    hashes: Sequence[BlockHash] = ()
    mark: int = 0
    # for the busy-until estimate (natsched.router.backlog)
    prompt_tokens: int = 0
    prefill_s: float = 0.0  # estimated seconds to prefill its uncached tokens
    # what the worker's cost model predicted at routing time (natsched.router.learned, .health)
    pred_wait_s: float = 0.0  # queue ahead
    pred_ttft_s: float = 0.0  # queue ahead + its own first token
    pred_tpot_s: float = 0.0  # one decode step with the batch it joined
    batch: int = 0  # sequences on the worker with it
    batch_kv: float = 0.0  # their KV tokens
    fixed_ttft_s: float = 0.0  # the fixed model's prediction (for the benchmark's comparison)
    pred_e2e_s: float = 0.0  # first token + its expected decode: past slow_factor x this it is overdue
    overdue: bool = False  # already counted as overdue (natsched.router.health)
    host_tokens: int = 0  # expected cached tokens in the worker's host tier (loaded, not recomputed)
    # the queue it met, for judging its latency (natsched.router.health.completion_ratio)
    prefill_mark: float = 0.0  # the worker's prefill-seconds counter right after this assignment
    kv_queued: bool = False  # requests waited for KV room on the worker (or this one had none)
    pred_learned: bool = False  # the prediction came from a model learned from enough samples


class WorkerRegistry:
    """Worker views plus the ledger of our assignments; the state machine lives here."""

    def __init__(self, settings: RegistrySettings | None = None, cost: CostModel | None = None,
                 costs: CostBook | None = None, health: LatencyHealth | None = None) -> None:
        self.settings = settings or RegistrySettings()
        self.cost = cost or CostModel()
        # per-worker seconds for the busy-until estimate: learned when the core passes its book
        self.costs = costs or CostBook(self.cost, LearnSettings(enabled=False))
        self.health = health or LatencyHealth()
        self.views: dict[WorkerId, WorkerView] = {}
        self.ledger: dict[RequestId, Assignment] = {}
        self._pending: dict[WorkerId, dict[RequestId, Assignment]] = {}
        self._inflight: dict[WorkerId, frozenset[str]] = {}  # ids the last heartbeat counted
        self._reported: dict[WorkerId, str] = {}
        self._awaiting: set[WorkerId] = set()  # re-registered, waiting for fresh cache state
        self._stale: set[WorkerId] = set()
        self._prefill_s: dict[WorkerId, float] = {}  # per worker: prefill seconds routed to it, ever

    # ------------------------------------------------------------------ heartbeats

    def on_heartbeat(self, hb: Heartbeat, now: float) -> bool:
        """Update ``hb.worker``'s view; True when it restarted (its cache claims must go)."""
        w = hb.worker
        view = self.views.get(w)
        restarted = False
        if view is None:
            view = self.views[w] = WorkerView(id=w, joined_at=now, started_at=hb.started_at)
            log.info("worker %s joined (state %s)", w, hb.state)
        elif self._is_restart(view, hb):
            restarted = True
            self._on_restart(view, hb, now)
        self._reported[w] = hb.state
        if hb.state not in _REPORTED:
            log.warning("worker %s reports unknown state %r: no new work", w, hb.state)
        self._copy_load(view, hb, now)
        self._settle_pending(view, hb, now)
        self._estimate_busy_until(view, hb, now)
        if w in self._stale:
            self._stale.discard(w)
            log.info("worker %s heard again after %.1fs", w, now - view.last_heartbeat)
        view.last_heartbeat = now
        view.heartbeat_interval = hb.interval
        self._set_state(view)
        return restarted

    def silence_limit(self, view: WorkerView) -> float:
        """Seconds of silence after which ``view`` gets no more work. A dead worker's assignments
        wait for a rescue, so the router stops sooner than the admitter's lease (3 periods)."""
        if view.heartbeat_interval <= 0:
            return self.settings.heartbeat_timeout_s
        return min(self.settings.heartbeat_timeout_s, self.settings.missed_heartbeats * view.heartbeat_interval)

    def _is_restart(self, view: WorkerView, hb: Heartbeat) -> bool:
        if hb.started_at and view.started_at and hb.started_at != view.started_at:
            return True
        return hb.state == WorkerState.REREGISTER and self._reported.get(view.id) != WorkerState.REREGISTER

    def _on_restart(self, view: WorkerView, hb: Heartbeat, now: float) -> None:
        log.info("worker %s re-registers (started_at %s -> %s)", view.id, view.started_at, hb.started_at)
        view.started_at = hb.started_at
        view.joined_at = now  # a fresh, cold cache: warm-up starts again
        self._awaiting.add(view.id)
        for a in self._pending.pop(view.id, {}).values():
            a.pending = False
        view.pending = view.pending_tokens = view.pending_prefill_tokens = 0

    @staticmethod
    def _copy_load(view: WorkerView, hb: Heartbeat, now: float) -> None:
        view.model = hb.model
        if hb.served or view.serves:
            view.serves = frozenset(m.id for m in hb.served)
            view.active = frozenset(m.id for m in hb.served if m.active)
        view.running, view.waiting = hb.running, hb.waiting
        view.kv_used_blocks, view.kv_total_blocks = hb.kv_used_blocks, hb.kv_total_blocks
        view.runtime_tokens, view.capacity_tokens = hb.runtime_tokens, hb.capacity_tokens
        view.queued_prefill_tokens = hb.queued_prefill_tokens
        view.block_size = hb.block_size
        view.kv_seq = hb.kv_seq
        view.finished = view.finished_tokens = 0

    def _settle_pending(self, view: WorkerView, hb: Heartbeat, now: float) -> None:
        """Assignments the heartbeat counts stop being pending (by id, or by age)."""
        inflight = frozenset(hb.inflight)
        self._inflight[view.id] = inflight
        pending = self._pending.get(view.id)
        if not pending:
            return
        cutoff = now - self.settings.pending_grace_s
        for rid, a in list(pending.items()):
            if rid in inflight or a.routed_at <= cutoff:
                del pending[rid]
                a.pending = False
                view.pending -= 1
                view.pending_tokens -= a.kv_tokens
                view.pending_prefill_tokens -= a.prefill_tokens

    def _estimate_busy_until(self, view: WorkerView, hb: Heartbeat, now: float) -> None:
        """Busy-until from the reported queue (in seconds, via our ledger), then our newer work."""
        ledger = self.ledger
        ours = [a for rid in hb.inflight if (a := ledger.get(rid)) is not None and not a.pending and a.worker == view.id]
        ours.sort(key=lambda a: a.routed_at, reverse=True)
        busy = now + queued_prefill_s(hb.queued_prefill_tokens, ((a.prompt_tokens, a.prefill_tokens) for a in ours),
                                      self.costs.of(view.id))
        for a in self._pending.get(view.id, {}).values():
            busy = advance(busy, a.routed_at, a.prefill_s)
        view.busy_until = busy

    def _set_state(self, view: WorkerView) -> None:
        state = WorkerState.REREGISTER.value if view.id in self._awaiting else self._reported[view.id]
        if state != view.state:
            log.info("worker %s state %s -> %s", view.id, view.state, state)
            view.state = state

    def mark_fresh(self, w: WorkerId) -> None:
        """The index now has ``w``'s fresh cache state: leave REREGISTER."""
        if w in self._awaiting:
            self._awaiting.discard(w)
            self._set_state(self.views[w])

    def awaiting_fresh(self, w: WorkerId) -> bool:
        return w in self._awaiting

    # ------------------------------------------------------------------ assignments

    def on_assigned(self, rid: RequestId, a: Assignment) -> None:
        view = self.views[a.worker]
        old = self.ledger.pop(rid, None)
        if old is not None:  # re-routed: the old assignment no longer loads its worker
            self._unpend(rid, old)
        self.ledger[rid] = a
        self._pending.setdefault(a.worker, {})[rid] = a
        view.pending += 1
        view.pending_tokens += a.kv_tokens
        view.pending_prefill_tokens += a.prefill_tokens
        view.busy_until = advance(view.busy_until or 0.0, a.routed_at, a.prefill_s)
        a.prefill_mark = self._prefill_s[a.worker] = self._prefill_s.get(a.worker, 0.0) + a.prefill_s

    def prefill_routed(self, w: WorkerId) -> float:
        """Seconds of prefill routed to ``w`` so far (the counter ``prefill_since`` reads)."""
        return self._prefill_s.get(w, 0.0)

    def prefill_since(self, w: WorkerId, mark: float) -> float:
        """Seconds of prefill routed to ``w`` since its counter read ``mark`` (an assignment's
        ``prefill_mark``): the work queued behind that request."""
        d = self._prefill_s.get(w, 0.0) - mark
        return d if d > 0.0 else 0.0

    def on_completion(self, rid: RequestId, worker: WorkerId | None, runtime_tokens: int) -> Assignment | None:
        """Release a finished request's load; returns our assignment of it, if we made one."""
        a = self.ledger.pop(rid, None)
        w = a.worker if a is not None else worker
        if a is not None and a.pending:
            self._unpend(rid, a)
        elif w is not None and rid in self._inflight.get(w, ()):
            view = self.views.get(w)
            if view is not None:
                view.finished += 1
                view.finished_tokens += a.kv_tokens if a is not None else runtime_tokens
        return a

    def _unpend(self, rid: RequestId, a: Assignment) -> None:
        pending = self._pending.get(a.worker)
        view = self.views.get(a.worker)
        if pending is None or pending.pop(rid, None) is None or view is None:
            return
        a.pending = False
        view.pending -= 1
        view.pending_tokens -= a.kv_tokens
        view.pending_prefill_tokens -= a.prefill_tokens

    # ------------------------------------------------------------------ queries

    def state(self, w: WorkerId, now: float) -> WorkerState | str:
        """Effective state now: STALE when silent too long, else the machine's state."""
        view = self.views[w]
        if now - view.last_heartbeat > self.silence_limit(view):
            return WorkerState.STALE
        if view.state == WorkerState.HEALTHY and self.health.is_half_open(w):
            return WorkerState.HALF_OPEN
        return WorkerState(view.state) if view.state in _REPORTED else view.state

    def eligible(self, view: WorkerView, req: RouteRequest, now: float, panic: bool = False) -> bool:
        """May ``view`` take ``req`` now? Only if it serves the request's model (its own, or one
        of its ``served`` models and adapters); then Healthy: yes (half-open: batch, short or probe
        requests); Backoff: short prompts only; else no. ``panic`` (no worker of the model would
        take it otherwise): half-open and backoff workers take anything."""
        if (view.model != req.model and req.model not in view.serves) or \
                now - view.last_heartbeat > self.silence_limit(view):
            return False
        if view.id in req.avoid:
            return False
        if view.state == "healthy":
            return panic or self.health.admits(view.id, req.id, req.cls, req.prompt_tokens)
        return view.state == "backoff" and (panic or req.prompt_tokens <= self.settings.backoff_max_prompt_tokens)

    def why_no_worker(self, model: str, now: float) -> str:
        """Why a request for ``model`` (a base model or a LoRA adapter) found no worker, for its
        producer: nobody serves it (and what is served), or who serves it and in what state."""
        serving = sorted(v.id for v in self.views.values() if v.model == model or model in v.serves)
        if not serving:
            served = sorted({m for v in self.views.values() for m in (v.model, *v.serves) if m})
            return (f"no worker serves model {model!r} (a model or LoRA adapter); served: "
                    f"{', '.join(served) or 'nothing yet'}")
        states = [getattr(st, "value", st) for st in (self.state(w, now) for w in serving)]  # (unknown: as said)
        said = ", ".join(f"{w} {st}" for w, st in zip(serving, states))
        return f"no worker serving model {model!r} can take it now ({said})"

    # ------------------------------------------------------------------ housekeeping

    def tick(self, now: float) -> list[WorkerId]:
        """Log newly stale workers, forget long-gone ones (returned), age out the ledger."""
        gone: list[WorkerId] = []
        for w, view in list(self.views.items()):
            silent = now - view.last_heartbeat
            if silent > self.settings.forget_after_s:
                gone.append(w)
                self._forget(w)
                log.info("worker %s forgotten after %.0fs of silence", w, silent)
            elif silent > self.silence_limit(view) and w not in self._stale:
                self._stale.add(w)
                log.warning("worker %s stale: no heartbeat for %.1fs, excluded", w, silent)
        cutoff = now - self.settings.ledger_ttl_s
        for rid in [rid for rid, a in self.ledger.items() if a.routed_at < cutoff]:
            a = self.ledger.pop(rid)
            if a.pending:
                self._unpend(rid, a)
        return gone

    def _forget(self, w: WorkerId) -> None:
        self.views.pop(w, None)
        self._pending.pop(w, None)
        self._inflight.pop(w, None)
        self._reported.pop(w, None)
        self._awaiting.discard(w)
        self._stale.discard(w)
        self._prefill_s.pop(w, None)
