"""When and how long a producer waits before trying a failed request again.

Why here and this shape: most retry storms come from client defaults — every client retrying at
once, at fixed intervals, ignoring the server's ``retry_after``. So: exponential backoff with
*full jitter* (sleep a uniform draw in ``[0, min(cap, base * 2**n)]``, the variant AWS's
"Exponential Backoff and Jitter" analysis found to spread a herd best), never sooner than the
server's ``retry_after`` (the floor; the jitter still spreads the clients above it), never past
the request's deadline, and only for outcomes a retry can change. Pure: outcome and clock in,
decision out; :class:`natsched.client.producer.Client` does the waiting.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from natsched.client.errors import ClientSettingsError, Rejected, RequestError, RequestFailed

#: failures after admission that another attempt may not meet (a worker may come, or be alive;
#: an engine server that died sends its agent to backoff, so the next try goes to another one)
RETRY_FAILURES = ("no_worker", "worker_lost", "server_unavailable")


@dataclass(frozen=True)
class Retry:
    """A retry policy: ``Client.submit(request, retry=Retry())``.

    Retried: a rejection that carries ``retry_after`` (quota, tenant cap, queue full) and the
    failures in ``failures``. Never: a request refused as sent (bad field, unknown tenant), a
    timeout (its deadline is spent), a duplicate. A stream that already yielded output is retried
    only with ``after_output`` (its consumer then sees the output again from the start).
    """

    attempts: int = 4  # tries in all, the first one included
    base_s: float = 0.25  # the first backoff window
    cap_s: float = 20.0  # no backoff window is longer
    failures: tuple[str, ...] = RETRY_FAILURES
    after_output: bool = False
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise ClientSettingsError(f"retry attempts must be an integer >= 1, got {self.attempts!r}")
        for name in ("base_s", "cap_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ClientSettingsError(f"retry {name} must be a positive number of seconds, got {value!r}")
        if self.cap_s < self.base_s:
            raise ClientSettingsError(f"retry cap_s ({self.cap_s}) must be >= base_s ({self.base_s})")

    def retryable(self, exc: RequestError, produced_output: bool) -> bool:
        if produced_output and not self.after_output:
            return False
        if isinstance(exc, Rejected):
            return exc.retry_after is not None
        return isinstance(exc, RequestFailed) and exc.reason in self.failures

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before try ``attempt + 1`` (``attempt`` = tries so far, >= 1)."""
        window = min(self.cap_s, self.base_s * 2 ** (attempt - 1))
        return (retry_after or 0.0) + self.rng.uniform(0.0, window)

    def next_delay(self, exc: RequestError, attempt: int, produced_output: bool, now: float,
                   deadline: float | None) -> float | None:
        """How long to wait before trying again, or None: give up (raise ``exc``)."""
        if attempt >= self.attempts or not self.retryable(exc, produced_output):
            return None
        wait = self.delay(attempt, getattr(exc, "retry_after", None))
        if deadline is not None and now + wait >= deadline:
            return None  # it would start after the caller stopped waiting
        return wait
