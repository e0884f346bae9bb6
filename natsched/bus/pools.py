"""The router pool map, kept live from bucket ``config`` key ``pools`` (``natsched.wire.pools``).

Every publisher of ADMITTED (admitter, rescue, offline runner) and every pooled router holds one
:class:`PoolWatch`: the map in force when it started, then each change. A value that is not a
pool map is logged and ignored (the map in force stays), as a bad router config is.
"""

from __future__ import annotations

import asyncio
import logging

from natsched.wire import subjects as S
from natsched.wire.pools import PoolError, PoolMap

log = logging.getLogger(__name__)

#: how long a service waits at start for the bucket's current value
READY_TIMEOUT_S = 10.0


class PoolWatch:
    def __init__(self, bus, on_change=None) -> None:
        self.bus = bus
        self.on_change = on_change  # called with each new map applied
        self.map = PoolMap()
        self.revision = 0  # of the key's value in force (0: none read yet)
        self.changed = asyncio.Event()  # set on every applied change (tests, services that re-check)

    async def start(self) -> "PoolWatch":
        """The map in force, then the watch. The watch's "current values done" marker can come
        before a value it is still delivering (nats-py's ordered consumer checks its pending
        count before the first message is handed over), so the key is also read once."""
        ready = asyncio.Event()
        self.bus.spawn(self._watch(ready), "pool-watch")
        await asyncio.wait_for(ready.wait(), READY_TIMEOUT_S)
        current = await self.bus.kv(S.BUCKET_CONFIG).get(S.KEY_POOLS)
        if current is not None:
            self.apply(current[0], current[1])
        return self

    def apply(self, raw: bytes | None, revision: int = 0) -> bool:
        """Use the map ``raw`` (None: deleted, one pool); one older than the map in force is skipped."""
        if revision and revision <= self.revision:
            return False
        self.revision = max(self.revision, revision)
        try:
            new = PoolMap.from_json(raw)
        except PoolError as exc:
            log.error("ignoring router pool map %r: %s; keeping %s", (raw or b"")[:120], exc, self.map.describe())
            return False
        if new != self.map:
            log.info("router pools: %s", new.describe())
        self.map = new
        if self.on_change is not None:
            self.on_change(new)
        self.changed.set()
        return True

    async def _watch(self, ready: asyncio.Event) -> None:
        async for _key, value, rev in self.bus.kv(S.BUCKET_CONFIG).watch(S.KEY_POOLS, ready=ready):
            self.apply(value, rev)


async def store_pools(bus, pools: PoolMap) -> None:
    """Write the pool map (an empty map deletes the key: one pool again)."""
    kv = bus.kv(S.BUCKET_CONFIG)
    if pools.configured:
        await kv.put(S.KEY_POOLS, pools.to_json())
    else:
        await kv.delete(S.KEY_POOLS)
