"""The Engine protocol: what a worker agent needs from an inference engine.

Two implementations: :class:`natsched.workers.simengine.SimEngine` (a calibrated model, real time) and
``natsched.workers.vllm_engine.VllmEngine`` (vLLM's AsyncLLM). The agent never knows which it drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from natsched.wire.ids import BlockHash

#: (kind, hashes): kind is "stored", "removed" or "cleared"
CacheListener = Callable[[str, list[BlockHash]], None]


@dataclass
class EngineRequest:
    id: str
    prompt_tokens: int
    hashes: list[BlockHash]
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    output_tokens_hint: int | None = None  # a simulated engine generates this many


@dataclass
class EngineOutput:
    """One increment of output; the last one has ``finished`` set and the totals."""

    index: int
    text: str = ""
    token_ids: list[int] | None = None
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None  # set with finished=True when the engine refused or failed


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    runtime_tokens: int = 0
    queued_prefill_tokens: int = 0
    capacity_tokens: int = 0
    preemptions: int = 0


class Engine(Protocol):
    block_size: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def cached_hashes(self) -> list[BlockHash]: ...

    def set_cache_listener(self, listener: CacheListener) -> None: ...
