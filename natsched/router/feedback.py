"""Claim accuracy: do a worker's cache claims come true? Pure, no I/O.

Every completion says how many prompt tokens were actually served from cache
(``Completion.cached_tokens``). The router compares it with what the worker's *own* cache reports
claimed when the request was routed (see :meth:`natsched.router.core.RouterCore._claim_failed` for what is
judged and what is not). A worker whose claims keep failing (its events lag or are wrong, its cache
evicts without saying so) would keep attracting traffic it cannot serve cheaply, so it is
*demoted*: its claims are ignored until it sends a snapshot, which resets its score.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from natsched.wire.schema import WorkerId
from natsched.router.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class FeedbackSettings:
    alpha: float = 0.2  # EWMA weight of the newest sample (~ the last 5-10 completions)
    demote_below: float = 0.5  # accuracy under this demotes the worker's claims
    min_samples: int = 5  # never judge on fewer completions than this
    min_expected_tokens: int = 1  # predictions smaller than this are not claims

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0 or not 0.0 <= self.demote_below <= 1.0:
            raise ConfigError("feedback: alpha in (0, 1], demote_below in [0, 1]")


@dataclass(slots=True)
class _Accuracy:
    value: float = 1.0
    samples: int = 0


class ClaimTracker:
    """Per-worker EWMA of ``min(1, actual / expected)`` cached tokens."""

    def __init__(self, settings: FeedbackSettings | None = None) -> None:
        self.settings = settings or FeedbackSettings()
        self._acc: dict[WorkerId, _Accuracy] = {}

    def observe(self, w: WorkerId, expected: int, actual: int) -> bool:
        """Record one completion; True when ``w`` should be demoted now."""
        s = self.settings
        if expected < s.min_expected_tokens:
            return False
        acc = self._acc.get(w)
        if acc is None:
            acc = self._acc[w] = _Accuracy()
        ratio = actual / expected
        acc.value += s.alpha * ((ratio if ratio < 1.0 else 1.0) - acc.value)
        acc.samples += 1
        return acc.samples >= s.min_samples and acc.value < s.demote_below

    def reset(self, w: WorkerId) -> None:
        """Fresh state (a snapshot, a restart): start judging ``w`` from scratch."""
        self._acc.pop(w, None)

    def accuracy(self, w: WorkerId) -> float:
        acc = self._acc.get(w)
        return acc.value if acc is not None else 1.0
