"""Saturated models: every engine of the model has requests it cannot start. Pure.

The door's per-model bound (:class:`natsched.admitter.dynamic.ModelTotals`) books runtime tokens
against what a model's workers hold, and moves once per interval. Between two steps — and on a
small pool, where a few long prompts fill an engine's KV — the door can let in more than the
engines can start: the excess then waits *inside* the engines, for KV room or a batch slot, where
the door neither sees it nor sheds it, where it cannot be reordered (by age, by tenant), and where
it is bound to one worker although the other may free room first. On ``hetero`` (two L4s of one
model, ~9 sequences of KV each) that engine-side wait was the whole TTFT tail at load 0.9: up to
10 s for requests the door had let in at once.

So a model whose every live worker reported requests *waiting* in its engine (not yet running:
vLLM's ``num_requests_waiting``) at its last heartbeat is **saturated**: the door lets no more of
its requests in (they queue there, ``model_capacity``) until some worker of it may take one —
its next heartbeat shows nothing waiting, or it finished at least as many requests since that
heartbeat as were waiting then (each completion frees the room of about one waiting request).
This is the saturation detector of llm-d's flow control (queue depth per endpoint, every endpoint
saturated, then hold), at the global door: held requests wait where the standing-queue rule
(:mod:`natsched.admitter.standing`) and the tenant order apply, and are routed late, to the worker
that has room when they go.

Holding them costs no latency: an engine serves its own waiting queue first, so a request the
door holds while every engine has one could not have started sooner in an engine. A model with
one worker that does not report ``waiting`` (0) is never saturated; a single worker reporting
waiting forever (a hostile or broken one) cannot hold a model that another worker serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Engine:
    models: frozenset[str]
    waiting: int  # requests waiting in its engine at its last heartbeat
    done: int = 0  # completions from it since that heartbeat

    @property
    def backed_up(self) -> bool:
        return self.waiting > self.done


@dataclass
class EngineQueues:
    """Each worker's engine queue as its heartbeats and completions tell it."""

    engines: dict[str, _Engine] = field(default_factory=dict)

    def heartbeat(self, worker: str, models: frozenset[str], waiting: int) -> None:
        """A heartbeat: ``worker`` serves ``models`` and has ``waiting`` requests it has not started."""
        self.engines[worker] = _Engine(frozenset(models), max(0, int(waiting)))

    def completed(self, worker: str | None) -> None:
        """A request finished on ``worker`` (its room goes to a waiting one, or to the door)."""
        e = self.engines.get(worker) if worker is not None else None
        if e is not None:
            e.done += 1

    def gone(self, worker: str) -> None:
        """The worker is dead or drained: it takes nothing."""
        self.engines.pop(worker, None)

    def backed_up(self, worker: str) -> bool:
        e = self.engines.get(worker)
        return e is not None and e.backed_up

    def saturated(self) -> frozenset[str]:
        """The models every live worker of which is backed up."""
        free: set[str] = set()
        seen: set[str] = set()
        for e in self.engines.values():
            seen |= e.models
            if not e.backed_up:
                free |= e.models
        return frozenset(seen - free)
