"""Errors of the simulator package.

::

    SimError
    ├── TraceError              a trace that cannot be replayed
    │   ├── TraceFormatError    a line that is not JSON, or lacks / mistypes a field (names the line)
    │   └── EmptyTraceError     a trace (or the part kept by --limit) with no request in it
    ├── SimConfigError          a setting that cannot be used: speedup <= 0, workers < 1, unknown
    │                           policy or profile, target busy outside (0, 1) (also a ValueError)
    │   └── ScenarioError       a scenario file that cannot be used (names the file and the field)
    ├── CalibrationError        --target-busy cannot be reached within the speed-up range searched
    ├── PlotUnavailableError    --plot asked for, but matplotlib is not installed
    └── ReplayError             (natsched.sim.replay) a recorded window that cannot be replayed
        └── WindowAgedOut       its messages are past the streams' retention
"""

from __future__ import annotations

from natsched.errors import NatschedError


class SimError(NatschedError):
    """Root of every simulator error."""


class TraceError(SimError):
    """A trace that cannot be replayed."""


class TraceFormatError(TraceError):
    """One line of a trace is unusable; ``line`` is its 1-based number."""

    def __init__(self, source: str, line: int, message: str) -> None:
        super().__init__(f"{source}:{line}: {message}")
        self.source = source
        self.line = line
        self.detail = message

    def __reduce__(self):  # picklable across processes despite the 3-argument constructor
        return (type(self), (self.source, self.line, self.detail))


class EmptyTraceError(TraceError):
    """The trace holds no request."""


class SimConfigError(SimError, ValueError):
    """A simulator or benchmark setting that cannot be used."""


class CalibrationError(SimError):
    """The requested busy fraction could not be bracketed."""


class PlotUnavailableError(SimError):
    """Plotting needs matplotlib, which is an optional extra."""


class ScenarioError(SimConfigError):
    """A scenario file (or dict) that cannot be used; ``field`` is the dotted path of the culprit."""

    def __init__(self, source: str, field: str, message: str) -> None:
        super().__init__(f"{source}: {field}: {message}" if field else f"{source}: {message}")
        self.source = source
        self.field = field
        self.detail = message

    def __reduce__(self):
        return (type(self), (self.source, self.field, self.detail))
