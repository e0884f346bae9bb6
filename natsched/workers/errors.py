"""Errors raised by the worker side (engines, calibration).

Every error here derives from :class:`WorkerError`::

    WorkerError
    ├── EngineUnavailable     the engine's package (vllm) is not installed or cannot be imported
    ├── EngineStartError      the engine could not be built (bad model path, bad options, no memory)
    ├── CalibrationError      a capacity calibration could not measure anything usable
    └── RunTimeout            a run passed its TTFT, idle or total limit (the agent turns it into
                              a failed outcome with that reason; :mod:`natsched.workers.limits`)

Failures *of a request* are not exceptions: an engine answers them with an
:class:`~natsched.workers.engine.EngineOutput` carrying ``error`` (``"<code>: <message>"``), so the agent
can turn them into a completion and a reply instead of losing them.
"""

from __future__ import annotations

from natsched.errors import NatschedError


class WorkerError(NatschedError):
    """Root of every worker-side error."""


class EngineUnavailable(WorkerError):
    """The engine's package is missing (e.g. ``vllm`` without the ``cpu``/``vllm`` extra)."""


class EngineStartError(WorkerError):
    """The engine could not be started; the message says what it was given."""


class CalibrationError(WorkerError):
    """A calibration run produced no usable measurement."""


class RunTimeout(WorkerError):
    """A run passed one of its limits; ``reason``: ``ttft_timeout``, ``idle_timeout`` or ``deadline_exceeded``."""

    def __init__(self, reason: str, request_id: str) -> None:
        super().__init__(f"request {request_id}: {reason}")
        self.reason = reason
