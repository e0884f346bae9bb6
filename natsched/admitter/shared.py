"""The in-flight state every admitter replica shares, kept in the ``inflight`` KV bucket.

- ``usage``: the aggregate (:class:`~natsched.admitter.usage.Usage`), changed only by compare-and-swap:
  a replica decides against the value at revision *r* and writes with ``last=r``; if another
  replica wrote first, it re-reads and decides again. Nothing is ever admitted against a
  stale total, so over-admission is zero.
- ``res.<request_id>``: one record per reservation (tenant, model, tokens, time, replica). A
  release deletes it conditioned on its revision first, so a completion seen twice (or by two
  replicas) frees its tokens once.

Every replica mirrors the ``usage`` key through a watch, which gives it the current value and
revision without a read per decision. It does **not** mirror the reservation records: a watch on
``res.>`` hands every replica (and the offline runner) each record twice — its put and its purge —
which cost more CPU than the admission itself (the pipeline benchmark: 0.19 ms per request in
an offline runner that admitted nothing). A replica remembers the records it wrote (a release
of its own request deletes without a read), reads one record when it needs it (a redelivered
request, a release of another replica's reservation, a rescue), and reads them all at once
(:meth:`SharedState.snapshot`) for the periodic reconciliation, which also forgets the ones
another replica released.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import orjson

from natsched.admitter.errors import AdmitterError, UsageError
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.bus.errors import ConflictError

log = logging.getLogger(__name__)

T = TypeVar("T")
USAGE = S.KEY_USAGE
RES_PREFIX = "res."
#: how long a released reservation's tombstone is kept: longer than the ack wait after which a
#: request copy whose ack was lost comes back (the tombstone marks it finished: it is not run
#: twice), short enough that the bucket holds about rate x 60 markers, not one per request ever
#: admitted (a soak at 500/s held 150k with 300 s).
MARKER_TTL_S = 60
SNAPSHOT_MARGIN_S = 5.0  # a remembered record this much older than a snapshot was stored before it
TAKE_ATTEMPTS = 20  # a release that keeps meeting a newer revision (see SharedState.take)


@dataclass
class Reservation:
    request_id: str
    tenant: str
    model: str
    tokens: int
    ts: float
    by: str
    revision: int = 0
    moved_from: str = ""  # the dead worker it was rescued from (its tokens stay reserved)
    credit: str = ""  # the epoch of ``by``'s credit block it was paid from ("": reserved on its own)

    def to_json(self) -> bytes:
        record = {"tenant": self.tenant, "model": self.model, "tokens": self.tokens, "ts": self.ts, "by": self.by}
        if self.moved_from:
            record["moved_from"] = self.moved_from
        if self.credit:
            record["credit"] = self.credit
        return orjson.dumps(record)

    @classmethod
    def from_json(cls, request_id: str, raw: bytes, revision: int) -> "Reservation":
        d = orjson.loads(raw)
        return cls(request_id, str(d["tenant"]), str(d.get("model", "default")), int(d["tokens"]), float(d["ts"]),
                   str(d.get("by", "")), revision, str(d.get("moved_from", "")), str(d.get("credit", "")))


class SharedState:
    """The replica's mirror of ``inflight`` plus the CAS operations that change it."""

    def __init__(self, bus: Bus, name: str, max_attempts: int = 200, remember: bool = True,
                 watch: bool = True) -> None:
        self.bus = bus
        self.name = name
        self.max_attempts = max_attempts
        self.usage = Usage()
        self.revision = 0  # of the usage key; 0 = it does not exist yet
        #: records this replica wrote or read and has not seen released; not every record of the
        #: bucket (see the module docstring). ``remember=False``: not even those (a writer whose
        #: records others release, like the offline runner, would only accumulate them)
        self.reservations: dict[str, Reservation] = {}
        self.remember = remember
        #: ``watch=False``: no mirror of ``usage`` either; the caller reads it (:meth:`refresh`)
        #: before it decides — for a writer that decides a few times a second, not per request
        self.watch = watch
        self.conflicts = 0
        #: revision of a ``usage`` value that cannot be decoded, until a write replaces it (0: none)
        self.corrupted = 0
        self.ready = asyncio.Event()

    async def start(self) -> None:
        if not self.watch:
            await self.refresh()
            self.ready.set()
            return
        self.bus.spawn(self._mirror(), "inflight-mirror")
        await asyncio.wait_for(self.ready.wait(), 10)

    async def _mirror(self) -> None:
        async for key, value, rev in self.bus.kv(S.BUCKET_INFLIGHT).watch(USAGE, ready=self.ready):
            try:
                self._apply(key, value, rev)
            except (AdmitterError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:  # UsageError too
                log.error("ignoring corrupted inflight entry %s: %s", key, exc)

    def _apply(self, key: str, value: bytes | None, rev: int) -> None:
        if key == USAGE and rev >= self.revision:
            self._adopt(value, rev)

    def _adopt(self, value: bytes | None, rev: int) -> None:
        """Take the usage at ``rev``. One that cannot be decoded keeps the last good value but
        takes its revision, so the next compare-and-swap replaces it: refusing it instead made
        every later commit lose its race, re-read it and fail, and the admitter stopped admitting.
        What the lost value held that the last good one does not, reconciliation rebuilds from
        the reservation records (it repairs at once while ``corrupted`` is set)."""
        try:
            usage = Usage() if value is None else Usage.from_json(value)
        except UsageError as exc:
            if self.corrupted != rev:
                log.error("shared usage at revision %d cannot be decoded (%s): deciding on the last good "
                          "value until it is overwritten", rev, exc)
            self.corrupted, self.revision = rev, rev
            return
        self.usage, self.revision, self.corrupted = usage, rev, 0

    async def refresh(self) -> None:
        """Read ``usage`` now (after a lost race the mirror may not have caught up yet)."""
        current = await self.bus.kv(S.BUCKET_INFLIGHT).get(USAGE)
        if current is None:
            self.usage, self.revision, self.corrupted = Usage(), 0, 0
        else:
            self._adopt(*current)

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
                    rev = await self.bus.kv(S.BUCKET_INFLIGHT).create(USAGE, new.to_json())
                else:
                    rev = await self.bus.kv(S.BUCKET_INFLIGHT).update(USAGE, new.to_json(), self.revision)
            except ConflictError:
                self.conflicts += 1
                # jittered backoff: replicas that keep colliding spread out instead of livelocking
                await asyncio.sleep(random.uniform(0, min(0.02, 0.0005 * 2 ** min(attempt, 6))))
                await self.refresh()
                continue
            if rev > self.revision:
                self.usage, self.revision, self.corrupted = new, rev, 0
            return result
        raise AdmitterError(f"usage update lost {self.max_attempts} races in a row")

    async def record(self, res: Reservation) -> None:
        self.recorded(res, await self.bus.kv(S.BUCKET_INFLIGHT).put(S.reservation_key(res.request_id), res.to_json()))

    def outgoing(self, res: Reservation) -> tuple[str, bytes, None, None]:
        """The record as a message for :meth:`natsched.bus.connection.Bus.jpublish_batch` (a KV put is a
        publish on the key's subject); :meth:`recorded` takes its ack's sequence = revision."""
        return S.kv_subject(S.BUCKET_INFLIGHT, S.reservation_key(res.request_id)), res.to_json(), None, None

    def recorded(self, res: Reservation, revision: int) -> None:
        res.revision = revision
        if self.remember:
            self.reservations[res.request_id] = res

    def forget_older_than(self, age_s: float, now: float | None = None) -> None:
        """Drop remembered records written more than ``age_s`` ago (they stay in the bucket)."""
        cutoff = (time.time() if now is None else now) - age_s
        for rid in [rid for rid, res in self.reservations.items() if res.ts < cutoff]:
            del self.reservations[rid]

    async def lookup(self, request_id: str) -> Reservation | None:
        """The reservation of a request as stored now (one read), or None."""
        return await self._read(request_id)

    async def snapshot(self) -> dict[str, Reservation]:
        """Every reservation in the bucket now (one pass over the last value of each key).

        What this replica remembered and is no longer stored was released elsewhere (a
        completion handled by another replica): it is forgotten here, so the memory stays bounded.
        """
        started = time.time()
        raw = await self.bus.kv(S.BUCKET_INFLIGHT).snapshot(RES_PREFIX + ">")
        records = {}
        for key, (value, rev) in raw.items():
            rid = key[len(RES_PREFIX):]
            try:
                records[rid] = Reservation.from_json(rid, value, rev)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                log.error("ignoring corrupted reservation %s: %s", key, exc)
        for rid in [rid for rid in self.reservations if rid not in records]:
            if self.reservations[rid].ts < started - SNAPSHOT_MARGIN_S:  # (one written meanwhile is kept)
                del self.reservations[rid]
        return records

    async def take(self, request_id: str) -> Reservation | None:
        """Delete a reservation once: the caller that wins frees its tokens, everyone else gets None.

        A record rewritten since the mirror saw it (a rescue marked it moved) is still the same
        reservation: the delete is retried once against the revision read back.
        """
        key = S.reservation_key(request_id)
        res = self.reservations.get(request_id)
        for attempt in range(TAKE_ATTEMPTS):
            if res is None or not res.revision:  # not mirrored yet: read it (one more round trip)
                res = await self._read(request_id)
                if res is None:
                    return None  # gone: someone else freed it
            try:
                await self.bus.kv(S.BUCKET_INFLIGHT).delete(key, last=res.revision, marker_ttl_s=MARKER_TTL_S)
            except ConflictError:
                # rewritten, or a read answered by a cluster follower that is behind: read again
                # until it is gone or ours; giving up would leave it reserved (and its request
                # looking unfinished to a rescue)
                res = None
                await asyncio.sleep(min(0.2, 0.005 * 2 ** attempt))
                continue
            self.reservations.pop(request_id, None)
            return res
        raise AdmitterError(f"reservation {request_id}: still changing after {TAKE_ATTEMPTS} attempts to free it")

    async def mark_moved(self, request_id: str, worker: str) -> Reservation | None:
        """Note on its record that a reservation's request was rescued from dead ``worker``.

        Returns the marked record, or None when it no longer exists: the request's completion
        (or a release) came first, so there is nothing to run again. A record another replica
        marked already is returned as it is (its rescue is the same, deduplicated, rescue).
        """
        for _ in range(self.max_attempts):
            res = await self._read(request_id)
            if res is None or res.moved_from == worker:
                return res
            res.moved_from = worker
            try:
                res.revision = await self.bus.kv(S.BUCKET_INFLIGHT).update(S.reservation_key(request_id),
                                                        res.to_json(), res.revision)
            except ConflictError:
                continue
            self.reservations[request_id] = res
            return res
        raise AdmitterError(f"reservation {request_id}: lost {self.max_attempts} races marking it moved")

    async def _read(self, request_id: str) -> Reservation | None:
        current = await self.bus.kv(S.BUCKET_INFLIGHT).get(S.reservation_key(request_id))
        if current is None:
            self.reservations.pop(request_id, None)
            return None
        return Reservation.from_json(request_id, current[0], current[1])

    @staticmethod
    def drift(records: dict[str, Reservation], is_long: Callable[[int], bool], usage: Usage | None = None) -> Usage:
        """What the aggregate should be according to the reservation records and the credit
        entries of ``usage``: every block, plus every record not paid from a block that still
        exists (those are inside their block)."""
        credits = usage.credits if usage is not None else {}
        expected = Usage(credits=credits)
        for res in records.values():
            if res.credit and res.by in credits and credits[res.by].epoch == res.credit:
                continue
            expected = expected.plus(res.tenant, res.model, res.tokens, is_long(res.tokens))
        for entry in credits.values():
            for (tenant, model), tokens in entry.blocks.items():
                expected = expected.plus(tenant, model, tokens)
        return expected
