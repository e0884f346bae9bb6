"""The in-flight state every admitter replica shares, kept in the ``inflight`` KV bucket.

- ``usage``: the aggregate (:class:`~admitter.usage.Usage`), changed only by compare-and-swap:
  a replica decides against the value at revision *r* and writes with ``last=r``; if another
  replica wrote first, it re-reads and decides again. Nothing is ever admitted against a
  stale total, so over-admission is zero.
- ``res.<request_id>``: one record per reservation (tenant, model, tokens, time, replica). A
  release deletes it conditioned on its revision first, so a completion seen twice (or by two
  replicas) frees its tokens once.

Every replica mirrors the bucket through a watch, which gives it the current ``usage`` and
revision without a read per decision, and the reservations for leases and reconciliation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import orjson

from admitter.errors import AdmitterError
from admitter.usage import Usage
from bus import subjects as S
from bus.connection import Bus
from bus.errors import ConflictError

log = logging.getLogger(__name__)

T = TypeVar("T")
USAGE = S.KEY_USAGE
RES_PREFIX = "res."


@dataclass
class Reservation:
    request_id: str
    tenant: str
    model: str
    tokens: int
    ts: float
    by: str
    revision: int = 0

    def to_json(self) -> bytes:
        return orjson.dumps({"tenant": self.tenant, "model": self.model, "tokens": self.tokens, "ts": self.ts,
                             "by": self.by})

    @classmethod
    def from_json(cls, request_id: str, raw: bytes, revision: int) -> "Reservation":
        d = orjson.loads(raw)
        return cls(request_id, str(d["tenant"]), str(d.get("model", "default")), int(d["tokens"]), float(d["ts"]),
                   str(d.get("by", "")), revision)


class SharedState:
    """The replica's mirror of ``inflight`` plus the CAS operations that change it."""

    def __init__(self, bus: Bus, name: str, max_attempts: int = 200) -> None:
        self.bus = bus
        self.name = name
        self.max_attempts = max_attempts
        self.usage = Usage()
        self.revision = 0  # of the usage key; 0 = it does not exist yet
        self.reservations: dict[str, Reservation] = {}
        self.conflicts = 0
        self.ready = asyncio.Event()

    async def start(self) -> None:
        self.bus.spawn(self._mirror(), "inflight-mirror")
        await asyncio.wait_for(self.ready.wait(), 10)

    async def _mirror(self) -> None:
        async for key, value, rev in self.bus.kv_watch(S.BUCKET_INFLIGHT, ">", ready=self.ready):
            try:
                self._apply(key, value, rev)
            except (AdmitterError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:  # UsageError too
                log.error("ignoring corrupted inflight entry %s: %s", key, exc)

    def _apply(self, key: str, value: bytes | None, rev: int) -> None:
        if key == USAGE:
            if rev >= self.revision:
                self.usage = Usage() if value is None else Usage.from_json(value)
                self.revision = rev
        elif key.startswith(RES_PREFIX):
            rid = key[len(RES_PREFIX):]
            if value is None:
                self.reservations.pop(rid, None)
            else:
                self.reservations[rid] = Reservation.from_json(rid, value, rev)

    async def refresh(self) -> None:
        """Read ``usage`` now (after a lost race the mirror may not have caught up yet)."""
        current = await self.bus.kv_get(S.BUCKET_INFLIGHT, USAGE)
        if current is None:
            self.usage, self.revision = Usage(), 0
        else:
            self.usage, self.revision = Usage.from_json(current[0]), current[1]

    async def change_usage(self, fn: Callable[[Usage], tuple[Usage | None, T]]) -> T:
        """Apply ``fn`` to the current usage and write its result by compare-and-swap.

        ``fn(usage) -> (new usage or None for "nothing to write", result)`` is re-run on the fresh
        value after every lost race, so the caller's decision always matches what was written.
        """
        for attempt in range(self.max_attempts):
            new, result = fn(self.usage)
            if new is None:
                return result
            try:
                if self.revision == 0:
                    rev = await self.bus.kv_create(S.BUCKET_INFLIGHT, USAGE, new.to_json())
                else:
                    rev = await self.bus.kv_update(S.BUCKET_INFLIGHT, USAGE, new.to_json(), self.revision)
            except ConflictError:
                self.conflicts += 1
                # jittered backoff: replicas that keep colliding spread out instead of livelocking
                await asyncio.sleep(random.uniform(0, min(0.02, 0.0005 * 2 ** min(attempt, 6))))
                await self.refresh()
                continue
            if rev > self.revision:
                self.usage, self.revision = new, rev
            return result
        raise AdmitterError(f"usage update lost {self.max_attempts} races in a row")

    async def record(self, res: Reservation) -> None:
        res.revision = await self.bus.kv_put(S.BUCKET_INFLIGHT, S.reservation_key(res.request_id), res.to_json())
        self.reservations[res.request_id] = res

    async def take(self, request_id: str) -> Reservation | None:
        """Delete a reservation once: the caller that wins frees its tokens, everyone else gets None."""
        key = S.reservation_key(request_id)
        res = self.reservations.get(request_id)
        if res is None or not res.revision:  # not mirrored yet: read it (one more round trip)
            current = await self.bus.kv_get(S.BUCKET_INFLIGHT, key)
            if current is None:
                self.reservations.pop(request_id, None)
                return None
            res = Reservation.from_json(request_id, current[0], current[1])
        try:
            await self.bus.kv_delete(S.BUCKET_INFLIGHT, key, last=res.revision)
        except ConflictError:
            return None  # deleted (or rewritten) by someone else first
        self.reservations.pop(request_id, None)
        return res

    def drift(self, is_long: Callable[[int], bool]) -> Usage:
        """What the aggregate should be according to the reservation records."""
        expected = Usage()
        for res in self.reservations.values():
            expected = expected.plus(res.tenant, res.model, res.tokens, is_long(res.tokens))
        return expected

    def age(self, request_id: str, now: float | None = None) -> float:
        res = self.reservations.get(request_id)
        return ((now or time.time()) - res.ts) if res else 0.0
