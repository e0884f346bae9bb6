"""VllmEngine: vLLM's ``AsyncLLM`` (v1 engine) behind the :class:`~natsched.workers.engine.Engine` protocol.

What it adds to vLLM, and why:

- **prefix caching on, KV events on**: vLLM's ZMQ publisher *connects* to our
  :class:`~natsched.workers.kv_events.KvEventSubscriber`, whose translator turns ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared`` into natsched hashes (per-process vLLM seeds do not
  leak onto the bus) and feeds the cache listener;
- **text prompts are tokenized here**, with the model's tokenizer and character offsets, then
  sent as ``TokensPrompt``: the engine then knows which token block holds each text block and
  attaches the router's text hashes to them (:mod:`natsched.workers.textmap`);
- **every failure is an output**: an over-long prompt, a request vLLM refuses and an engine
  that dies give a final ``EngineOutput`` with ``error = "<code>: <message>"``; codes:
  ``prompt_too_long``, ``invalid_request``, ``no_tokenizer``, ``engine_dead``, ``engine_error``;
- **cancellation**: closing the ``generate()`` iterator (or cancelling its task) aborts the vLLM
  request; :meth:`VllmEngine.abort` makes vLLM end it with ``finish_reason="abort"``;
- **load**: running / waiting / KV usage from vLLM's scheduler stats (a stat-logger plugin),
  smoothed over ``stats_window_s``; queued prefill tracked per request here.

Import-safe: vLLM is imported in :meth:`VllmEngine.start` only. vLLM starts its engine core with
``spawn`` on CPU, so a *script* that starts an engine needs an ``if __name__ == "__main__":``
guard; pytest and ``python -m`` entry points are fine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from natsched.wire.blocks import root_hash, token_block_hashes
from natsched.wire.ids import BlockHash
from natsched.workers.engine import CacheListener, EngineOutput, EngineRequest, EngineStats
from natsched.workers.errors import EngineStartError, EngineUnavailable
from natsched.workers.kv_events import KvEventSubscriber, KvTranslator
from natsched.workers.textmap import text_aliases
from natsched.workers.vllm_stats import LoadWindow, stat_logger_factory

log = logging.getLogger(__name__)


@dataclass
class VllmEngineSettings:
    """Everything the engine is built from; the CLI fills it (:func:`natsched.cli.up.vllm_settings`)."""

    model_path: str  # HF id or local directory vLLM loads
    model: str = "default"  # the name requests use (Request.model): root of the prefix hash chain
    block_size: int = 32  # vLLM KV block size = the router's hash block size (multiple of 32 on CPU)
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's own limit
    gpu_memory_utilization: float = 0.9  # GPU only; on CPU, VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache
    kv_cache_blocks: int | None = None  # force the number of KV blocks (tests, capacity experiments)
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False  # skip torch.compile: much faster start, slower steps
    load_format: str = "auto"  # "dummy": random weights, no download (tests)
    dtype: str = "auto"
    tokenizer: str | None = None  # default: model_path
    skip_tokenizer_init: bool = False  # token-id prompts only (no tokenizer files needed)
    seed: int = 0
    temperature: float | None = None  # None: vLLM's default sampling
    ignore_eos: bool = False  # always generate max_tokens (benchmarks, calibration, tests)
    deployment: str | None = None  # calibration key part; default derived from device and KV size
    kv_events: bool = True
    kv_events_host: str = "127.0.0.1"
    kv_events_port: int = 0  # 0: any free port (our SUB socket binds, vLLM connects)
    stats_window_s: float = 2.0
    max_alias_entries: int = 1 << 18
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # more AsyncEngineArgs, passed through


@dataclass
class _Live:
    prompt_tokens: int
    uncached_tokens: int = 0
    started: bool = False
    output_tokens: int = 0


class VllmEngine:
    """One vLLM AsyncLLM, its KV-event reader and its load window."""

    def __init__(self, settings: VllmEngineSettings) -> None:
        if settings.block_size <= 0:
            raise ValueError("block_size must be positive")
        self.settings = settings
        self.block_size = settings.block_size
        self.model = settings.model
        self.translator = KvTranslator(settings.model, settings.block_size, max_aliases=settings.max_alias_entries)
        self.window = LoadWindow(settings.stats_window_s)
        self.max_model_len: int = settings.max_model_len or 0
        self.kv_total_blocks = 0
        self.vocab_size = 0
        self._llm: Any = None
        self._tokenizer: Any = None
        self._sub: KvEventSubscriber | None = None
        self._listener: CacheListener | None = None
        self._live: dict[str, _Live] = {}
        self._aborted: set[str] = set()
        self._failure: str | None = None
        self._watchdog: asyncio.Task | None = None
        self._vllm: Any = None  # the lazily imported names we use (a small namespace)
        self._last_resync = 0.0
        self._resync_handle: asyncio.TimerHandle | None = None

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer serve (it died), or None while it is healthy."""
        return self._failure

    @property
    def deployment(self) -> str:
        """What a calibration is valid for: the operator's name, or device + KV size + batch size."""
        if self.settings.deployment:
            return self.settings.deployment
        device = "cpu"
        try:
            from vllm.platforms import current_platform

            device = str(current_platform.device_type or "cpu")
        except Exception:
            pass
        return f"{device}-kv{self.kv_total_blocks * self.block_size}-seq{self.settings.max_num_seqs}"

    def _import_vllm(self) -> None:
        try:
            from vllm import AsyncEngineArgs, SamplingParams
            from vllm.config import KVEventsConfig
            from vllm.exceptions import VLLMClientError
            from vllm.inputs import TokensPrompt
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.engine.exceptions import EngineDeadError
        except Exception as exc:  # ImportError, or a broken torch install
            raise EngineUnavailable(
                f"vLLM cannot be imported ({type(exc).__name__}: {exc}); install the 'cpu' or 'vllm' extra"
            ) from exc
        self._vllm = type("vllm_names", (), dict(
            AsyncEngineArgs=AsyncEngineArgs, SamplingParams=SamplingParams, KVEventsConfig=KVEventsConfig,
            VLLMClientError=VLLMClientError, TokensPrompt=TokensPrompt, RequestOutputKind=RequestOutputKind,
            AsyncLLM=AsyncLLM, EngineDeadError=EngineDeadError,
        ))

    def engine_args(self, kv_endpoint: str | None) -> Any:
        s, v = self.settings, self._vllm
        kwargs: dict[str, Any] = dict(
            model=s.model_path,
            tokenizer=s.tokenizer,
            block_size=s.block_size,
            enable_prefix_caching=True,
            max_num_seqs=s.max_num_seqs,
            max_model_len=s.max_model_len,
            gpu_memory_utilization=s.gpu_memory_utilization,
            num_gpu_blocks_override=s.kv_cache_blocks,
            max_num_batched_tokens=s.max_num_batched_tokens,
            enforce_eager=s.enforce_eager,
            load_format=s.load_format,
            dtype=s.dtype,
            skip_tokenizer_init=s.skip_tokenizer_init,
            seed=s.seed,
            disable_log_stats=True,  # our stat logger still runs; vLLM's periodic log lines do not
        )
        if kv_endpoint is not None:
            kwargs["kv_events_config"] = v.KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=kv_endpoint
            )
        kwargs.update(s.engine_kwargs)
        return v.AsyncEngineArgs(**kwargs)

    async def start(self) -> None:
        """Start vLLM (≈15–60 s on CPU) without blocking the event loop."""
        self._import_vllm()
        endpoint = None
        if self.settings.kv_events:
            self._sub = KvEventSubscriber(self.translator, self._emit, self._resync,
                                          host=self.settings.kv_events_host, port=self.settings.kv_events_port)
            endpoint = self._sub.bind()
            self._sub.start()
        args = self.engine_args(endpoint)
        factory = stat_logger_factory(self.window)
        started = time.monotonic()
        try:
            self._llm = await asyncio.to_thread(self._vllm.AsyncLLM.from_engine_args, args,
                                                stat_loggers=[factory])
        except Exception as exc:
            if self._sub is not None:
                await self._sub.close()
            raise EngineStartError(f"vLLM could not start model {self.settings.model_path!r}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        cache_config = self._llm.vllm_config.cache_config
        self.kv_total_blocks = int(cache_config.num_gpu_blocks or 0)
        self.max_model_len = int(self._llm.model_config.max_model_len)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        self.translator.max_entries = 2 * max(1, self.kv_total_blocks) + 1024
        if not self.settings.skip_tokenizer_init:
            self._tokenizer = self._llm.tokenizer
        self._watchdog = asyncio.create_task(self._watch(), name="vllm-watchdog")
        log.info("vLLM engine for %s (%s) ready in %.1fs: %d KV blocks of %d, max_model_len %d, kv events %s",
                 self.model, self.settings.model_path, time.monotonic() - started, self.kv_total_blocks,
                 self.block_size, self.max_model_len, endpoint or "off")

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        if self._resync_handle is not None:
            self._resync_handle.cancel()
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                await asyncio.to_thread(llm.shutdown)
            except Exception:
                log.exception("vLLM shutdown failed")
        if self._sub is not None:
            await self._sub.close()
            self._sub = None

    # ------------------------------------------------------------------ cache summaries
    def set_cache_listener(self, listener: CacheListener) -> None:
        self._listener = listener

    def cached_hashes(self) -> list[BlockHash]:
        return self.translator.cached_hashes()

    def host_hashes(self) -> list[BlockHash]:
        """What vLLM's CPU offload tier holds (its ``medium = "CPU"`` events), for snapshots."""
        return self.translator.host_hashes()

    def _emit(self, kind: str, hashes: list[BlockHash], tier: str | None = None) -> None:
        if self._listener is not None:
            if tier is None:
                self._listener(kind, hashes)
            else:
                self._listener(kind, hashes, tier)

    def _resync(self, why: str) -> None:
        """Our view may have drifted from vLLM's: publish a snapshot (at most one per second)."""
        log.warning("kv events of %s need a resync: %s", self.model, why)
        if self._resync_handle is not None:
            return
        delay = max(0.0, self._last_resync + 1.0 - time.monotonic())
        self._resync_handle = asyncio.get_running_loop().call_later(delay, self._send_snapshot)

    def _send_snapshot(self) -> None:
        self._resync_handle = None
        self._last_resync = time.monotonic()
        self._emit("snapshot", self.cached_hashes())

    # ------------------------------------------------------------------ load
    def stats(self) -> EngineStats:
        s = self.window.smoothed()
        live = list(self._live.values())
        busy = bool(live)
        queued = sum(r.uncached_tokens for r in live if not r.started)
        return EngineStats(
            running=round(s.running) if busy else 0,
            waiting=round(s.waiting) if busy else 0,
            kv_used_blocks=round(s.kv_usage * self.kv_total_blocks) if busy else 0,
            kv_total_blocks=self.kv_total_blocks,
            runtime_tokens=(round(s.kv_usage * self.kv_total_blocks) * self.block_size if busy else 0) + queued,
            queued_prefill_tokens=queued,
            capacity_tokens=self.kv_total_blocks * self.block_size,
            preemptions=self.window.preemptions, prefix_cache_queries=self.window.prefix_queries,
            prefix_cache_hits=self.window.prefix_hits,
        )

    # ------------------------------------------------------------------ requests
    async def abort(self, request_id: str) -> None:
        """End a request: vLLM finishes it with ``finish_reason="abort"``."""
        if request_id not in self._live:
            return  # unknown or already finished: nothing to end
        self._aborted.add(request_id)  # seen by generate() if vLLM does not have it yet
        if self._llm is not None:
            try:
                await self._llm.abort(request_id)
            except Exception as exc:
                log.warning("abort of %s failed: %s", request_id, exc)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        rid = request.id
        if self._failure is not None or self._llm is None:
            yield _error(f"engine_dead: {self._failure or 'engine not started'}")
            return
        live = self._live[rid] = _Live(prompt_tokens=request.prompt_tokens, uncached_tokens=request.uncached_tokens)
        try:
            ids, aliases = await self._prepare(request)
            ids = self._resumed(ids, request)
        except _Refused as exc:
            self._forget(rid)
            yield _error(str(exc), prompt_tokens=exc.prompt_tokens)
            return
        except BaseException:
            self._forget(rid)
            raise
        n = live.prompt_tokens = len(ids)
        if n >= self.max_model_len or rid in self._aborted or self._llm is None:
            self._forget(rid)
            if n >= self.max_model_len:
                yield _error(f"prompt_too_long: the prompt has {n} tokens; max_model_len is {self.max_model_len} "
                             "(prompt + at least one output token must fit)", prompt_tokens=n)
            elif self._llm is None:
                yield _error("engine_dead: the engine was stopped", prompt_tokens=n)
            else:
                yield EngineOutput(0, finished=True, finish_reason="abort", prompt_tokens=n)
            return
        for kind, hashes in self.translator.attach(aliases):
            self._emit(kind, hashes)
        v = self._vllm
        params = v.SamplingParams(max_tokens=max(1, min(request.max_tokens, self.max_model_len - n)),
                                  output_kind=v.RequestOutputKind.DELTA,
                                  detokenize=self._tokenizer is not None,
                                  ignore_eos=self.settings.ignore_eos,
                                  **({} if self.settings.temperature is None else
                                     {"temperature": self.settings.temperature}))
        stream = self._llm.generate(v.TokensPrompt(prompt_token_ids=ids), params, request_id=rid)
        index = out_tokens = 0
        done = False
        try:
            async for ro in stream:
                co = ro.outputs[0] if ro.outputs else None
                new_ids = list(co.token_ids) if co is not None else []
                out_tokens += len(new_ids)
                live.started, live.output_tokens = True, out_tokens
                out = EngineOutput(index, text=(co.text or "") if co is not None else "", token_ids=new_ids or None)
                index += 1
                if ro.finished:
                    done = True
                    self._forget(rid)  # before the yield: the consumer may never resume us
                    out.finished = True
                    out.finish_reason = (co.finish_reason if co is not None else None) or "stop"
                    out.prompt_tokens, out.output_tokens = n, out_tokens
                    out.cached_tokens = int(ro.num_cached_tokens or 0)
                    yield out
                    return
                yield out
            done = True
            yield _error("engine_error: vLLM ended the stream without a final output", prompt_tokens=n)
        except v.EngineDeadError as exc:
            done = True
            self._mark_dead(f"vLLM engine core died: {exc}")
            yield _error(f"engine_dead: {self._failure}", prompt_tokens=n, output_tokens=out_tokens)
        except v.VLLMClientError as exc:  # validation / admission: this request only
            done = True
            yield _error(f"invalid_request: {exc}", prompt_tokens=n)
        except Exception as exc:
            done = True
            if self._llm is not None and self._llm.errored:
                self._mark_dead(f"vLLM engine failed: {type(exc).__name__}: {exc}")
                yield _error(f"engine_dead: {self._failure}", prompt_tokens=n, output_tokens=out_tokens)
            else:
                log.exception("request %s failed in vLLM", rid)
                yield _error(f"engine_error: {type(exc).__name__}: {exc}", prompt_tokens=n, output_tokens=out_tokens)
        finally:
            self._forget(rid)
            if not done:  # the consumer stopped early (closed us, or was cancelled): abort in vLLM
                await stream.aclose()
                if self._llm is not None and not self._llm.errored:
                    await self._llm.abort(rid)

    def _forget(self, rid: str) -> None:
        self._live.pop(rid, None)
        self._aborted.discard(rid)

    async def _prepare(self, request: EngineRequest) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids for vLLM and, for a text prompt, the text->token block attachments."""
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            if not ids:
                raise _Refused("invalid_request: prompt_token_ids is empty")
            self._check_vocab(ids, "token id", len(ids))
            return ids, []
        if request.prompt is None:
            raise _Refused("invalid_request: the request has neither prompt nor prompt_token_ids")
        if self._tokenizer is None:
            raise _Refused("no_tokenizer: this engine was started without a tokenizer "
                           "(skip_tokenizer_init); send prompt_token_ids")
        text = request.prompt
        try:
            ids, offsets = await asyncio.to_thread(_tokenize, self._tokenizer, text)
        except Exception as exc:
            raise _Refused(f"invalid_request: the tokenizer failed on the prompt: {exc}") from exc
        tok_hashes = token_block_hashes(ids, self.block_size, root_hash(self.model))
        pairs = text_aliases(text, offsets, len(ids), request.hashes, tok_hashes, self.block_size)
        return ids, pairs

    def _resumed(self, ids: list[int], request: EngineRequest) -> list[int]:
        """The prompt's ids, then a migrated stream's output so far: vLLM continues after it."""
        resume = list(request.resume_token_ids or ())
        if resume:
            self._check_vocab(resume, "resume token id", len(ids))
        return ids + resume

    def _check_vocab(self, ids: list[int], what: str, prompt_tokens: int) -> None:
        """Refuse an id outside the model's vocabulary (vLLM would fail the whole engine on it)."""
        if self.vocab_size and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise _Refused(f"invalid_request: {what} {bad} is outside the model's vocabulary "
                           f"[0, {self.vocab_size})", prompt_tokens=prompt_tokens)

    # ------------------------------------------------------------------ failure
    def _mark_dead(self, reason: str) -> None:
        if self._failure is not None:
            return
        self._failure = reason
        log.error("engine for %s is dead: %s", self.model, reason)
        self.translator.clear()
        self._emit("cleared", [])

    async def _watch(self) -> None:
        """Notice an engine core that dies while idle (no request would tell us)."""
        while self._failure is None:
            await asyncio.sleep(0.5)
            llm = self._llm
            if llm is not None and llm.errored:
                self._mark_dead("vLLM engine core stopped (process exited or output loop failed)")


class _Refused(Exception):
    def __init__(self, message: str, prompt_tokens: int = 0) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens


def _error(message: str, prompt_tokens: int = 0, output_tokens: int = 0) -> EngineOutput:
    return EngineOutput(0, finished=True, finish_reason="error", prompt_tokens=prompt_tokens,
                        output_tokens=output_tokens, error=message)


def _tokenize(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids (with the model's special tokens) and character offsets when the tokenizer has them."""
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        return list(enc["input_ids"]), offsets  # type: ignore[return-value]
    except (NotImplementedError, TypeError, KeyError, ValueError):
        return list(tokenizer.encode(text, add_special_tokens=True)), None
