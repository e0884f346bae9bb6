"""The admission side of the simulator: a pluggable hook that runs before routing.

The simulator asks the hook about every arriving request: ``allow`` routes it now, ``reject`` drops
it (recorded as rejected, reason ``admission``), ``queue`` hands it to the hook, which gives it back
later from :meth:`AdmissionHook.release`. The simulator calls ``release`` after every completion
(capacity was freed) and every ``tick_s`` seconds of virtual time when the hook sets it (aging,
time-based budgets). ``on_finish`` is called once for every request the hook allowed or released,
when it completes or fails, so reservations can be returned.

The routing benchmark uses :class:`AllowAll`; the admission benchmark plugs an adapter around the
shipped admission policy here, so it too measures the code that ships.
"""

from __future__ import annotations

from typing import Protocol

from natsched.sim.trace import TraceRequest

ALLOW, QUEUE, REJECT = "allow", "queue", "reject"
VERDICTS = (ALLOW, QUEUE, REJECT)


def runtime_tokens(req: TraceRequest) -> int:
    """Runtime tokens of a request, by the admitter's rule (natsched.admitter.policy.runtime_tokens):
    the prompt to prefill (the admitter cannot know the cache) + the KV it will hold."""
    prompt = max(1, req.input_length)
    return prompt + prompt + max(0, req.output_length)


class AdmissionHook(Protocol):
    name: str
    tick_s: float | None  # call release() this often (virtual seconds), or never

    def admit(self, req: TraceRequest, now: float) -> str:
        """``allow``, ``queue`` or ``reject``."""
        ...

    def release(self, now: float) -> list[TraceRequest]:
        """Queued requests that may enter now (each counts as allowed)."""
        ...

    def on_finish(self, req: TraceRequest, ok: bool, now: float) -> None: ...


class AllowAll:
    """No admission control: every request goes straight to the router."""

    name = "allow_all"
    tick_s: float | None = None

    def admit(self, req: TraceRequest, now: float) -> str:
        return ALLOW

    def release(self, now: float) -> list[TraceRequest]:
        return []

    def on_finish(self, req: TraceRequest, ok: bool, now: float) -> None:
        pass
