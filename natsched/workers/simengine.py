"""SimEngine: the :class:`~natsched.workers.simcore.SimCore` model run in real time behind the Engine protocol.

It lets ``natsched up`` and the tests exercise the whole pipeline — batching, prefix-cache hits,
cache events, streaming — on a machine without a GPU. Output tokens are synthetic
(``" tok<N>"``); their timing follows the engine profile, scaled by ``time_scale``.

``speed`` (1.0 nominal) slows or speeds the engine at run time (:meth:`SimEngine.set_speed`);
``host_blocks`` / ``host_bandwidth`` give it a host KV tier (:mod:`natsched.workers.simcore`), whose
changes reach the cache listener with tier ``"host"``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from natsched.wire.ids import BlockHash
from natsched.workers.engine import CacheListener, EngineOutput, EngineRequest, EngineStats
from natsched.workers.profiles import EngineProfile, H100_LLAMA8B
from natsched.workers.simcore import SimCore

log = logging.getLogger(__name__)

SYNTHETIC_VOCAB = 32000


class SimEngine:
    def __init__(
        self,
        profile: EngineProfile = H100_LLAMA8B,
        block_size: int = 32,
        time_scale: float = 1.0,
        kv_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int = 131072,
        speed: float = 1.0,
        host_blocks: int = 0,
        host_bandwidth: float = 0.0,
    ) -> None:
        self.block_size = block_size
        self.time_scale = time_scale
        self.max_model_len = max_model_len
        self.core = SimCore(profile, block_size, kv_blocks=kv_blocks, max_num_seqs=max_num_seqs, speed=speed,
                            host_blocks=host_blocks, host_bandwidth=host_bandwidth)
        self._queues: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._resumed: dict[str, int] = {}  # request id -> output tokens a migrated stream had
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._listener: CacheListener | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="simengine")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def set_cache_listener(self, listener: CacheListener) -> None:
        self._listener = listener

    @property
    def speed(self) -> float:
        return self.core.speed

    def set_speed(self, speed: float) -> None:
        """Run at ``speed`` x nominal from the next step on (a noisy neighbour: 1/3)."""
        self.core.set_speed(speed)

    def cached_hashes(self) -> list[BlockHash]:
        return [BlockHash(h) for h in self.core.cached_hashes()]

    def host_hashes(self) -> list[BlockHash]:
        """What the host tier holds (snapshots report it with tier ``"host"``)."""
        return [BlockHash(h) for h in self.core.host]

    def stats(self) -> EngineStats:
        c = self.core
        return EngineStats(
            running=len(c.running),
            waiting=len(c.waiting),
            kv_used_blocks=c.used_blocks,
            kv_total_blocks=c.kv_blocks,
            # as the vLLM engines report it (vllm_engine, vllm_server): KV blocks in use, a prefix
            # shared by many sequences counted once, plus the prefill still owed. The per-sequence sum
            # (SimCore.runtime_tokens) counted a shared system prompt once per sequence: at an 80 % hit
            # ratio the admitter's capacity-following total saw a full cluster at half its real use
            runtime_tokens=c.used_blocks * c.block_size + c.queued_prefill_tokens(),
            queued_prefill_tokens=c.queued_prefill_tokens(),
            capacity_tokens=c.kv_blocks * c.block_size,
            preemptions=c.preemptions,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if request.prompt_tokens + request.max_tokens > self.max_model_len:
            yield EngineOutput(0, finished=True, finish_reason="error", prompt_tokens=request.prompt_tokens,
                               error=f"prompt_too_long: prompt ({request.prompt_tokens}) + max_tokens ({request.max_tokens}) "
                                     f"exceeds max_model_len {self.max_model_len}")
            return
        out_tokens = min(request.max_tokens, request.output_tokens_hint or request.max_tokens)
        if not self.core.fits(request.prompt_tokens, request.max_tokens):
            yield EngineOutput(0, finished=True, finish_reason="error", prompt_tokens=request.prompt_tokens,
                               error=f"prompt_too_long: prompt + max_tokens need more than the engine's "
                                     f"{self.core.kv_blocks} KV blocks of {self.block_size} tokens")
            return
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._queues[request.id] = queue
        self._resumed[request.id] = len(request.resume_token_ids or ())
        self.core.add(request.id, request.prompt_tokens, request.hashes, out_tokens, time.monotonic())
        self._wake.set()
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self._resumed.pop(request.id, None)
            if self._queues.pop(request.id, None) is not None:
                self.core.abort(request.id)

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(EngineOutput(0, finished=True, finish_reason="abort"))

    async def _loop(self) -> None:
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
            result = self.core.step(time.monotonic())
            await asyncio.sleep(result.duration * self.time_scale)
            if self._listener and result.removed:
                self._listener("removed", [BlockHash(h) for h in result.removed])
            if self._listener and result.stored:
                self._listener("stored", [BlockHash(h) for h in result.stored])
            if self._listener and result.host_removed:
                self._listener("removed", [BlockHash(h) for h in result.host_removed], "host")
            if self._listener and result.host_stored:
                self._listener("stored", [BlockHash(h) for h in result.host_stored], "host")
            self._deliver(result)
            if not result.duration:
                await asyncio.sleep(0.001)  # nothing could run (KV full): do not spin

    def _deliver(self, result) -> None:
        done = {s.id: s for s in result.finished}
        for seq_id, index in result.tokens:
            queue = self._queues.get(seq_id)
            if queue is None:
                continue
            seq = done.get(seq_id)
            n = index + self._resumed.get(seq_id, 0)  # a migrated stream's tokens go on numbering
            token = n % SYNTHETIC_VOCAB
            out = EngineOutput(index, text=f" tok{n}", token_ids=[token])
            if seq is not None:
                out.finished, out.finish_reason = True, "length"
                out.prompt_tokens, out.cached_tokens, out.output_tokens = seq.prompt_tokens, seq.cached_tokens, seq.generated
            queue.put_nowait(out)
