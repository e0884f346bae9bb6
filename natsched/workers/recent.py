"""A bounded memory of request ids seen recently (cancelled before arrival, already finished)."""

from __future__ import annotations

import time
from collections import OrderedDict


#: how long a cancel is remembered for a request not seen yet (the dedup window), and how many
CANCEL_MEMORY_S = 120.0
CANCEL_MEMORY_MAX = 10_000


class RecentIds:
    """Ids remembered for ``max_age_s``, at most ``max_size`` of them (the oldest go first).

    Why bounded both ways: a worker runs for months; what it must remember only matters while a
    copy of the same message can still arrive (a redelivery after a lost ack, a cancel that
    overtook its request), which is seconds to minutes.
    """

    def __init__(self, max_age_s: float, max_size: int) -> None:
        self.max_age_s = max_age_s
        self.max_size = max_size
        self._seen: OrderedDict[str, float] = OrderedDict()

    def add(self, rid: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._seen.pop(rid, None)
        self._seen[rid] = now
        self._prune(now)

    def __contains__(self, rid: object) -> bool:
        self._prune(time.time())
        return rid in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def _prune(self, now: float) -> None:
        while self._seen and (len(self._seen) > self.max_size
                              or now - next(iter(self._seen.values())) > self.max_age_s):
            self._forget(self._seen.popitem(last=False)[0])

    def _forget(self, rid: str) -> None:
        """An id aged out (a subclass drops what it kept beside it)."""


class RecentMap(RecentIds):
    """:class:`RecentIds` that keeps a value per id (what was decided for it), bounded the same way."""

    def __init__(self, max_age_s: float, max_size: int) -> None:
        super().__init__(max_age_s, max_size)
        self._values: dict[str, object] = {}

    def put(self, rid: str, value: object, now: float | None = None) -> None:
        self._values[rid] = value
        self.add(rid, now)

    def get(self, rid: str) -> object | None:
        return self._values.get(rid) if rid in self else None

    def _forget(self, rid: str) -> None:
        self._values.pop(rid, None)
