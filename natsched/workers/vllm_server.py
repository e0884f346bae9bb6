"""ServerEngine: a ``vllm serve`` (or SGLang) process someone else runs, behind the Engine protocol.

The agent owns no engine here. Teams already run their vLLM servers (a Helm chart, an operator,
tensor/pipeline parallelism, quantisation, LoRA); this engine fronts one of them unmodified:

- **requests** go to its OpenAI-compatible ``POST /v1/completions``, streaming (httpx): the
  prompt as token ids when the request carries them, else as text; ``stream_options.include_usage``
  brings the server's own usage at the end (prompt, ``prompt_tokens_details.cached_tokens`` —
  vLLM sends it with ``--enable-prompt-tokens-details`` — and completion tokens), and vLLM's
  ``return_token_ids`` the token ids of each increment and of the prompt. **Cancel** = closing
  the HTTP stream: vLLM aborts a request whose client went away.
- **cache summaries** come from the server's own KV events (``--kv-events-config`` with the ZMQ
  publisher bound on ``tcp://*:PORT``; we connect; with its replay socket, batches we missed —
  before we connected, or in a gap — are fetched again first): the same :class:`~natsched.workers.kv_events.KvTranslator`
  as the in-process engine turns them into natsched hashes. A text prompt's text hashes are
  attached to its token blocks from the prompt token ids the server returns (no character
  offsets over HTTP: the proportional estimate of :mod:`natsched.workers.textmap`).
- **load** comes from the server's ``/metrics`` (:mod:`natsched.workers.server_metrics`), scraped
  every ``scrape_interval_s`` and smoothed over ``stats_window_s`` (the same window as vLLM's
  in-process stats).
- **models** come from ``GET /v1/models`` (again every ``models_every_s``: adapters can be loaded
  at run time): base models, LoRA adapters (``parent`` set) and ``max_model_len``, announced in
  heartbeats (:class:`~natsched.wire.schema.ServedModel`).

Two things the agent learns from it, for its state (:mod:`natsched.workers.agent`):

- ``unreachable_s`` in :meth:`stats`: how long the server has not answered (scrapes, requests).
  The agent backs off, then leaves (takes nothing), and comes back when the server answers again.
  A connection that drops before any answer (a pooled keep-alive connection the server closed
  as we reused it) is no such sign: scrapes and requests go once more on a fresh connection,
  and idle connections are let go before the server's own keep-alive (``keepalive_expiry_s``).
- ``epoch``: when the server's cache we know of began. It moves when the server restarted (its
  ``process_start_time_seconds`` changed, its event sequence started again, it came back after
  being unreachable), when it cleared its cache (``AllBlocksCleared``) and when events were
  lost (a sequence gap): our view of its cache is void then, and the agent announces the new
  epoch as its ``started_at``, so the router drops its claims, distrusts it and re-snapshots.

Request errors are outputs (``error = "<code>: <message>"``), never exceptions: codes
``server_unavailable`` (no connection, the stream broke), ``server_error`` (HTTP 5xx),
``server_busy`` (429/503), ``prompt_too_long``, ``invalid_request`` (4xx), ``bad_response``
(not JSON, a truncated stream, missing or impossible usage).

SGLang (``flavor="sglang"``) speaks the same completions API and the same ZMQ event format
(``python/sglang/srt/disaggregation/kv_events.py``: array-encoded, no ``medium``); it has no
``return_token_ids`` (token counts then come from its usage only) and its own metric names. Its
``--page-size`` must equal natsched's block size for its events to map. Only fixtures of its
documented formats are tested: a real SGLang server cannot run here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import orjson

from natsched.wire.blocks import root_hash, token_block_hashes
from natsched.wire.ids import BlockHash
from natsched.wire.schema import ServedModel
from natsched.workers.engine import CacheListener, EngineOutput, EngineRequest, EngineStats
from natsched.workers.errors import EngineStartError
from natsched.workers.kv_events import KvEventSubscriber, KvTranslator
from natsched.workers.server_metrics import FLAVORS, MetricsError, ServerLoad, parse_metrics
from natsched.workers.textmap import text_aliases
from natsched.workers.vllm_stats import LoadSample, LoadWindow

log = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """What the agent needs to front one server; ``natsched worker`` fills it (``natsched.cli.up.server_settings``)."""

    url: str  # http://HOST:PORT of the OpenAI-compatible server
    kv_events: str | None = None  # tcp://HOST:PORT its ZMQ publisher binds (None: no cache summaries)
    kv_replay: str | None = None  # tcp://HOST:PORT of its replay socket: lost batches are asked for again
    metrics_url: str | None = None  # default: <url>/metrics
    flavor: str = "vllm"  # vllm | sglang
    model: str | None = None  # the served model name to announce as this worker's; default: the first base model
    block_size: int | None = None  # default: the server's (vllm:cache_config_info), else 32
    scrape_interval_s: float = 1.0  # the agent sets its heartbeat period
    stats_window_s: float = 2.0
    models_every_s: float = 10.0  # /v1/models again (adapters loaded or unloaded at run time)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0  # between two chunks of a stream (a queued prefill may be slow)
    start_timeout_s: float = 30.0  # how long start() waits for the server to answer
    max_connections: int = 256
    # an idle pooled connection is dropped after this, below the server's own idle keep-alive
    # (vLLM's uvicorn closes one after VLLM_HTTP_TIMEOUT_KEEP_ALIVE = 5 s, httpx's default is also
    # 5 s): at equal times the server may close a connection just as we reuse it
    keepalive_expiry_s: float = 2.0
    ignore_eos: bool = False  # always generate max_tokens (benchmarks, tests; vLLM and SGLang take it)
    temperature: float | None = None
    api_key: str | None = None  # sent as a bearer token (vllm serve --api-key)
    extra_body: dict[str, Any] = field(default_factory=dict)  # more sampling fields, passed through

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}, got {self.flavor!r}")
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"server url must be http(s)://HOST:PORT, got {self.url!r}")


class ServerEngine:
    """One OpenAI-compatible engine server: its API, its KV events, its /metrics."""

    deployment = None  # a server's capacity is its own KV size (no calibration key of ours)

    def __init__(self, settings: ServerSettings) -> None:
        for name in ("httpx", "httpcore"):  # a line per HTTP call is noise: the agent logs each request's states
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        self.settings = settings
        self.block_size = settings.block_size or 32
        self.model = settings.model or ""
        self.served: list[ServedModel] = []
        self.max_model_len = 0
        self.window = LoadWindow(settings.stats_window_s)
        self.translator: KvTranslator | None = None
        self.epoch = time.time()  # when the cache we know of began (see the module docstring)
        self.last_load = ServerLoad()
        self.scrapes = self.scrape_failures = 0
        self.kv_total_blocks = 0
        self._client: Any = None
        self._sub: KvEventSubscriber | None = None
        self._listener: CacheListener | None = None
        self._scraper: asyncio.Task | None = None
        self._down_since: float | None = None  # monotonic time of the first failure in a row
        self._down_reason = ""
        self._process_start: float | None = None
        self._live: dict[str, int] = {}  # request id -> uncached prompt tokens, while its first token is awaited
        self._streams: dict[str, Any] = {}  # request id -> open HTTP response (abort closes it)
        self._models: dict[str, str] = {}  # request id -> the model it names, while the server streams it
        self._aborting: set[str] = set()
        self._warned_cached = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Find the server, learn what it serves and its KV geometry, subscribe to its events."""
        if self._client is None:
            await self.discover()
        self.translator = KvTranslator(self.model, self.block_size,
                                       max_entries=2 * max(1, self.kv_total_blocks) + 1024)
        if self.settings.kv_events:
            self._sub = KvEventSubscriber(self.translator, self._emit, self._resync, connect=self.settings.kv_events,
                                          replay=self.settings.kv_replay)
            self._sub.bind()
            self._sub.start()
        self._scraper = asyncio.create_task(self._scrape_loop(), name="server-scrape")
        log.info("fronting %s server %s: model %s (%d served), %d KV blocks of %d, kv events %s",
                 self.settings.flavor, self.settings.url, self.model, len(self.served), self.kv_total_blocks,
                 self.block_size, self.settings.kv_events or "off")

    async def discover(self) -> None:
        """``GET /v1/models`` and one scrape, until the server answers or ``start_timeout_s``."""
        import httpx

        s = self.settings
        headers = {"authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=s.url, headers=headers,
            timeout=httpx.Timeout(connect=s.connect_timeout_s, read=s.read_timeout_s, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=s.max_connections, max_keepalive_connections=s.max_connections,
                                keepalive_expiry=s.keepalive_expiry_s),
        )
        deadline = time.monotonic() + s.start_timeout_s
        while True:
            try:
                await self._refresh_models()
                load = await self._scrape()
                break
            except (httpx.HTTPError, MetricsError, ValueError) as exc:
                if time.monotonic() >= deadline:
                    await self._client.aclose()
                    self._client = None
                    raise EngineStartError(f"the {s.flavor} server at {s.url} did not answer in "
                                           f"{s.start_timeout_s:.0f}s: {type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(0.5)
        if not s.block_size and load.block_size:
            self.block_size = load.block_size
        self._process_start = load.process_start
        self.kv_total_blocks = load.kv_total_blocks or (load.kv_total_tokens or 0) // self.block_size
        if load.prefix_caching is False:
            log.warning("the server at %s runs without prefix caching: nothing is cached to route by "
                        "(start it with --enable-prefix-caching)", s.url)
        if s.model and s.model not in {m.id for m in self.served}:
            await self._client.aclose()
            raise EngineStartError(f"the server at {s.url} does not serve {s.model!r} "
                                   f"(it serves {', '.join(m.id for m in self.served)})")

    async def stop(self) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            await asyncio.gather(self._scraper, return_exceptions=True)
            self._scraper = None
        for resp in list(self._streams.values()):
            await resp.aclose()
        if self._sub is not None:
            await self._sub.close()
            self._sub = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------ models
    async def _get(self, url: str) -> Any:
        """GET, once more at once when the connection dropped before any answer.

        A pooled keep-alive connection the server (or a proxy) closed just as we reused it ends a
        request with "disconnected without sending a response": that is no sign of a server
        down, and one such scrape must not fail every request routed here until the next one.
        The second try runs on a fresh connection; a server that is really gone fails it too.
        """
        import httpx

        try:
            return await self._client.get(url)
        except httpx.TransportError as exc:
            if not _dropped(exc):
                raise
            log.debug("server %s dropped a connection under GET %s (%s): once more", self.settings.url, url, exc)
            return await self._client.get(url)

    async def _refresh_models(self) -> None:
        resp = await self._get("/v1/models")
        resp.raise_for_status()
        self.served = parse_models(resp.content)
        bases = [m for m in self.served if not m.parent]
        if not bases:
            raise ValueError("the server lists no base model in /v1/models")
        if not self.model:
            self.model = bases[0].id
        mine = next((m for m in self.served if m.id == self.model), bases[0])
        self.max_model_len = mine.max_model_len or 0

    def served_models(self) -> list[ServedModel]:
        """What the server serves now, adapters marked ``active`` while in its batch: as its last
        scrape reported the batch, and at once for the adapters of our own open streams. A scrape
        alone can miss our own runs: a server whose engine steps faster than its API process
        handles the outputs (a tiny model on a CPU) answers /metrics only after the run, when its
        report is empty again."""
        active = self.last_load.active_adapters | set(self._models.values())
        return [ServedModel(id=m.id, object=m.object, created=m.created, owned_by=m.owned_by, root=m.root,
                            parent=m.parent, max_model_len=m.max_model_len, active=bool(m.parent) and m.id in active)
                for m in self.served]

    # ------------------------------------------------------------------ cache summaries
    def set_cache_listener(self, listener: CacheListener) -> None:
        self._listener = listener

    def cached_hashes(self) -> list[BlockHash]:
        return self.translator.cached_hashes() if self.translator is not None else []

    def _emit(self, kind: str, hashes: list[BlockHash]) -> None:
        if kind == "cleared":  # the server restarted its sequence or cleared its cache
            self._new_epoch("the server's cache was cleared (AllBlocksCleared or a new event sequence)")
        if self._listener is not None:
            self._listener(kind, hashes)

    def _resync(self, why: str) -> None:
        """Events were lost or garbled: what we know of the server's cache may be wrong. Forget it
        all (a claim of ours the server no longer holds would misroute) and start a new epoch."""
        if self.translator is not None:
            self.translator.clear()
        self._emit("cleared", [])
        log.warning("kv events of %s: %s; cache view dropped", self.settings.url, why)

    def _new_epoch(self, why: str) -> None:
        now = time.time()
        if now - self.epoch < 1e-3:
            return
        self.epoch = now
        log.warning("server %s: new cache epoch: %s", self.settings.url, why)

    # ------------------------------------------------------------------ load
    async def _scrape(self) -> ServerLoad:
        url = self.settings.metrics_url or "/metrics"
        resp = await self._get(url)
        resp.raise_for_status()
        # vLLM's page is hundreds of lines of histograms: parsed off the event loop, which relays tokens
        return await asyncio.to_thread(parse_metrics, resp.text, self.settings.flavor)

    async def _scrape_loop(self) -> None:
        import httpx

        models_at = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.scrape_interval_s)
            self.scrapes += 1
            try:
                load = await self._scrape()
                if time.monotonic() - models_at >= self.settings.models_every_s:
                    models_at = time.monotonic()
                    await self._refresh_models()
            except (httpx.HTTPError, MetricsError, ValueError) as exc:
                self.scrape_failures += 1
                self._failed(f"/metrics: {type(exc).__name__}: {exc}")
                continue
            self._answered(load)

    def _answered(self, load: ServerLoad) -> None:
        if self._down_since is not None:
            log.info("server %s answers again after %.1fs", self.settings.url, time.monotonic() - self._down_since)
            self._down_since = None
            self._new_epoch("the server answers again after being unreachable")
        if load.process_start and self._process_start and load.process_start != self._process_start:
            if self.translator is not None:
                self.translator.clear()
            self._emit("cleared", [])
            self._new_epoch("the server process restarted")
        self._process_start = load.process_start or self._process_start
        if load.kv_total_blocks:
            self.kv_total_blocks = load.kv_total_blocks
        self.last_load = load
        self.window.add(LoadSample(running=load.running, waiting=load.waiting, kv_usage=load.kv_usage))
        if load.preemptions is not None:
            self.window.preemptions = load.preemptions

    def _failed(self, why: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("server %s does not answer: %s", self.settings.url, why)
        self._down_reason = why

    @property
    def unreachable_s(self) -> float:
        return 0.0 if self._down_since is None else max(1e-6, time.monotonic() - self._down_since)

    def stats(self) -> EngineStats:
        s = self.window.smoothed()
        queued = sum(self._live.values())
        used = round(s.kv_usage * self.kv_total_blocks)
        return EngineStats(
            running=round(s.running), waiting=round(s.waiting), kv_used_blocks=used,
            kv_total_blocks=self.kv_total_blocks, runtime_tokens=used * self.block_size + queued,
            queued_prefill_tokens=queued, capacity_tokens=self.kv_total_blocks * self.block_size,
            preemptions=self.window.preemptions, prefix_cache_queries=self.last_load.prefix_queries,
            prefix_cache_hits=self.last_load.prefix_hits, unreachable_s=self.unreachable_s,
            unreachable_reason=self._down_reason if self._down_since is not None else "",
        )

    # ------------------------------------------------------------------ requests
    async def abort(self, request_id: str) -> None:
        """Close the request's HTTP stream: the server aborts a request whose client left."""
        resp = self._streams.get(request_id)
        if resp is not None:
            self._aborting.add(request_id)
            await resp.aclose()

    def request_body(self, request: EngineRequest, prompt_ids: list[int] | None = None) -> dict[str, Any]:
        """``prompt_ids``: the prompt as the server tokenized it (a migrated stream's text prompt)."""
        s = self.settings
        if prompt_ids is None and request.prompt_token_ids is not None:
            prompt_ids = list(request.prompt_token_ids)
        if prompt_ids is not None and request.resume_token_ids:
            prompt_ids = prompt_ids + list(request.resume_token_ids)  # it continues after them
        body: dict[str, Any] = {
            "model": self.model if request.model is None else request.model,
            "prompt": prompt_ids if prompt_ids is not None else request.prompt,
            "max_tokens": max(1, request.max_tokens),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if s.flavor == "vllm":
            body["return_token_ids"] = True
        if s.ignore_eos:
            body["ignore_eos"] = True
        if s.temperature is not None:
            body["temperature"] = s.temperature
        body.update(s.extra_body)
        return body

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        import httpx

        rid = request.id
        if request.prompt_token_ids is None and request.prompt is None:
            yield _error("invalid_request: the request has neither prompt nor prompt_token_ids")
            return
        if request.prompt_token_ids is not None and not request.prompt_token_ids:
            yield _error("invalid_request: prompt_token_ids is empty")
            return
        if self._client is None:
            yield _error("server_unavailable: the engine is not started")
            return
        if self._down_since is not None:  # fail fast: no connect timeout per request while it is down
            yield _error(f"server_unavailable: {self.settings.url} does not answer ({self._down_reason})",
                         prompt_tokens=request.prompt_tokens)
            return
        self._live[rid] = request.uncached_tokens
        state = _StreamState(request)
        try:
            try:
                resp = await self._open(request)
            except _ResumeRefused as exc:
                yield _error(str(exc), prompt_tokens=request.prompt_tokens)
                return
            self._streams[rid] = resp
            try:
                if resp.status_code != 200:
                    body = await resp.aread()
                    yield _http_error(resp.status_code, body, request.prompt_tokens)
                    return
                if request.model is not None:
                    self._models[rid] = request.model
                async for out in self._read_stream(resp, state):
                    yield out
                    if out.finished:
                        return
            finally:
                await resp.aclose()
        except (httpx.HTTPError, httpx.StreamError) as exc:
            if rid in self._aborting:  # abort() closed the stream
                yield EngineOutput(state.index, finished=True, finish_reason="abort",
                                   prompt_tokens=state.prompt_tokens, output_tokens=state.tokens)
                return
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                self._failed(f"{type(exc).__name__}: {exc}")
            yield _error(f"server_unavailable: {type(exc).__name__}: {exc or 'the connection broke'}",
                         prompt_tokens=state.prompt_tokens, output_tokens=state.tokens)
        finally:
            self._live.pop(rid, None)
            self._streams.pop(rid, None)
            self._models.pop(rid, None)
            self._aborting.discard(rid)

    async def _tokenized(self, request: EngineRequest) -> list[int]:
        """A text prompt's ids, by the server's own tokenizer (vLLM's ``POST /tokenize``, special
        tokens added as ``/v1/completions`` adds them): a migrated stream's output is appended to
        them, and a completion's prompt is text or ids, never both."""
        resp = await self._client.post("/tokenize", json={
            "model": self.model if request.model is None else request.model, "prompt": request.prompt})
        if resp.status_code != 200:
            raise _ResumeRefused(f"resume_unsupported: {self.settings.url} did not tokenize the prompt "
                                 f"(HTTP {resp.status_code}); a migrated stream needs POST /tokenize")
        tokens = resp.json().get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise _ResumeRefused("resume_unsupported: POST /tokenize answered no token list")
        return tokens

    async def _open(self, request: EngineRequest) -> Any:
        """POST the request, streaming; once more on a fresh connection when the first one dropped
        before the server answered (as :meth:`_get`). Nothing of the first try runs on: a server
        that read it sees its client gone, and vLLM aborts such a request."""
        import httpx

        ids = await self._tokenized(request) if request.resume_token_ids and request.prompt_token_ids is None else None
        req = self._client.build_request("POST", "/v1/completions", json=self.request_body(request, ids),
                                         headers={"x-request-id": request.id})
        try:
            return await self._client.send(req, stream=True)
        except httpx.TransportError as exc:
            if not _dropped(exc):
                raise
            log.info("request %s: server %s dropped the connection before answering (%s): sent again",
                     request.id, self.settings.url, exc)
            return await self._client.send(req, stream=True)

    async def _read_stream(self, resp: Any, state: "_StreamState") -> AsyncIterator[EngineOutput]:
        """SSE ``data:`` lines -> outputs; the last one carries the server's usage, checked."""
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == "[DONE]":
                yield self._final(state)
                return
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                yield _error(f"bad_response: the server sent a chunk that is not JSON: {data[:120]!r}",
                             prompt_tokens=state.prompt_tokens, output_tokens=state.tokens)
                return
            problem = state.take(chunk)
            if problem:
                yield _error(problem, prompt_tokens=state.prompt_tokens, output_tokens=state.tokens)
                return
            if state.first_prompt_ids is not None:
                self._attach_text(state)
            if state.pending_text or state.pending_ids:
                self._live.pop(state.request.id, None)  # prefilled: no longer queued prefill
                yield state.flush()
        yield _error("bad_response: the stream ended before the server said [DONE] (truncated)",
                     prompt_tokens=state.prompt_tokens, output_tokens=state.tokens)

    def _final(self, state: "_StreamState") -> EngineOutput:
        problem = state.check_usage(self.settings.flavor)
        if problem:
            return _error(problem, prompt_tokens=state.prompt_tokens, output_tokens=state.tokens)
        if state.cached is None and not self._warned_cached:
            self._warned_cached = True
            log.warning("server %s reports no prompt_tokens_details.cached_tokens: cached tokens count as 0 "
                        "(start vllm serve with --enable-prompt-tokens-details)", self.settings.url)
        out = state.flush()
        out.finished = True
        out.finish_reason = state.finish_reason or "stop"
        out.prompt_tokens, out.cached_tokens, out.output_tokens = state.usage_prompt, state.cached or 0, state.usage_out
        return out

    def _attach_text(self, state: "_StreamState") -> None:
        """A text prompt's text hashes -> the token blocks the server made of it (its prompt ids)."""
        ids, state.first_prompt_ids = state.first_prompt_ids, None
        req = state.request
        if req.prompt is None or not req.hashes or self.translator is None:
            return
        model = req.model or self.model
        tok = token_block_hashes(ids, self.block_size, root_hash(model))
        pairs = text_aliases(req.prompt, None, len(ids), req.hashes, tok, self.block_size)
        for kind, hashes in self.translator.attach(pairs):
            self._emit(kind, hashes)


class _ResumeRefused(Exception):
    """A migrated stream this server cannot continue (it does not tokenize a text prompt)."""


class _StreamState:
    """What one stream has said so far, and the checks on it (pure)."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.index = 0
        self.tokens = 0  # output token ids seen (vLLM's return_token_ids)
        self.saw_ids = False
        self.pending_text = ""
        self.pending_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.first_prompt_ids: list[int] | None = None
        self.prompt_tokens = request.prompt_tokens
        self.usage_prompt = self.usage_out = 0
        self.cached: int | None = None

    def take(self, chunk: Any) -> str | None:
        if not isinstance(chunk, dict):
            return f"bad_response: a stream chunk is a {type(chunk).__name__}, not an object"
        if "error" in chunk or chunk.get("object") == "error":
            err = chunk.get("error", chunk)
            msg = err.get("message") if isinstance(err, dict) else err
            return f"server_error: {msg}"
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            return "bad_response: 'choices' is not a list"
        for ch in choices:
            if not isinstance(ch, dict):
                return "bad_response: a choice is not an object"
            text = ch.get("text") or ""
            if not isinstance(text, str):
                return "bad_response: a choice's text is not a string"
            self.pending_text += text
            ids = ch.get("token_ids")
            if ids is not None:
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    return "bad_response: token_ids is not a list of integers"
                self.saw_ids = True
                self.pending_ids += ids
                self.tokens += len(ids)
            pids = ch.get("prompt_token_ids")
            if isinstance(pids, list) and pids and all(isinstance(t, int) for t in pids):
                self.first_prompt_ids = pids
                self.prompt_tokens = len(pids)
            if ch.get("finish_reason"):
                self.finish_reason = str(ch["finish_reason"])
        return None

    def flush(self) -> EngineOutput:
        out = EngineOutput(self.index, text=self.pending_text, token_ids=self.pending_ids or None)
        self.index += 1
        self.pending_text, self.pending_ids = "", []
        return out

    def check_usage(self, flavor: str) -> str | None:
        """The server's usage, or why it cannot be true."""
        u = self.usage
        if not isinstance(u, dict):
            return "bad_response: the stream ended without usage (the server ignored stream_options.include_usage)"
        prompt, out = u.get("prompt_tokens"), u.get("completion_tokens")
        if not _count(prompt) or prompt < 1 or not _count(out):
            return f"bad_response: impossible usage {dict(u)!r}"
        details = u.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is not None and (not _count(cached) or cached > prompt):
            return f"bad_response: cached_tokens {cached!r} is not within [0, prompt_tokens={prompt}]"
        ids = self.request.prompt_token_ids
        sent = None if ids is None else len(ids) + len(self.request.resume_token_ids or ())
        if sent is not None and prompt != sent:
            return f"bad_response: usage says {prompt} prompt tokens; the request sent {sent}"
        if self.saw_ids and out != self.tokens:
            return f"bad_response: usage says {out} completion tokens; the stream carried {self.tokens}"
        if self.finish_reason is None:
            return "bad_response: no choice finished (finish_reason missing) before [DONE]"
        self.usage_prompt, self.usage_out, self.cached = prompt, out, cached
        return None


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_models(raw: bytes) -> list[ServedModel]:
    """``GET /v1/models`` -> served models (vLLM's entry fields); ValueError on anything else."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"/v1/models is not JSON: {exc}") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models has no 'data' list")
    out = []
    for m in data:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str) or not m["id"]:
            raise ValueError(f"/v1/models entry without an id: {m!r}")
        mml = m.get("max_model_len")
        out.append(ServedModel(
            id=m["id"], object=str(m.get("object") or "model"),
            created=m["created"] if _count(m.get("created")) else 0,
            owned_by=str(m.get("owned_by") or "vllm"),
            root=m["root"] if isinstance(m.get("root"), str) else None,
            parent=m["parent"] if isinstance(m.get("parent"), str) else None,
            max_model_len=mml if _count(mml) else None,
        ))
    return out


def _dropped(exc: BaseException) -> bool:
    """The connection closed before the server answered: a stale keep-alive connection, worth
    one more try on a fresh one (a server that is gone refuses that one: ConnectError)."""
    import httpx

    return isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))


def _error(message: str, prompt_tokens: int = 0, output_tokens: int = 0) -> EngineOutput:
    return EngineOutput(0, finished=True, finish_reason="error", prompt_tokens=prompt_tokens,
                        output_tokens=output_tokens, error=message)


def _http_error(status: int, body: bytes, prompt_tokens: int) -> EngineOutput:
    """A refused request: the server's own message, under a code by status."""
    try:
        parsed = orjson.loads(body)
        err = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        message = err.get("message") if isinstance(err, dict) else str(err)
    except orjson.JSONDecodeError:
        message = body[:200].decode("utf-8", "replace") or "(empty body)"
    message = f"HTTP {status}: {message}"
    low = message.lower()
    if status in (429, 503):
        code = "server_busy"
    elif status >= 500:
        code = "server_error"
    elif "context length" in low or "max_model_len" in low or "too long" in low:
        code = "prompt_too_long"
    else:
        code = "invalid_request"
    return _error(f"{code}: {message}", prompt_tokens=prompt_tokens)
