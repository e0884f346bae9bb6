"""The Engine protocol: what a worker agent needs from an inference engine.

Implementations: :class:`natsched.workers.simengine.SimEngine` (a calibrated model, real time),
``natsched.workers.vllm_engine.VllmEngine`` (vLLM's AsyncLLM in this process) and
:class:`natsched.workers.vllm_server.ServerEngine` (a ``vllm serve`` or SGLang server over HTTP).
The agent never knows which it drives. Optional, for engines that have them: ``failure`` (it
died: the worker leaves), ``epoch`` (when the cache it reports began: a newer one re-registers
the worker) and ``served_models()`` (base models and adapters, for heartbeats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from natsched.wire.ids import BlockHash

#: (kind, hashes[, tier]): kind is "stored", "removed" or "cleared"; tier "gpu" (default, may be
#: omitted) or "host" (an offload tier in host memory: cheaper than a recompute, dearer than a GPU hit)
CacheListener = Callable[..., None]


@dataclass
class EngineRequest:
    id: str
    prompt_tokens: int
    hashes: list[BlockHash]
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # a migrated stream's output so far (Request.resume_token_ids): the engine runs prompt + these
    # and generates after them; ``prompt_tokens`` counts them, ``max_tokens`` is what is left
    resume_token_ids: list[int] | None = None
    output_tokens_hint: int | None = None  # a simulated engine generates this many
    model: str | None = None  # the request's model (a LoRA adapter's name, for a server that has several)
    # of the prompt, what the router expected this engine to hold cached (the assignment's): its
    # queued prefill is the rest (EngineStats.queued_prefill_tokens)
    expected_cached_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.expected_cached_tokens)


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


#: how long an engine server may not answer before its worker leaves (WorkerSettings.unreachable_leave_s,
#: ``--unreachable-leave``): long enough to ride out a restart's first seconds and a slow scrape
UNREACHABLE_LEAVE_S = 5.0


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    runtime_tokens: int = 0
    # prefill still owed: the uncached prompt tokens of requests whose first token has not come
    # (the router's backlog estimate, natsched.router.backlog, takes each request's uncached part)
    queued_prefill_tokens: int = 0
    capacity_tokens: int = 0
    preemptions: int = 0  # cumulative since the engine started (the backoff monitor takes its rate)
    # cumulative prompt tokens the engine looked up in its prefix cache, and found there (an engine
    # server's own counters, vllm:prefix_cache_queries/_hits); None: the engine does not count them
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    # an engine behind a network hop (natsched.workers.vllm_server): seconds it has not answered, and why
    unreachable_s: float = 0.0
    unreachable_reason: str = ""


class Engine(Protocol):
    block_size: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def cached_hashes(self) -> list[BlockHash]: ...

    def set_cache_listener(self, listener: CacheListener) -> None: ...
