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
from natsched.bus.connection import CREATE_ONLY, Bus
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
    attempt: int = 0  # the attempt whose completion may release it (a rescue moves it on: fencing)
    ceiling: int = 0  # what it may grow to (prefill + max_tokens of KV); 0: it is at its ceiling
    cls: str = ""  # the class its tokens are counted in ("": none; natsched.admitter.classes)

    def to_json(self) -> bytes:
        record = {"tenant": self.tenant, "model": self.model, "tokens": self.tokens, "ts": self.ts, "by": self.by}
        if self.moved_from:
            record["moved_from"] = self.moved_from
        if self.attempt:
            record["attempt"] = self.attempt
        if self.ceiling > self.tokens:
            record["ceiling"] = self.ceiling
        if self.credit:
            record["credit"] = self.credit
        if self.cls:
            record["cls"] = self.cls
        return orjson.dumps(record)

    @classmethod
    def from_json(cls, request_id: str, raw: bytes, revision: int) -> "Reservation":
        """Decode strictly (:class:`UsageError` for anything an admitter did not write): a record
        with a field missing is not read as a reservation of 0 tokens of model "default"."""
        try:
            d = orjson.loads(raw)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise UsageError(f"reservation {request_id} is not JSON: {exc}") from None
        if not isinstance(d, dict) or set(d) - RECORD_FIELDS or not RECORD_REQUIRED <= set(d):
            raise UsageError(f"reservation {request_id} is not one an admitter wrote: {bytes(raw[:80])!r}")
        tokens, ts, attempt, ceiling = d["tokens"], d["ts"], d.get("attempt", 0), d.get("ceiling", 0)
        counts = {"tokens", "ts", "attempt", "ceiling"}
        if (not all(map(_is_count, (tokens, attempt, ceiling))) or isinstance(ts, bool) or not isinstance(ts, (int, float))
                or not all(isinstance(d.get(k, ""), str) for k in RECORD_FIELDS - counts)):
            raise UsageError(f"reservation {request_id} has a field of the wrong type: {bytes(raw[:80])!r}")
        if d.get("cls", "") not in ("", *S.CLASSES):
            raise UsageError(f"reservation {request_id} names an unknown class: {bytes(raw[:80])!r}")
        return cls(request_id, d["tenant"], d["model"], tokens, float(ts), d["by"], revision,
                   d.get("moved_from", ""), d.get("credit", ""), attempt, ceiling, d.get("cls", ""))


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: the fields of a reservation record (:meth:`Reservation.to_json`), and those always written
RECORD_FIELDS = frozenset({"tenant", "model", "tokens", "ts", "by", "moved_from", "credit", "attempt", "ceiling",
                           "cls"})
RECORD_REQUIRED = frozenset({"tenant", "model", "tokens", "ts", "by"})


class SharedState:
    """The replica's mirror of ``inflight`` plus the CAS operations that change it."""

    def __init__(self, bus: Bus, name: str, max_attempts: int = 200, remember: bool = True,
                 watch: bool = True, bucket: str = S.BUCKET_INFLIGHT) -> None:
        self.bus = bus
        self.name = name
        #: ``inflight``, or with partitioned admission the partition's own ``inflight-p<k>``
        #: (its usage key and its requests' records: natsched.admitter.partition)
        self.bucket = bucket
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
        #: values of the bucket refused as not written by an admitter (a usage revision counts
        #: once), and how many times the usage was rebuilt from the records because of one
        self.refused = 0
        self.rebuilt = 0
        self.stale = 0  # completions of an attempt since rescued, refused by take()
        #: set by the service: whether a reservation of n tokens is a long one (the rebuild
        #: counts ``long`` like the reconciliation), and the reservations taken (deleted) whose
        #: release is not yet in the usage (a rebuild counts them: their commit subtracts them)
        self.is_long: Callable[[int], bool] = lambda tokens: False
        self.pending: Callable[[], list[Reservation]] = lambda: []
        self._bad_records: dict[str, int] = {}  # key -> revision refused (logged once)
        self.ready = asyncio.Event()

    async def start(self) -> None:
        if not self.watch:
            await self.refresh()
            self.ready.set()
            return
        self.bus.spawn(self._mirror(), "inflight-mirror")
        await asyncio.wait_for(self.ready.wait(), 10)

    async def _mirror(self) -> None:
        async for key, value, rev in self.bus.kv(self.bucket).watch(USAGE, ready=self.ready):
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
                self.refused += 1
                log.error("shared usage at revision %d refused (%s): it is rebuilt from the reservation "
                          "records before the next decision is committed", rev, exc)
            self.corrupted, self.revision = rev, rev
            return
        self.usage, self.revision, self.corrupted = usage, rev, 0

    async def refresh(self) -> None:
        """Read ``usage`` now (after a lost race the mirror may not have caught up yet)."""
        current = await self.bus.kv(self.bucket).get(USAGE)
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
            if self.corrupted:  # never decide on a value that is not what the admitters wrote
                await self.rebuild()
            new, result = fn(self.usage)
            if new is None:
                return result
            try:
                if self.revision == 0:
                    rev = await self.bus.kv(self.bucket).create(USAGE, new.to_json())
                else:
                    rev = await self.bus.kv(self.bucket).update(USAGE, new.to_json(), self.revision)
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

    async def rebuild(self) -> None:
        """Replace a refused usage with what the reservation records imply (every record, plus
        the releases taken but not yet committed: their commit subtracts them), keeping the last
        good value's credit entries. Lost to a newer write: that one is read instead."""
        records = await self.snapshot()
        for res in self.pending():
            records.setdefault(res.request_id, res)
        expected = self.drift(records, self.is_long, Usage(credits=self.usage.credits, loans=self.usage.loans))
        try:
            rev = await self.bus.kv(self.bucket).update(USAGE, expected.to_json(), self.corrupted)
        except ConflictError:
            await self.refresh()
            return
        self.usage, self.revision, self.corrupted = expected, rev, 0
        self.rebuilt += 1
        log.warning("shared usage rebuilt from %d reservation records: %d runtime tokens in flight",
                    len(records), expected.used)

    async def record(self, res: Reservation) -> None:
        self.recorded(res, await self.bus.kv(self.bucket).put(S.reservation_key(res.request_id), res.to_json()))

    def outgoing(self, res: Reservation) -> tuple[str, bytes, None, None]:
        """The record as a message for :meth:`natsched.bus.connection.Bus.jpublish_batch` (a KV put is a
        publish on the key's subject); :meth:`recorded` takes its ack's sequence = revision. A
        create: a request id already reserved (published again under another msg id, or still
        marked released) gets a None ack, and is not reserved twice."""
        return S.kv_subject(self.bucket, S.reservation_key(res.request_id)), res.to_json(), None, CREATE_ONLY

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
        raw = await self.bus.kv(self.bucket).snapshot(RES_PREFIX + ">")
        records = {}
        for key, (value, rev) in raw.items():
            rid = key[len(RES_PREFIX):]
            try:
                records[rid] = Reservation.from_json(rid, value, rev)
            except UsageError as exc:
                if self._bad_records.get(key) != rev:  # logged and counted once per value
                    self._bad_records[key] = rev
                    self.refused += 1
                    log.error("reservation record refused: %s", exc)
        for rid in [rid for rid in self.reservations if rid not in records]:
            if self.reservations[rid].ts < started - SNAPSHOT_MARGIN_S:  # (one written meanwhile is kept)
                del self.reservations[rid]
        return records

    async def take(self, request_id: str, attempt: int | None = None) -> Reservation | None:
        """Delete a reservation once: the caller that wins frees its tokens, everyone else gets None.

        ``attempt``: only a completion of the reservation's current attempt may free it; one of
        an attempt since rescued (its old worker was only paused) is stale: counted in
        ``stale``, None, and the reservation stays for the attempt that runs now.

        A record rewritten since the mirror saw it (a rescue marked it moved) is still the same
        reservation: the delete is retried once against the revision read back.
        """
        key = S.reservation_key(request_id)
        res = self.reservations.get(request_id)
        fresh = False
        for attempt_no in range(TAKE_ATTEMPTS):
            if res is None or not res.revision:  # not mirrored yet: read it (one more round trip)
                res, fresh = await self._read(request_id), True
                if res is None:
                    return None  # gone: someone else freed it
            if attempt is not None and res.attempt != attempt:
                if not fresh:  # remembered before a rescue moved it on: look again
                    res = None
                    continue
                self.stale += 1
                log.warning("completion of request %s attempt %d refused: the reservation is attempt %d's",
                            request_id, attempt, res.attempt)
                return None
            try:
                await self.bus.kv(self.bucket).delete(key, last=res.revision, marker_ttl_s=MARKER_TTL_S)
            except ConflictError:
                # rewritten, or a read answered by a cluster follower that is behind: read again
                # until it is gone or ours; giving up would leave it reserved (and its request
                # looking unfinished to a rescue)
                res = None
                await asyncio.sleep(min(0.2, 0.005 * 2 ** attempt_no))
                continue
            self.reservations.pop(request_id, None)
            return res
        raise AdmitterError(f"reservation {request_id}: still changing after {TAKE_ATTEMPTS} attempts to free it")

    async def regrow(self, res: Reservation, tokens: int) -> Reservation | None:
        """Rewrite ``res`` (as read, at its revision) to hold ``tokens``: the grown record, or
        None when it changed meanwhile (another replica grew it, a rescue marked it, it was
        released): the caller adds to the usage only what its own write grew."""
        grown = Reservation(res.request_id, res.tenant, res.model, tokens, res.ts, res.by, 0, res.moved_from,
                            res.credit, res.attempt, res.ceiling, res.cls)
        try:
            grown.revision = await self.bus.kv(self.bucket).update(S.reservation_key(res.request_id),
                                                                         grown.to_json(), res.revision)
        except ConflictError:
            return None
        if self.remember:
            self.reservations[res.request_id] = grown
        return grown

    async def mark_moved(self, request_id: str, worker: str, attempt: int = 0) -> Reservation | None:
        """Note on its record that a reservation's request was rescued from dead ``worker``.

        Returns the marked record, or None when it no longer exists: the request's completion
        (or a release) came first, so there is nothing to run again. A record another replica
        marked already is returned as it is (its rescue is the same, deduplicated, rescue).
        """
        for _ in range(self.max_attempts):
            res = await self._read(request_id)
            if res is None or (res.moved_from == worker and res.attempt >= attempt):
                return res
            res.moved_from, res.attempt = worker, max(res.attempt, attempt)
            try:
                res.revision = await self.bus.kv(self.bucket).update(S.reservation_key(request_id),
                                                        res.to_json(), res.revision)
            except ConflictError:
                continue
            self.reservations[request_id] = res
            return res
        raise AdmitterError(f"reservation {request_id}: lost {self.max_attempts} races marking it moved")

    async def _read(self, request_id: str) -> Reservation | None:
        current = await self.bus.kv(self.bucket).get(S.reservation_key(request_id))
        if current is None:
            self.reservations.pop(request_id, None)
            return None
        try:
            return Reservation.from_json(request_id, current[0], current[1])
        except UsageError as exc:  # not a reservation: nothing to release (the reconciliation,
            key = S.reservation_key(request_id)  # which skips it too, repairs the aggregate)
            if self._bad_records.get(key) != current[1]:
                self._bad_records[key] = current[1]
                self.refused += 1
                log.error("reservation record refused: %s", exc)
            return None

    @staticmethod
    def drift(records: dict[str, Reservation], is_long: Callable[[int], bool], usage: Usage | None = None) -> Usage:
        """What the aggregate should be according to the reservation records and the credit
        entries of ``usage``: every block, plus every record not paid from a block that still
        exists (those are inside their block), each in its class (credit-paid ones in none). The
        loans between classes are not in the records: ``usage``'s are kept, clamped to what each
        borrower holds (``natsched.admitter.classes``)."""
        credits = usage.credits if usage is not None else {}
        expected = Usage(credits=credits)
        for res in records.values():
            if res.credit and res.by in credits and credits[res.by].epoch == res.credit:
                continue
            expected = expected.plus(res.tenant, res.model, res.tokens, is_long(res.tokens),
                                     None if res.credit else (res.cls or None))
        for entry in credits.values():
            for (tenant, model), tokens in entry.blocks.items():
                expected = expected.plus(tenant, model, tokens)
        return expected.with_loans(usage.loans) if usage is not None else expected
