"""The prefix index: which workers hold which blocks of a prompt's prefix chain. Pure, no I/O.

Blocks are identified by *chained* hashes (:mod:`natsched.wire.blocks`, or a trace's ``hash_ids``), so a hash
stands for a whole prefix and "worker W holds the first k blocks of this request" is k dict
lookups. Two sources feed it:

- **precise claims** from the workers' cache events (``stored`` / ``removed`` / ``cleared`` /
  ``snapshot``), sequenced per worker; they hold until the worker says otherwise;
- **approximate claims** from the router's own decisions ("I just sent this prefix to W"), which
  bridge the time until W's event arrives, and expire after ``approx_ttl_s``.

Trust: a gap in a worker's event sequence means we missed deltas, so its claims are ignored
(the worker is *untrusted*) until a snapshot resets its view; the router's claim-accuracy
feedback can distrust a worker the same way.

Eviction log: the feedback must tell a worker whose reports are wrong from one that reported,
correctly, that it evicted a block after we routed to it (its cache churned while the request
queued). So every removal (``removed`` event, ``cleared``, snapshot, reset) is stamped with a
monotonic *mark*; :meth:`PrefixIndex.mark` taken at routing time and
:meth:`PrefixIndex.removed_since` at completion answer "did the worker say it dropped this block
since then?". The log is a bounded LRU of ``removed_log_entries`` (worker, block) pairs.

Memory is bounded: entries live in one LRU (``OrderedDict``) of at most ``max_entries`` block
hashes; a chain is touched leaf-first so its shared root is the last to go. Resetting a worker
is O(1): its claims carry an *epoch* (precise) or a timestamp (approximate) and stale ones are
simply not counted, then disappear with LRU eviction or :meth:`PrefixIndex.expire`.

Encoding of a claim (one float per worker per block, to keep the hot path to one dict get):
``-(epoch + 1)`` for a precise claim, the routing time (>= 0) for an approximate one.

Tiers: blocks a worker reports in its *host* tier (``CacheEvent.tier = "host"``: CPU offloading,
LMCache) are kept apart, in a second LRU of the same bound with their own epoch per worker (a
host snapshot replaces only them; a GPU snapshot or a reset voids both). :meth:`PrefixIndex.match`
answers for the GPU tier as before; :meth:`PrefixIndex.match_host` says how far a worker's host
tier continues a prefix past its GPU match, which the cost model prices at the transfer time
(:meth:`natsched.router.costmodel.CostModel.host_load_s`) instead of a recompute.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from natsched.wire.schema import CacheEvent, WorkerId
from natsched.wire.ids import BlockHash
from natsched.router.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class IndexSettings:
    max_entries: int = 250_000  # block hashes kept (~300 B each with a few claims)
    approx_ttl_s: float = 120.0  # life of a claim made by our own routing decision
    min_prefix_blocks: int = 2  # shorter matches / chains are not worth indexing
    snapshot_retry_s: float = 5.0  # while untrusted, ask for a snapshot at most this often
    removed_log_entries: int = 65_536  # (worker, block) removals remembered for the feedback

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.approx_ttl_s <= 0 or self.min_prefix_blocks < 1 or self.removed_log_entries < 1:
            raise ConfigError("index: max_entries, approx_ttl_s, min_prefix_blocks, removed_log_entries must be positive")


def _claim_chain(entries: OrderedDict, hashes: Sequence[int], w: WorkerId, claim: float,
                 keep: float | None = None) -> None:
    """Set ``w``'s claim on every block of a chain, leaf first: the shared root ends most recently
    used. A claim equal to ``keep`` (a stronger one) is left as it is."""
    for h in reversed(hashes):
        claims = entries.get(h)
        if claims is None:
            entries[h] = {w: claim}
        else:
            entries.move_to_end(h)
            if keep is None or claims.get(w) != keep:
                claims[w] = claim


class PrefixIndex:
    """Block hash -> {worker: claim}; answers "how many leading blocks does each worker hold"."""

    def __init__(self, settings: IndexSettings | None = None) -> None:
        self.settings = settings or IndexSettings()
        self._entries: OrderedDict[BlockHash, dict[WorkerId, float]] = OrderedDict()
        self._epoch: dict[WorkerId, int] = {}  # precise claims of older epochs are void
        self._approx_after: dict[WorkerId, float] = {}  # approximate claims before this are void
        self._seq: dict[WorkerId, int] = {}  # last cache-event seq applied
        self._ts: dict[WorkerId, float] = {}  # its timestamp (worker clock)
        self._untrusted: set[WorkerId] = set()
        self._asked: dict[WorkerId, float] = {}  # last time we asked for a snapshot
        self._mark = 0  # bumped by every removal, see "Eviction log"
        self._removed: OrderedDict[tuple[WorkerId, BlockHash], int] = OrderedDict()
        self._reset_mark: dict[WorkerId, int] = {}  # mark of the worker's last wholesale reset
        self._host: OrderedDict[BlockHash, dict[WorkerId, int]] = OrderedDict()  # host tier: block -> epochs
        self._host_epoch: dict[WorkerId, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ cache events

    def apply(self, ev: CacheEvent, now: float) -> bool:
        """Apply one worker cache event; False means "ask this worker for a snapshot now".

        Duplicates (seq already applied) are ignored: JetStream may redeliver. A ``seq`` of 1
        after a higher one, stamped *later* (worker clock) than the last applied event, means the
        worker restarted its stream with an empty cache; stamped earlier, it is a redelivery.
        """
        w = ev.worker
        if ev.kind == "snapshot" and ev.tier != "host":
            self._reset_claims(w, now)
            self._store(w, ev.hashes)
            self._seq[w] = ev.seq
            self._ts[w] = ev.ts
            if w in self._untrusted:
                self._untrusted.discard(w)
                log.info("index: worker %s trusted again (snapshot seq %d, %d blocks)", w, ev.seq, len(ev.hashes))
            return True
        last = self._seq.get(w)
        if last is not None and ev.seq <= last:
            if not (ev.seq == 1 and last > 1 and ev.ts > self._ts.get(w, ev.ts)):
                return True  # duplicate
            log.info("index: worker %s restarted its cache events (seq 1 after %d)", w, last)
            self.reset_worker(w, now)
        elif ev.seq != (last or 0) + 1:
            self._mark_untrusted(w, f"seq gap: expected {(last or 0) + 1}, got {ev.seq}")
        self._seq[w] = ev.seq
        self._ts[w] = ev.ts
        if ev.tier == "host":
            self._apply_host(w, ev)
        else:
            self._apply_delta(w, ev, now)
        return not self.needs_snapshot(w, now)

    def _apply_host(self, w: WorkerId, ev: CacheEvent) -> None:
        """A host-tier delta: its own claims, no effect on the GPU tier's."""
        host = self._host
        if ev.kind in ("snapshot", "cleared"):
            self._host_epoch[w] = self._host_epoch.get(w, 0) + 1
        if ev.kind in ("snapshot", "stored"):
            _claim_chain(host, ev.hashes, w, self._host_epoch.get(w, 0))
            while len(host) > self.settings.max_entries:
                host.popitem(last=False)
        elif ev.kind == "removed":
            for h in ev.hashes:
                claims = host.get(h)
                if claims is not None and claims.pop(w, None) is not None and not claims:
                    del host[h]

    def _apply_delta(self, w: WorkerId, ev: CacheEvent, now: float) -> None:
        if ev.kind == "stored":
            self._store(w, ev.hashes)
        elif ev.kind == "removed":
            entries = self._entries
            self._mark += 1
            mark, log_ = self._mark, self._removed
            for h in ev.hashes:
                claims = entries.get(h)
                if claims is not None and claims.pop(w, None) is not None and not claims:
                    del entries[h]
                key = (w, h)
                log_[key] = mark
                log_.move_to_end(key)
            while len(log_) > self.settings.removed_log_entries:
                log_.popitem(last=False)
        elif ev.kind == "cleared":
            self._reset_claims(w, now)
        else:
            log.warning("index: worker %s sent unknown cache event kind %r (ignored)", w, ev.kind)

    def _store(self, w: WorkerId, hashes: Sequence[int]) -> None:
        _claim_chain(self._entries, hashes, w, -(self._epoch.get(w, 0) + 1))
        self._trim()

    # ------------------------------------------------------------------ routing decisions

    def record_route(self, hashes: Sequence[int], w: WorkerId, now: float) -> None:
        """Remember that ``w`` was just sent this chain (an approximate claim with a TTL)."""
        if len(hashes) < self.settings.min_prefix_blocks:
            return
        if now < 0:
            raise ConfigError("router time must be >= 0 (approximate claims are timestamps)")
        # a precise claim is stronger: keep it
        _claim_chain(self._entries, hashes, w, now, keep=-(self._epoch.get(w, 0) + 1))
        self._trim()

    def _trim(self) -> None:
        entries, limit = self._entries, self.settings.max_entries
        while len(entries) > limit:
            entries.popitem(last=False)

    # ------------------------------------------------------------------ lookups

    def _validity(self, w: WorkerId, now: float) -> tuple[float, float]:
        """(precise claim value, oldest valid approximate time) for ``w`` now."""
        floor = now - self.settings.approx_ttl_s
        after = self._approx_after.get(w, 0.0)
        if after > floor:
            floor = after
        return -(self._epoch.get(w, 0) + 1), (floor if floor > 0.0 else 0.0)

    def match(self, hashes: Sequence[int], now: float, workers: Iterable[WorkerId]) -> dict[WorkerId, int]:
        """Leading blocks of ``hashes`` held by each trusted worker of ``workers``.

        Workers holding fewer than ``min_prefix_blocks`` are left out of the answer.
        """
        untrusted = self._untrusted
        alive = [(w, *self._validity(w, now)) for w in workers if w not in untrusted]
        counts: dict[WorkerId, int] = {}
        get = self._entries.get
        depth = 0
        for h in hashes:
            claims = get(h)
            if claims is None:
                break
            # a claim is valid when it is this epoch's precise one or a fresh enough routing time
            nxt = [t for t in alive if (v := claims.get(t[0])) is not None and (v >= t[2] or v == t[1])]
            if len(nxt) != len(alive):
                for t in alive:
                    if t not in nxt:
                        counts[t[0]] = depth
                alive = nxt
                if not alive:
                    break
            depth += 1
        for t in alive:
            counts[t[0]] = depth
        least = self.settings.min_prefix_blocks
        return {w: n for w, n in counts.items() if n >= least}

    @property
    def has_host(self) -> bool:
        """Whether any worker reported a host tier (policies skip the lookup otherwise)."""
        return bool(self._host)

    def match_host(self, hashes: Sequence[int], w: WorkerId, start: int) -> int:
        """Blocks of ``hashes`` after the first ``start`` that trusted ``w`` holds in its host tier."""
        if w in self._untrusted or not self._host:
            return 0
        epoch = self._host_epoch.get(w, 0)
        host = self._host
        n = 0
        for h in hashes[start:]:
            claims = host.get(h)
            if claims is None or claims.get(w) != epoch:
                break
            n += 1
        return n

    def match_one(self, hashes: Sequence[int], w: WorkerId, now: float, precise: bool = False) -> int:
        """Leading blocks of ``hashes`` that trusted worker ``w`` holds (0 if untrusted/short).

        ``precise=True`` counts only what the worker itself reported (cache events), not our own
        routing decisions: the part of a prediction the worker can be held to.
        """
        if w in self._untrusted:
            return 0
        pe, fl = self._validity(w, now)
        if precise:
            fl = float("inf")
        entries = self._entries
        depth = 0
        for h in hashes:
            claims = entries.get(h)
            v = claims.get(w) if claims is not None else None
            if v is None or not (v == pe or v >= fl):
                break
            depth += 1
        return depth if depth >= self.settings.min_prefix_blocks else 0

    # ------------------------------------------------------------------ eviction log

    def mark(self) -> int:
        """The current removal mark: pass it to :meth:`removed_since` later."""
        return self._mark

    def removed_since(self, w: WorkerId, h: BlockHash, mark: int) -> bool:
        """Did ``w`` report dropping block ``h`` (or its whole cache) after ``mark`` was taken?

        Also True when the log no longer remembers that far back (benefit of the doubt).
        """
        if self._reset_mark.get(w, -1) > mark or self._removed.get((w, h), -1) > mark:
            return True
        if len(self._removed) >= self.settings.removed_log_entries:  # entries were dropped:
            return next(iter(self._removed.values())) > mark  # some may have been after ``mark``
        return False

    # ------------------------------------------------------------------ worker lifecycle

    def reset_worker(self, w: WorkerId, now: float) -> None:
        """Forget everything ``w`` held and expect its events from seq 1 (fresh, empty cache)."""
        self._reset_claims(w, now)
        self._seq[w] = 0
        self._untrusted.discard(w)
        self._asked.pop(w, None)

    def forget_worker(self, w: WorkerId, now: float) -> None:
        """Drop a worker that left for good (its stale claims age out of the LRU)."""
        self._reset_claims(w, now)
        self._seq.pop(w, None)
        self._ts.pop(w, None)
        self._untrusted.discard(w)
        self._asked.pop(w, None)

    def _reset_claims(self, w: WorkerId, now: float) -> None:
        self._epoch[w] = self._epoch.get(w, 0) + 1
        self._host_epoch[w] = self._host_epoch.get(w, 0) + 1
        self._approx_after[w] = now
        self._mark += 1
        self._reset_mark[w] = self._mark

    def distrust(self, w: WorkerId, reason: str) -> bool:
        """Ignore ``w``'s claims until its next snapshot; True if it was trusted until now."""
        if w in self._untrusted:
            return False
        self._mark_untrusted(w, reason)
        return True

    def _mark_untrusted(self, w: WorkerId, reason: str) -> None:
        if w not in self._untrusted:
            log.warning("index: worker %s untrusted until snapshot (%s)", w, reason)
        self._untrusted.add(w)

    def is_trusted(self, w: WorkerId) -> bool:
        return w not in self._untrusted

    def last_seq(self, w: WorkerId) -> int:
        return self._seq.get(w, 0)

    def has_seen(self, w: WorkerId) -> bool:
        """Whether any cache event (or snapshot) of ``w`` reached this index."""
        return w in self._seq

    def is_fresh(self, w: WorkerId, kv_seq: int) -> bool:
        """Trusted and caught up with the sequence number the worker's heartbeat announced."""
        return w not in self._untrusted and self._seq.get(w, 0) >= kv_seq

    def needs_snapshot(self, w: WorkerId, now: float) -> bool:
        """True (at most every ``snapshot_retry_s``) while ``w`` is untrusted; records the ask."""
        if w not in self._untrusted:
            return False
        last = self._asked.get(w)
        if last is not None and now - last < self.settings.snapshot_retry_s:
            return False
        self._asked[w] = now
        return True

    def untrusted(self) -> set[WorkerId]:
        return set(self._untrusted)

    # ------------------------------------------------------------------ housekeeping

    def expire(self, now: float, budget: int = 4096) -> int:
        """Drop up to ``budget`` least-recently-used entries that hold no valid claim any more.

        Stops at the first entry that is still valid: the LRU front is the oldest, so this
        reclaims memory of expired approximate claims without scanning the whole index.
        """
        entries = self._entries
        dropped = 0
        cache: dict[WorkerId, tuple[float, float]] = {}
        while entries and dropped < budget:
            h, claims = next(iter(entries.items()))
            for w, v in claims.items():
                pe, fl = cache.get(w) or cache.setdefault(w, self._validity(w, now))
                if v == pe or v >= fl:
                    return dropped
            del entries[h]
            dropped += 1
        return dropped

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "untrusted": len(self._untrusted), "workers": len(self._seq),
                "removed_log": len(self._removed), "host_entries": len(self._host)}
