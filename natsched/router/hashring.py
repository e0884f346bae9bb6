"""Consistent hashing with virtual nodes, and its bounded-load variant. Pure, no I/O.

Used two ways: the ``consistent_hash`` peer policy (ketama style, 160 points per worker), and by
``natsched`` as an optional *home* for model-level large prefixes, so that several router
replicas agree where a cold prefix goes without talking to each other. Bounded load (Mirrokni,
Thorup, Zadimoghaddam 2018): walk clockwise past workers already above ``c x`` the mean load.

Keys are mixed with splitmix64 first: trace hash ids (Mooncake's 0, 1, 2, ...) are not uniform.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Iterable, Mapping

from natsched.wire.schema import WorkerId

_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64 finaliser: spreads any int (small ids included) over 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _point(worker: str, i: int) -> int:
    digest = hashlib.blake2b(f"{worker}#{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class HashRing:
    """A ring over a set of workers; rebuilt only when the set changes."""

    def __init__(self, vnodes: int = 160) -> None:
        self.vnodes = vnodes
        self._members: frozenset[WorkerId] = frozenset()
        self._points: list[int] = []
        self._owners: list[WorkerId] = []

    def ensure(self, workers: Iterable[WorkerId]) -> None:
        """Rebuild for this member set if it differs from the current one."""
        members = frozenset(workers)
        if members == self._members:
            return
        ring = sorted((_point(w, i), w) for w in members for i in range(self.vnodes))
        self._members = members
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]

    def owner(self, key: int) -> WorkerId | None:
        """The first worker clockwise of ``key``."""
        if not self._points:
            return None
        i = bisect.bisect_right(self._points, mix64(key)) % len(self._points)
        return self._owners[i]

    def owner_bounded(self, key: int, loads: Mapping[WorkerId, float], c: float = 1.25) -> WorkerId | None:
        """The first worker clockwise whose load (with this request) stays under ``c`` x mean."""
        if not self._points:
            return None
        total = sum(loads.get(w, 0.0) for w in self._members) + 1.0
        bound = c * total / len(self._members)
        n = len(self._points)
        i = bisect.bisect_right(self._points, mix64(key)) % n
        seen: set[WorkerId] = set()
        for step in range(n):
            w = self._owners[(i + step) % n]
            if w in seen:
                continue
            if loads.get(w, 0.0) + 1.0 <= bound:
                return w
            seen.add(w)
            if len(seen) == len(self._members):
                break
        return self._owners[i]
