"""ServerEngine against bad (and good) server answers, and SGLang's documented formats.

The server here is a **fake**: a small real Starlette app on uvicorn on loopback that answers
``/v1/models``, ``/metrics`` and streaming ``/v1/completions`` as vLLM does (field for field, as
captured from ``vllm serve`` 0.32) — or, chosen by the prompt, wrongly: not JSON, HTTP 500, a
truncated stream, impossible usage. A real vLLM cannot be made to misbehave on cue; the real
server's good answers are covered by ``test_vllm_server.py``. SGLang cannot run here (no CPU
build): its metrics page and KV events are fixtures of its documented formats
(``docs/references/production_metrics.md``, ``python/sglang/srt/disaggregation/kv_events.py``).
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from natsched.bus.server import free_port
from natsched.wire.blocks import root_hash, token_block_hashes
from natsched.workers.engine import EngineRequest
from natsched.workers.errors import EngineStartError
from natsched.workers.kv_events import KvTranslator, decode_batch
from natsched.workers.server_metrics import MetricsError, parse_metrics
from natsched.workers.vllm_server import ServerEngine, ServerSettings
from tests.factories.core import wait_for

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 7.0
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.79e+09
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 192.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.79615708679e+09
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="256",enable_prefix_caching="True"} 1.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.79e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.80e+09
"""

#: the page SGLang documents (docs/references/production_metrics.md), trimmed
SGLANG_METRICS = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
# HELP sglang:max_total_num_tokens Maximum total number of tokens
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 161721.0
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 162.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2826.0
"""

MODELS = {"object": "list", "data": [
    {"id": "tiny", "object": "model", "created": 1796157162, "owned_by": "vllm", "root": "/models/tiny",
     "parent": None, "max_model_len": 1024},
    {"id": "sql-lora", "object": "model", "created": 1796157162, "owned_by": "vllm", "root": "/adapters/sql",
     "parent": "tiny", "max_model_len": None},
]}


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


def _chunk(text="", ids=None, finish=None, prompt_ids=None, with_ids=True):
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    if with_ids:
        choice.update(prompt_token_ids=prompt_ids, token_ids=ids)
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny", "choices": [choice]}


def _usage(prompt, out, cached):
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


class Fake:
    """The fake server's state: what it answers, what it saw."""

    def __init__(self) -> None:
        self.metrics = VLLM_METRICS
        self.bodies: list[dict] = []
        self.with_ids = True
        self.closed = asyncio.Event()
        self.auth: list[str | None] = []  # the authorization header of every /metrics scrape
        self.hold = asyncio.Event()  # a "held" prompt sends nothing until this is set (a queued prefill)

    def app(self) -> Starlette:
        async def models(_: Request):
            return JSONResponse(MODELS)

        async def metrics(request: Request):
            self.auth.append(request.headers.get("authorization"))
            return PlainTextResponse(self.metrics)

        async def exporter(_: Request):  # a page elsewhere (a sidecar exporter, a proxy's path)
            return PlainTextResponse(self.metrics.replace('model_name="tiny"} 3.0', 'model_name="tiny"} 5.0', 1))

        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            mode = body["prompt"] if isinstance(body["prompt"], str) else "ok"
            pids = body["prompt"] if isinstance(body["prompt"], list) else [1, 50, 51, 52]
            if mode == "http500":
                return JSONResponse({"error": {"message": "EngineCore died", "type": "InternalServerError",
                                               "code": 500}}, status_code=500)
            if mode == "toolong":
                return JSONResponse({"error": {"message": "This model's maximum context length is 1024 tokens",
                                               "type": "BadRequestError", "code": 400}}, status_code=400)
            if mode == "html500":
                return PlainTextResponse("<html>bad gateway</html>", status_code=502)
            return StreamingResponse(self.stream(mode, pids), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics),
                                 Route("/exporter/metrics", exporter),
                                 Route("/v1/completions", completions, methods=["POST"])])

    async def stream(self, mode: str, pids: list[int]):
        w = self.with_ids
        if mode == "held":
            await self.hold.wait()
        yield _sse(_chunk(" a", [10], prompt_ids=pids, with_ids=w))
        if mode == "nonjson":
            yield b"data: {this is not json\n\n"
            return
        if mode == "truncated":
            return  # the connection ends: no finish, no usage, no [DONE]
        if mode == "stall":
            try:
                while True:
                    await asyncio.sleep(0.05)
                    yield _sse(_chunk(" x", [11], with_ids=w))
            finally:
                self.closed.set()
        yield _sse(_chunk(" b", [12], finish="length", with_ids=w))
        if mode != "nousage":
            prompt = len(pids) + (5 if mode == "badprompt" else 0)
            cached = prompt + 1 if mode == "badcached" else 32 if prompt > 32 else 0
            out = 3 if mode == "badcount" else 2
            yield _sse(_usage(prompt, out, cached))
        yield b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def fake_server(fake: Fake, port: int | None = None):
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def engine_for(url: str, **kw):
    eng = ServerEngine(ServerSettings(url=url, scrape_interval_s=0.05, start_timeout_s=5, **kw))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


def req(prompt=None, ids=None, max_tokens=2, rid="r1", prompt_tokens=4, expected_cached_tokens=0):
    return EngineRequest(id=rid, prompt_tokens=prompt_tokens, hashes=[], max_tokens=max_tokens, prompt=prompt,
                         prompt_token_ids=ids, expected_cached_tokens=expected_cached_tokens)


async def run(eng, r):
    return [o async for o in eng.generate(r)]


async def test_a_good_stream_gives_tokens_and_the_servers_usage():
    fake = Fake()
    async with fake_server(fake) as (url, _), engine_for(url, ignore_eos=True) as eng:
        outs = await run(eng, req(ids=list(range(1, 41))))
        final = outs[-1]
        assert final.error is None and final.finish_reason == "length"
        assert (final.prompt_tokens, final.cached_tokens, final.output_tokens) == (40, 32, 2)
        assert [t for o in outs for t in (o.token_ids or [])] == [10, 12]
        body = fake.bodies[-1]
        assert body["prompt"] == list(range(1, 41)) and body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"] is True
        # what the server serves, with vLLM's fields; the adapter knows its base
        assert [(m.id, m.parent, m.max_model_len) for m in eng.served_models()] == \
            [("tiny", None, 1024), ("sql-lora", "tiny", None)]


@pytest.mark.parametrize("prompt,code,words", [
    ("nonjson", "bad_response", "not JSON"),
    ("http500", "server_error", "EngineCore died"),
    ("html500", "server_error", "HTTP 502"),
    ("toolong", "prompt_too_long", "maximum context length"),
    ("truncated", "bad_response", "truncated"),
    ("nousage", "bad_response", "without usage"),
    ("badcached", "bad_response", "cached_tokens"),
    ("badcount", "bad_response", "completion tokens"),
])
async def test_bad_answers_become_clear_request_errors(prompt, code, words):
    async with fake_server(Fake()) as (url, _), engine_for(url) as eng:
        final = (await run(eng, req(prompt=prompt)))[-1]
        assert final.finished and final.finish_reason == "error"
        assert final.error.startswith(code + ": ") and words in final.error, final.error


async def test_usage_that_miscounts_a_token_prompt_is_an_error():
    fake = Fake()
    async with fake_server(fake) as (url, _), engine_for(url) as eng:
        # the fake's "badprompt" adds 5 prompt tokens; token prompts are checked against what was sent
        fake_stream = fake.stream
        fake.stream = lambda mode, pids: fake_stream("badprompt", pids)
        final = (await run(eng, req(ids=[1, 2, 3])))[-1]
        assert final.error.startswith("bad_response: usage says 8 prompt tokens; the request sent 3")


async def test_abort_closes_the_stream_and_the_server_sees_it():
    fake = Fake()
    async with fake_server(fake) as (url, _), engine_for(url) as eng:
        outs = []
        async for out in eng.generate(req(prompt="stall")):
            outs.append(out)
            if len(outs) == 3:
                await eng.abort("r1")
        assert outs[-1].finish_reason == "abort" and outs[-1].error is None
        await asyncio.wait_for(fake.closed.wait(), 10)  # the server's generator was closed


async def test_queued_prefill_is_the_uncached_prompt_until_its_first_token():
    """What the router's backlog estimate reads: the prompt less what it expected cached, for as
    long as the server has sent nothing of the request; then nothing."""
    fake = Fake()
    async with fake_server(fake) as (url, _), engine_for(url) as eng:
        task = asyncio.create_task(run(eng, req(prompt="held", prompt_tokens=4000, expected_cached_tokens=3000)))
        assert await wait_for(lambda: fake.bodies)
        st = eng.stats()
        assert st.queued_prefill_tokens == 1000 and st.runtime_tokens >= 1000
        fake.hold.set()
        assert (await task)[-1].error is None
        assert eng.stats().queued_prefill_tokens == 0


async def test_a_consumer_that_stops_reading_closes_the_stream():
    fake = Fake()
    async with fake_server(fake) as (url, _), engine_for(url) as eng:
        gen = eng.generate(req(prompt="stall"))
        await gen.__anext__()
        await gen.aclose()  # what a cancelled agent task does
        await asyncio.wait_for(fake.closed.wait(), 10)


async def test_a_silent_server_is_unreachable_then_back_in_a_new_epoch():
    fake = Fake()
    port = free_port()
    async with fake_server(fake, port) as (url, _):
        eng = ServerEngine(ServerSettings(url=url, scrape_interval_s=0.05))
        await eng.start()
    try:
        epoch = eng.epoch
        for _ in range(200):  # the scraper notices within a few of its periods
            if eng.stats().unreachable_s > 0:
                break
            await asyncio.sleep(0.05)
        st = eng.stats()
        assert st.unreachable_s > 0 and "metrics" in st.unreachable_reason
        final = (await run(eng, req(ids=[1, 2])))[-1]  # fails at once, clearly
        assert final.error.startswith("server_unavailable: ")
        async with fake_server(fake, port):
            for _ in range(200):
                if eng.stats().unreachable_s == 0:
                    break
                await asyncio.sleep(0.05)
            assert eng.stats().unreachable_s == 0 and eng.epoch > epoch  # back, its cache view starts anew
            assert (await run(eng, req(ids=[1, 2])))[-1].error is None
    finally:
        await eng.stop()


class DroppingProxy:
    """A real TCP proxy in front of the fake that closes a connection on cue, at the start of a
    request, without an answer: what a server's idle keep-alive timeout does to a pooled
    connection reused as it expires (vLLM's uvicorn and httpx both default to 5 s).
    ``drop`` holds request-line prefixes (``b"GET /metrics"``); each is dropped once."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.drop: list[bytes] = []
        self.dropped: list[bytes] = []

    async def _pump(self, reader, writer) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        back = asyncio.create_task(self._pump(up_reader, writer))
        try:
            while data := await reader.read(65536):
                hit = next((d for d in self.drop if data.startswith(d)), None)
                if hit is not None:
                    self.drop.remove(hit)
                    self.dropped.append(hit)
                    break  # closed without forwarding: the client sees no answer
                up_writer.write(data)
                await up_writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            up_writer.close()
            back.cancel()

    @contextlib.asynccontextmanager
    async def running(self):
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()


async def test_a_connection_dropped_under_a_scrape_is_tried_again_not_a_server_down():
    """One scrape on a connection the server closed must not mark the server down: that failed
    every request routed to a healthy ``vllm serve`` until the next scrape (a CI run saw it)."""
    async with fake_server(Fake()) as (_, port):
        proxy = DroppingProxy(port)
        async with proxy.running() as url, engine_for(url) as eng:
            proxy.drop = [b"GET /metrics", b"GET /v1/models"]
            assert await wait_for(lambda: not proxy.drop)
            scrapes = eng.scrapes
            assert await wait_for(lambda: eng.scrapes >= scrapes + 2)
            assert eng.scrape_failures == 0 and eng.stats().unreachable_s == 0
            assert (await run(eng, req(ids=[1, 2])))[-1].error is None


async def test_a_request_whose_connection_drops_before_an_answer_is_sent_again_once():
    fake = Fake()
    async with fake_server(fake) as (_, port):
        proxy = DroppingProxy(port)
        async with proxy.running() as url, engine_for(url) as eng:
            proxy.drop = [b"POST /v1/completions"]
            final = (await run(eng, req(ids=list(range(1, 41)))))[-1]
            assert final.error is None and final.output_tokens == 2
            assert proxy.dropped == [b"POST /v1/completions"] and len(fake.bodies) == 1  # ran once
            # dropped twice: a clear error for the producer's retry policy, and no server down
            # (only a refused connection says the server is gone)
            proxy.drop = [b"POST /v1/completions", b"POST /v1/completions"]
            final = (await run(eng, req(ids=[1, 2], rid="r2")))[-1]
            assert final.error.startswith("server_unavailable: RemoteProtocolError"), final.error
            assert len(fake.bodies) == 1 and eng.stats().unreachable_s == 0


async def test_a_server_that_never_answers_fails_the_start_clearly():
    eng = ServerEngine(ServerSettings(url=f"http://127.0.0.1:{free_port()}", start_timeout_s=1))
    with pytest.raises(EngineStartError, match="did not answer"):
        await eng.start()


async def test_a_model_the_server_does_not_serve_fails_the_start():
    async with fake_server(Fake()) as (url, _):
        with pytest.raises(EngineStartError, match="does not serve 'other'"):
            await ServerEngine(ServerSettings(url=url, model="other")).start()


def test_vllm_metrics_are_read_as_load():
    load = parse_metrics(VLLM_METRICS)
    assert (load.running, load.waiting, load.kv_usage, load.preemptions) == (3, 2, 0.25, 7)
    assert (load.prefix_queries, load.prefix_hits, load.block_size, load.kv_total_blocks) == (400, 192, 32, 256)
    assert load.active_adapters == {"sql-lora"}  # the newest label set is the current batch
    assert load.process_start == pytest.approx(1.79615708679e9) and load.prefix_caching is True


def test_sglang_documented_metrics_are_read_as_load():
    load = parse_metrics(SGLANG_METRICS, "sglang")
    assert (load.running, load.waiting, load.kv_usage) == (162, 2826, 0.28)
    assert load.kv_total_tokens == 161721 and load.hit_rate == pytest.approx(0.0075, rel=1e-2)
    assert load.preemptions is None  # SGLang documents no preemption counter


async def test_load_is_the_mean_of_the_scrapes_in_the_window_and_the_servers_counters_pass_through():
    fake = Fake()
    async with fake_server(fake) as (url, _), engine_for(url, stats_window_s=600.0) as eng:
        assert await wait_for(lambda: len(eng.window._samples) >= 3)  # scrapes of 3 running, 2 waiting
        st = eng.stats()
        assert (st.running, st.waiting, st.kv_used_blocks) == (3, 2, 64)  # 0.25 of 256 blocks
        assert (st.preemptions, st.prefix_cache_queries, st.prefix_cache_hits) == (7, 400, 192)
        fake.metrics = VLLM_METRICS.replace('model_name="tiny"} 3.0', 'model_name="tiny"} 9.0', 1)
        assert await wait_for(lambda: eng.last_load.running == 9)
        # a heartbeat plans with the window's mean: the scrapes of 3 still count (the last alone says 9)
        samples = [s.running for _, s in eng.window._samples]
        assert 9 in samples and eng.stats().running < 9


async def test_the_metrics_url_and_api_key_flags_reach_the_server():
    """``natsched worker --metrics-url URL --api-key KEY``: load read from that page, the key sent."""
    from natsched.cli.app import build_parser
    from natsched.cli.up import server_settings

    fake = Fake()
    async with fake_server(fake) as (url, _):
        args = build_parser().parse_args(["worker", "--id", "m1", "--engine", "vllm-server", "--url", url,
                                          "--metrics-url", f"{url}/exporter/metrics", "--api-key", "k-123"])
        settings = server_settings(args)
        assert settings.api_key == "k-123"
        settings.scrape_interval_s = 0.05
        eng = ServerEngine(settings)
        await eng.start()
        try:
            assert await wait_for(lambda: eng.last_load.running == 5)  # the exporter's page, not /metrics
            assert fake.auth == []
        finally:
            await eng.stop()
        async with engine_for(url, api_key="k-123"):
            assert await wait_for(lambda: fake.auth)
        assert set(fake.auth) == {"Bearer k-123"}


@pytest.mark.parametrize("text", ["", "<html>nope</html>", "vllm:num_requests_running{ 3", "other_metric 1\n"])
def test_pages_that_are_not_load_pages_are_refused(text):
    with pytest.raises(MetricsError):
        parse_metrics(text)


async def test_sglang_flavour_streams_without_token_ids_and_reads_its_metrics():
    fake = Fake()
    fake.metrics, fake.with_ids = SGLANG_METRICS, False
    async with fake_server(fake) as (url, _), engine_for(url, flavor="sglang", block_size=32) as eng:
        final = (await run(eng, req(prompt="ok")))[-1]
        assert final.error is None and final.output_tokens == 2  # from its usage alone
        assert "return_token_ids" not in fake.bodies[-1]
        assert eng.kv_total_blocks == 161721 // 32 and eng.stats().capacity_tokens == (161721 // 32) * 32


# --- SGLang's KV events: its documented msgspec structs (array-encoded, no medium) -------------
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemoved(_Event):
    block_hashes: list[int]


class AllBlocksCleared(_Event):
    pass


def test_sglang_kv_events_translate_into_natsched_hashes():
    tokens = list(range(100, 164))
    payload = msgspec.msgpack.encode(_Batch(1.0, [
        BlockStored([901, 902], None, tokens, 32, None),
        BlockRemoved([902]),
    ]))
    tr = KvTranslator("llama", 32)
    _, events = decode_batch(payload)
    deltas = tr.apply_batch(events)
    ours = token_block_hashes(tokens, 32, root_hash("llama"))
    assert deltas == [("stored", ours), ("removed", [ours[1]])]
    _, events = decode_batch(msgspec.msgpack.encode(_Batch(2.0, [AllBlocksCleared()])))
    assert tr.apply_batch(events) == [("cleared", [])] and tr.cached_hashes() == []


def test_a_lora_adapters_blocks_chain_from_its_own_name():
    tokens = list(range(32))
    tr = KvTranslator("tiny", 32)
    deltas = tr.apply_batch([{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
                              "token_ids": tokens, "block_size": 32, "lora_id": 1, "lora_name": "sql-lora",
                              "medium": "GPU"}])
    assert deltas == [("stored", token_block_hashes(tokens, 32, root_hash("sql-lora")))]


async def test_adapters_loaded_at_run_time_are_announced():
    fake = Fake()
    async with fake_server(fake) as (url, _), engine_for(url, models_every_s=0.1) as eng:
        assert [m.id for m in eng.served_models()] == ["tiny", "sql-lora"]
        MODELS["data"].append({"id": "chat-lora", "object": "model", "created": 1, "owned_by": "vllm",
                               "root": "/adapters/chat", "parent": "tiny", "max_model_len": None})
        try:
            for _ in range(200):
                if len(eng.served_models()) == 3:
                    break
                await asyncio.sleep(0.05)
            assert [m.id for m in eng.served_models()] == ["tiny", "sql-lora", "chat-lora"]
            assert eng.model == "tiny"  # the worker's own model stays
        finally:
            MODELS["data"].pop()


def _frames(seq: int, events) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, events])]


def _stored(h, parent, tokens):
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 32, "lora_id": None, "medium": "GPU"}


@pytest.mark.parametrize("second", ["gap", "restart", "cleared"])
async def test_lost_events_a_restarted_sequence_or_a_cleared_cache_void_the_view_in_a_new_epoch(second):
    fake = Fake()
    async with fake_server(fake) as (url, _), \
            engine_for(url, kv_events=f"tcp://127.0.0.1:{free_port()}") as eng:  # nothing publishes there
        seen: list[str] = []
        eng.set_cache_listener(lambda kind, hashes: seen.append(kind))
        eng._sub.handle_frames(_frames(4, [_stored(1, None, list(range(32)))]))
        assert eng.cached_hashes() and seen == ["stored"]
        epoch = eng.epoch
        await asyncio.sleep(0.01)
        frames = {"gap": _frames(9, []), "restart": _frames(0, []),
                  "cleared": _frames(5, [{"type": "AllBlocksCleared"}])}[second]
        eng._sub.handle_frames(frames)
        assert eng.cached_hashes() == [] and "cleared" in seen
        assert eng.epoch > epoch  # the agent re-registers the worker with the router


async def test_a_resumed_request_sends_its_output_after_the_prompt_or_is_refused_clearly():
    """A migrated stream (``resume_token_ids``): a token prompt goes out as prompt + those ids (its
    usage checked against both); a text prompt needs the server's ``POST /tokenize``, which this
    fake, like a server without it, does not answer: ``resume_unsupported``, nothing generated."""
    fake = Fake()
    async with fake_server(fake) as (url, _), engine_for(url) as eng:
        r = req(ids=list(range(1, 41)), prompt_tokens=43)
        r.resume_token_ids = [7, 8, 9]
        final = (await run(eng, r))[-1]
        assert final.error is None and fake.bodies[-1]["prompt"] == list(range(1, 41)) + [7, 8, 9]
        assert final.prompt_tokens == 43
        sent = len(fake.bodies)
        r = req(prompt="hello there")
        r.resume_token_ids = [7]
        final = (await run(eng, r))[-1]
        assert final.finish_reason == "error" and final.error.startswith("resume_unsupported:"), final.error
        assert len(fake.bodies) == sent  # no completion was asked for
