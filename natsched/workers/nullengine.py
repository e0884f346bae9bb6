"""NullEngine: answers every request at once with one token and no compute.

For measuring the scheduler's own cost (``natsched bench pipeline``): with zero engine time,
what is left of a request's latency is admission, routing and the bus.
"""

from __future__ import annotations

from typing import AsyncIterator

from natsched.wire.ids import BlockHash
from natsched.workers.engine import CacheListener, EngineOutput, EngineRequest, EngineStats


class NullEngine:
    def __init__(self, block_size: int = 32, capacity_tokens: int = 10**9) -> None:
        self.block_size = block_size
        self.capacity_tokens = capacity_tokens
        self.running = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def set_cache_listener(self, listener: CacheListener) -> None:
        pass

    def cached_hashes(self) -> list[BlockHash]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, capacity_tokens=self.capacity_tokens)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        yield EngineOutput(0, text=" ok", finished=True, finish_reason="length", prompt_tokens=request.prompt_tokens,
                           output_tokens=1)

    async def abort(self, request_id: str) -> None:
        pass
