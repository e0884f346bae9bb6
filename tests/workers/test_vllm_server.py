"""Worker agents fronting real ``vllm serve`` processes (engine ``vllm-server``), end to end.

Two real OpenAI servers (the tiny dummy-weights model with its byte-level BPE tokenizer, KV
events on, CPU; ``s1`` also serves a LoRA adapter, ``ada``), one agent each, behind a real
nats-server, admitter and router: prompts stream back, the server's own usage reports cached
tokens, its KV events become ``worker.<id>.kv`` blocks, a cancel aborts on the server, an
adapter's requests run where it is served and answer differently, a killed server sends its agent
to backoff and away and its requests end with ``server_unavailable``, a restarted one is
re-learned. The servers start once for the module (slow on shared cores); every wait is on
/health or on a bus event.

Sampling is greedy (``temperature`` 0), so one prompt gets one answer from one model.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.bus.connection import Bus
from natsched.bus.server import free_port
from natsched.client.errors import Rejected, RequestFailed
from natsched.client.producer import Client, Timeouts, make_request
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from natsched.wire import subjects as S
from natsched.wire.blocks import request_block_hashes
from natsched.wire.schema import CacheEvent, Control, Heartbeat
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.engine import EngineRequest
from natsched.workers.server_metrics import parse_metrics
from natsched.workers.tiny_model import LIVE_LAYERS, write_tiny_lora, write_tiny_model
from natsched.hosting.vllm_serve import VllmServe
from natsched.workers.vllm_server import ServerEngine, ServerSettings
from tests.conftest import wipe
from tests.factories.core import apply_cache_event, submit_shared_prefix, wait_for

pytestmark = pytest.mark.vllm

MODEL = "tiny"
ADAPTER = "ada"  # a LoRA adapter of MODEL that s1 serves
WORKERS = ("s1", "s2")
#: heartbeats a worker may miss before the admitter takes its work back (6 s at 0.3 s, not 0.9 s):
#: no test here kills an agent, and a loaded 2-core machine can delay a live agent's heartbeats
LEASE_MISSED = 20


class Watch:
    """What the bus says: each worker's announced cache and its heartbeats."""

    def __init__(self) -> None:
        self.cache: dict[str, set[int]] = {}
        self.kinds: dict[str, list[str]] = {}
        self.hb: dict[str, Heartbeat] = {}
        self.states: dict[str, list[str]] = {}

    async def on_kv(self, subject, data, headers) -> None:
        ev = CacheEvent.decode(data)
        self.kinds.setdefault(ev.worker, []).append(ev.kind)
        apply_cache_event(self.cache.setdefault(ev.worker, set()), ev)

    async def on_hb(self, subject, data, headers) -> None:
        hb = Heartbeat.decode(data)
        self.hb[hb.worker] = hb
        states = self.states.setdefault(hb.worker, [])
        if not states or states[-1] != hb.state:
            states.append(hb.state)


@pytest.fixture(scope="module")
async def system(nats_url, tmp_path_factory):
    # deep enough that the server's streams, /metrics and disconnect checks answer during a run
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-serve"), tokenizer=True, layers=LIVE_LAYERS)
    # weights of about one: the dummy base weights are ~1e-3, so the adapter changes every answer
    lora = write_tiny_lora(tmp_path_factory.mktemp("tiny-lora"), scale=1.0, layers=LIVE_LAYERS)
    lora_args = {"s1": ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={lora}"]}
    servers = {w: VllmServe(path, MODEL, port=free_port(), kv_port=free_port(), replay_port=free_port(),
                            max_model_len=1024, kv_cache_blocks=256, max_num_seqs=8,
                            extra_args=lora_args.get(w, ())).start() for w in WORKERS}
    buses: list[Bus] = []
    agents: dict[str, WorkerAgent] = {}

    async def connect(name):
        b = await Bus.connect(nats_url, name=name)
        buses.append(b)
        return b

    try:
        await asyncio.gather(*(asyncio.to_thread(s.wait_ready, 400) for s in servers.values()))
        bus = await connect("test-vllm-server")
        await wipe(bus)
        await bus.provision()
        watch = Watch()
        await bus.subscribe(S.CACHE_EVENTS_ALL, watch.on_kv)
        await bus.subscribe("worker.*.hb", watch.on_hb)
        admitter = AdmitterService(await connect("admitter"), AdmitterServiceSettings(lease_missed=LEASE_MISSED))
        await admitter.start()
        router = RouterService(await connect("router"),  # a starved machine may hide both workers for seconds
                               RouterServiceSettings(core=RouterSettings(policy="natsched", block_size=32),
                                                     no_worker_wait_s=60))
        await router.start()
        for w, srv in servers.items():
            engine = ServerEngine(ServerSettings(url=srv.url, kv_events=srv.kv_endpoint, kv_replay=srv.replay_endpoint,
                                                 ignore_eos=True, temperature=0.0, scrape_interval_s=0.3))
            await engine.discover()
            agent = WorkerAgent(await connect(w), engine, WorkerSettings(
                id=w, model=engine.model, concurrency=4, heartbeat_interval_s=0.3, unreachable_leave_s=1.5))
            await agent.start()
            agents[w] = agent
        assert await wait_for(lambda: set(router.core.workers) == set(WORKERS), timeout=30)
        client = Client(await connect("producer"), Timeouts(admission=30, idle=120))
        yield type("System", (), dict(client=client, router=router, agents=agents, servers=servers, watch=watch,
                                      admitter=admitter))
    finally:
        for a in agents.values():
            await a.stop()
        for b in buses:
            await b.close()
        for s in servers.values():
            s.stop()


async def metrics_text(srv: VllmServe) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{srv.url}/metrics", timeout=10)).text


async def generated_on(srv: VllmServe) -> float:
    """The server's own count of tokens it generated (``vllm:generation_tokens_total``)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in (await metrics_text(srv)).splitlines()
               if line.startswith("vllm:generation_tokens_total"))


async def running_on(srv: VllmServe) -> float:
    return parse_metrics(await metrics_text(srv)).running


@contextlib.asynccontextmanager
async def only(system, worker: str):
    """Route to ``worker`` alone for a while: the others are drained (real control messages), then resumed."""
    others = [w for w in WORKERS if w != worker]
    for w in others:
        await system.client.bus.publish(S.control(w), Control(kind="drain", ts=time.time(), by="test"))
    assert await wait_for(lambda: all(system.router.core.workers[w].state == "quiescing" for w in others), 60)
    try:
        yield
    finally:
        for w in others:
            await system.client.bus.publish(S.control(w), Control(kind="resume", ts=time.time(), by="test"))
        assert await wait_for(lambda: all(system.router.core.workers[w].state == "healthy" for w in others), 60)


async def test_agents_announce_what_their_servers_serve(system):
    for w in WORKERS:
        view = system.router.core.workers[w]
        assert view.model == MODEL and view.block_size == 32 and view.kv_total_blocks == 256
        hb = system.watch.hb[w]
        card = hb.served[0]
        assert card.id == MODEL and card.max_model_len == 1024 and card.owned_by == "vllm" and card.parent is None
    # the adapter, as s1's server lists it in /v1/models: a child of the base model
    assert [(m.id, m.parent) for m in system.watch.hb["s1"].served] == [(MODEL, None), (ADAPTER, MODEL)]
    assert [m.id for m in system.watch.hb["s2"].served] == [MODEL]
    assert system.router.core.workers["s1"].serves == {MODEL, ADAPTER}
    assert await wait_for(lambda: system.admitter.core.served_models == {MODEL, ADAPTER})


async def _greedy_ids(client, model: str, prompt: list[int]) -> tuple[list[int], str]:
    stream = client.stream(make_request("t7", prompt_token_ids=prompt, model=model, max_tokens=8))
    ids = [t async for c in stream for t in (c.token_ids or [])]
    assert stream.result.status == "completed" and stream.result.output_tokens == 8 == len(ids)
    return ids, stream.result.worker


async def test_an_adapters_requests_run_where_it_is_served_and_answer_differently(system):
    client = system.client
    prompt = [1] + [40 + (i * 7) % 900 for i in range(40)]
    async with only(system, "s1"):
        base, _ = await _greedy_ids(client, MODEL, prompt)
    for i in range(3):  # both workers take work: only s1 serves the adapter
        ids, worker = await _greedy_ids(client, ADAPTER, prompt[:-1] + [900 + i])
        assert worker == "s1"
    adapted, worker = await _greedy_ids(client, ADAPTER, prompt)
    assert worker == "s1" and adapted != base  # the same greedy prompt: the adapter's weights answered


async def test_the_servers_lora_report_stamps_an_adapter_while_it_runs_and_clears_after(system):
    """vllm serve's own ``vllm:lora_requests_info``: at each engine step it stamps the label set of
    the adapters running or waiting with the time, so the newest set is the batch now. An adapter's
    run stamps a set naming it; the step that finishes the run stamps the empty set, after it.

    Not scraped during the run: the tiny model steps faster than the server's API process handles
    its outputs, and /metrics then waits behind them until the run is over (seen: 2.4 s of a 2.4 s
    run, in 5 of 8 tries). The agent does not rely on the scrape for its own runs (next test)."""
    srv = system.servers["s1"]

    def stamps(text: str) -> dict[str, float]:
        """running adapters -> when the server last stamped that set."""
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:lora_requests_info{"):
                running = line.split('running_lora_adapters="', 1)[1].split('"', 1)[0]
                out[running] = float(line.rsplit(" ", 1)[1])
        return out

    before = time.time()
    async with httpx.AsyncClient() as http:
        body = {"model": ADAPTER, "prompt": [1, 5, 6, 7], "max_tokens": 64, "ignore_eos": True}
        resp = await http.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 64
    text = await metrics_text(srv)
    got = stamps(text)
    assert got.get(ADAPTER, 0.0) >= before  # stamped during the run (one clock: the same machine)
    assert got.get("", 0.0) >= got[ADAPTER]  # the finishing step came after it
    assert ADAPTER not in parse_metrics(text).active_adapters


async def test_an_adapter_in_the_servers_batch_is_announced_loaded_while_it_runs(system):
    """A request for an adapter running on s1 -> ``active`` in s1's heartbeat -> the router's
    view, which prefers such a worker for that adapter; once no request of it runs (a base-model
    step cleared the server's report), not active.

    The agent marks the adapters of its own open streams at once and adds the server's report of
    its batch at each scrape. With the scrape alone this failed 2 of 3 times beside two CPU hogs:
    the server answers /metrics only once the run is over (previous test). Back-to-back requests
    keep a stream open however late a heartbeat comes."""
    client, watch, router = system.client, system.watch, system.router

    def ada_active() -> bool:
        return "s1" in watch.hb and any(m.id == ADAPTER and m.active for m in watch.hb["s1"].served)

    def announced() -> bool:
        return ada_active() and ADAPTER in router.core.workers["s1"].active

    async def keep_it_running() -> None:
        for n in range(1000):
            # 4 prompt + 1016 output tokens fill the server's 1024-token context: the longest run
            req = make_request("t7", prompt_token_ids=[1, 5, 6, 7 + n], model=ADAPTER, max_tokens=1016)
            async for _chunk in client.stream(req):  # on s1, the one server that serves it
                pass

    async with only(system, "s1"):
        await client.submit(make_request("t7", prompt_token_ids=[1, 2, 3], model=MODEL, max_tokens=2))
    assert await wait_for(lambda: not ada_active(), timeout=30)
    lane = asyncio.create_task(keep_it_running())
    try:
        seen = await wait_for(lambda: announced() or lane.done(), timeout=120)
        if lane.done():
            lane.result()  # a stream that failed says why
        assert seen and announced()
    finally:
        lane.cancel()
        await asyncio.gather(lane, return_exceptions=True)
    async with only(system, "s1"):
        await client.submit(make_request("t7", prompt_token_ids=[1, 2, 4], model=MODEL, max_tokens=2))
    assert await wait_for(lambda: not ada_active() and ADAPTER not in router.core.workers["s1"].active, timeout=60)


async def test_a_model_or_adapter_nobody_serves_is_refused_naming_it(system):
    with pytest.raises(Rejected) as err:
        await system.client.submit(make_request("t7", prompt_token_ids=[1, 2, 3], model="bob", max_tokens=2))
    assert err.value.reason == "unknown_model"
    assert "'bob'" in str(err.value) and f"served: {ADAPTER}, {MODEL}" in str(err.value)


async def test_text_and_token_prompts_stream_back(system):
    client = system.client
    text_req = make_request("t1", "the quick brown fox asks the worker about the cache", model=MODEL, max_tokens=6)
    stream = client.stream(text_req)
    chunks = [c async for c in stream]
    assert stream.result.status == "completed" and stream.result.output_tokens == 6
    assert sum(len(c.token_ids or []) for c in chunks) == 6  # every token relayed, with its id
    assert stream.result.prompt_tokens > 5  # the server's tokenizer counted them
    ids_req = make_request("t1", prompt_token_ids=[1] + list(range(40, 90)), model=MODEL, max_tokens=5)
    stream = client.stream(ids_req)
    chunks = [c async for c in stream]
    assert stream.result.status == "completed"
    assert stream.result.prompt_tokens == 51 and stream.result.output_tokens == 5
    assert [t for c in chunks for t in (c.token_ids or [])] and all(0 <= t < 1024 for c in chunks
                                                                   for t in (c.token_ids or []))


async def test_a_migrated_stream_goes_on_where_it_stopped_on_the_server(system):
    """What a migration asks of a worker (``Request.resume_token_ids``): run prompt + the output
    so far and generate the rest. Greedy sampling makes it checkable: a text prompt's 12 tokens in
    one run, then the same prompt resumed after its first 5, by the server's own tokenizer
    (``POST /tokenize``), must give the other 7, and a token-id prompt likewise."""
    async def ids_of(request):
        stream = system.client.stream(request)
        ids = [t async for c in stream for t in (c.token_ids or [])]
        return ids, stream.result

    for prompt in ({"prompt": "the fox resumes the story where the dead worker stopped"},
                   {"prompt_token_ids": [1] + list(range(300, 340))}):
        whole, r = await ids_of(make_request("t1", model=MODEL, max_tokens=12, **prompt))
        assert len(whole) == 12 and r.output_tokens == 12
        rest, resumed = await ids_of(make_request("t1", model=MODEL, max_tokens=12, resume_token_ids=whole[:5],
                                                  **prompt))
        assert rest == whole[5:]
        assert (resumed.output_tokens, resumed.prompt_tokens) == (7, r.prompt_tokens + 5)


async def test_repeated_long_prefix_lands_on_its_holder_with_the_servers_cached_tokens(system):
    client, watch = system.client, system.watch
    prefix = [1] + [7 + (i * 13) % 1000 for i in range(255)]  # 8 blocks of 32 tokens
    results = await submit_shared_prefix(client, "t2", prefix, model=MODEL)
    first_req, first = results[0]
    prefix_hashes = request_block_hashes(first_req, 32)[:8]
    assert await wait_for(lambda: set(prefix_hashes) <= watch.cache.get(first.worker, set()), timeout=10)
    for _, res in results[1:]:
        assert res.worker == first.worker  # routed to where the prefix is cached
        assert res.cached_tokens >= 7 * 32  # as the server's own usage says (prompt_tokens_details)
    other = next(w for w in WORKERS if w != first.worker)
    assert not set(prefix_hashes) & watch.cache.get(other, set())


async def test_a_reader_that_connects_late_learns_the_servers_cache_from_its_replay_socket(system):
    srv = system.servers["s1"]
    prefix = [1] + [500 + i for i in range(95)]  # 3 blocks, served before the late reader exists
    async with only(system, "s1"):
        await system.client.submit(make_request("t6", prompt_token_ids=prefix, model=MODEL, max_tokens=2))
    late = ServerEngine(ServerSettings(url=srv.url, kv_events=srv.kv_endpoint, kv_replay=srv.replay_endpoint,
                                       ignore_eos=True))
    await late.start()
    try:
        outs = [o async for o in late.generate(EngineRequest(  # a new batch of events: the late reader joins
            id="late-1", prompt_tokens=64, hashes=[], max_tokens=1, prompt_token_ids=[1] + [700 + i for i in range(63)]))]
        assert outs[-1].error is None
        hashes = request_block_hashes(make_request("t6", prompt_token_ids=prefix, model=MODEL), 32)[:2]
        assert await wait_for(lambda: set(hashes) <= set(late.cached_hashes()), timeout=20)
        assert late._sub.replayed > 0
    finally:
        await late.stop()


async def test_a_text_prefix_is_announced_under_the_routers_text_hashes(system):
    client, watch = system.client, system.watch
    system_prompt = "You are the system prompt of the knowledge base; answer the user question about routing. " * 6
    req = make_request("t3", "which worker holds the prefix?", system_prompt=system_prompt, model=MODEL,
                       max_tokens=2)
    res = await client.submit(req)
    text_hashes = request_block_hashes(req, 32)
    assert res.status == "completed" and text_hashes
    assert await wait_for(lambda: text_hashes[0] in watch.cache.get(res.worker, set()), timeout=10)
    again = await client.submit(make_request("t3", "and which one is idle?", system_prompt=system_prompt,
                                             model=MODEL, max_tokens=2))
    assert again.worker == res.worker and again.cached_tokens > 0


async def test_a_cancel_stops_generation_on_the_server(system):
    """A cancel closes the agent's HTTP stream and vLLM aborts the request whose client went away.

    The LIVE_LAYERS model makes 900 tokens in ~15 s beside two CPU hogs; a test process stalled
    that long by a loaded machine sees its second token only after the server finished them all,
    and no cancel can stop what is done. So the experiment runs up to three times with fresh
    requests: lost cancels make every run generate all 900 tokens, a stall spoils one run."""
    client = system.client
    srv = system.servers["s1"]
    made = []
    for attempt in range(3):
        before = await generated_on(srv)
        req = make_request("t4", prompt_token_ids=[1, 5, 6, 7 + attempt], model=MODEL, max_tokens=900)
        async with only(system, "s1"):
            got = 0
            async for chunk in client.stream(req):
                got += len(chunk.token_ids or [])
                if got >= 2:
                    break  # leaving the loop cancels the request on its worker
            assert await wait_for(lambda: req.id in system.agents["s1"].finished, timeout=30)
        # the server runs nothing any more, and stopped short of the 900 tokens it was asked for
        assert await wait_for(lambda: _idle(srv), timeout=30)
        made.append(await generated_on(srv) - before)
        if made[-1] < 900:
            break
    assert made[-1] < 900, made


async def _idle(srv: VllmServe) -> bool:
    return (await running_on(srv)) == 0


async def test_a_killed_server_sends_its_agent_away_and_a_restart_is_relearned(system):
    client, router, watch = system.client, system.router, system.watch
    w = "s2"
    srv, agent = system.servers[w], system.agents[w]
    started_before = watch.hb[w].started_at
    # killed at its first token, mid-generation (it had 1020 to go). A test process stalled for
    # a second or two by a loaded machine sees that token only after the tiny model made all
    # 1020, and the buffered stream then completes whatever happens to the server: such a run
    # proves nothing, so the server is started again and the experiment repeated (at most 3)
    failed = None
    for attempt in range(3):
        long = make_request("t5", prompt_token_ids=[1, 9, 8, 7 + attempt], model=MODEL, max_tokens=1020)
        got = 0
        async with only(system, w):
            # what a producer gets when the server under a live agent dies: the agent says so at
            # once, ``server_unavailable``; it is not re-run behind the producer's back (the agent
            # is alive, so no lease expires; tokens were streamed) — Retry() would try it elsewhere
            try:
                async for chunk in client.stream(long):
                    got += len(chunk.token_ids or [])
                    if got and srv.proc.poll() is None:
                        await asyncio.to_thread(srv.kill)  # (off the loop: reaping vLLM's processes takes a while)
            except RequestFailed as exc:
                failed = exc
        if failed is not None:
            break
        srv.start()
        await asyncio.to_thread(srv.wait_ready, 400)
        assert await wait_for(lambda: router.core.workers[w].state == "healthy", timeout=60)
    assert failed is not None, "every run's stream completed before its server was killed"
    assert failed.reason == "server_unavailable", failed  # a clear reason, nothing hangs
    assert 0 < got < 1020
    assert await wait_for(lambda: "quiescing" in watch.states[w][-1:], timeout=30)
    assert "backoff" in watch.states[w]  # backed off first, then left
    assert router.core.registry.state(w, time.time()) != "healthy"
    # a request now goes to the live worker only
    res = await client.submit(make_request("t5", prompt_token_ids=[1, 2, 3], model=MODEL, max_tokens=2))
    assert res.worker == "s1"
    srv.start()
    await asyncio.to_thread(srv.wait_ready, 400)
    assert await wait_for(lambda: watch.hb[w].state == "healthy" and watch.hb[w].started_at > started_before, timeout=60)
    assert await wait_for(lambda: router.core.workers[w].state == "healthy", timeout=30)  # re-registered, fresh again
    assert not router.core.index.untrusted() & {w}
    assert watch.kinds[w][-1] in ("snapshot", "stored", "removed")
    # it serves again, and its cache is re-learned from the new server's events
    prefix = [1] + [300 + i for i in range(127)]
    async with only(system, w):
        res = await client.submit(make_request("t5", prompt_token_ids=prefix, model=MODEL, max_tokens=2))
    assert res.worker == w
    hashes = request_block_hashes(make_request("t5", prompt_token_ids=prefix, model=MODEL), 32)[:3]
    assert await wait_for(lambda: set(hashes) <= watch.cache.get(w, set()), timeout=15)


async def test_the_servers_chat_template_runs_on_the_tiny_tokenizer(system):
    """The tiny model's tokenizer ships a chat template: vllm serve renders chats with it (the
    official openai SDK, straight to the server)."""
    from openai import AsyncOpenAI

    srv = system.servers["s1"]
    api = AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    try:
        chat = await api.chat.completions.create(
            model=MODEL, max_tokens=4, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": "You route requests."},
                      {"role": "user", "content": "Which worker holds the cache?"}])
    finally:
        await api.close()
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    # <s> <|system|> \n ... </s> \n <|user|> ...: the template's tokens, counted by the server
    assert chat.usage.prompt_tokens > 12


async def test_the_gateway_lists_the_servers_models_with_vllms_fields_and_serves_through_them(system, nats_url):
    """The OpenAI SDK against the gateway in front of the agents: vLLM's model entry fields, a
    chat completion rendered by the gateway and run on a real vllm serve, and /health."""
    from openai import AsyncOpenAI, NotFoundError

    from tests.factories.gateway import ALPHA, start_gateway

    gw = await start_gateway(nats_url)
    try:
        await gw.wait_for_workers(len(WORKERS))
        async with httpx.AsyncClient() as http:
            raw = (await http.get(f"{gw.url}/v1/models", headers={"authorization": f"Bearer {ALPHA}"})).json()
            assert (await http.get(f"{gw.url}/health")).status_code == 200
        entries = {e["id"]: e for e in raw["data"]}
        assert set(entries) == {MODEL, ADAPTER}
        entry = entries[MODEL]
        assert {k: entry[k] for k in ("id", "object", "owned_by", "parent", "max_model_len")} == \
            {"id": MODEL, "object": "model", "owned_by": "vllm", "parent": None, "max_model_len": 1024}
        assert entry["root"] and entry["created"] > 0
        assert entries[ADAPTER]["parent"] == MODEL
        api = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=ALPHA, max_retries=0)
        try:
            chat = await api.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                {"role": "user", "content": "which worker holds the prefix?"}])
            text = "the quick brown fox asks the worker about the cache"
            async with only(system, "s1"):
                base = await api.completions.create(model=MODEL, prompt=text, max_tokens=6)
            adapted = await api.completions.create(model=ADAPTER, prompt=text, max_tokens=6)
            with pytest.raises(NotFoundError) as missing:
                await api.completions.create(model="bob", prompt=text, max_tokens=2)
        finally:
            await api.close()
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
        assert chat.system_fingerprint in WORKERS
        assert adapted.system_fingerprint == "s1" and adapted.usage.completion_tokens == 6
        assert adapted.choices[0].text != base.choices[0].text  # greedy, same prompt: the adapter answered
        assert "'bob'" in str(missing.value)
    finally:
        await gw.close()


async def test_bench_pipeline_on_a_vllm_server_measures_the_agent_against_direct_calls(system, tmp_path):
    """``natsched bench pipeline --engine vllm-server`` (= ``bench server``) against the module's s1."""
    import sys

    import orjson

    out = tmp_path / "bench.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "natsched", "bench", "pipeline", "--engine", "vllm-server",
        "--url", system.servers["s1"].url, "--requests", "3", "--warmup", "1", "--max-tokens", "2",
        "--prompt-tokens", "16", "--json", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 600)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    assert "running natsched bench server" in stderr.decode()
    report = orjson.loads(out.read_bytes())
    assert report["model"] == MODEL and report["max_tokens"] == 2
    assert {p: s["n"] for p, s in report["paths"].items()} == {"direct": 3, "engine": 3, "natsched": 3}
    assert report["natsched_overhead"]["total"]["n"] == 3
    table = stdout.decode()
    assert "natsched overhead" in table and "direct" in table
