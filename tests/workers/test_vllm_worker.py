"""A real vLLM worker process on the bus: what it publishes is what the router will compute.

The worker runs as a child process (:class:`natsched.hosting.vllm_worker.VllmWorkerProcess`), exactly as
``natsched up`` / a deployment runs it; the test plays the router (publishes Assignments on
``work.<id>``) and listens to everything the worker says. One worker for the module; the last
test drains it.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from natsched.wire import subjects as S
from natsched.wire.blocks import request_block_hashes
from natsched.bus.connection import Bus
from natsched.wire.schema import Assignment, CacheEvent, Completion, Control, Heartbeat, Reply, Request, WorkerId
from tests.conftest import wipe
from natsched.workers.calibrate import Calibration, store_calibration
from natsched.hosting.vllm_worker import VllmWorkerProcess
from tests.factories.core import wait_for

# no skip when vLLM is missing: CI installs the cpu extra, and a missing engine must fail loudly
pytestmark = pytest.mark.vllm

WID = WorkerId("wv1")
MODEL = "tiny-w"
DEPLOYMENT = "test-cpu"
CALIBRATED = 5000
MAX_LEN = 8000  # the context limit: the too-long test's prompt goes 400 past it
#: the drain test's request: on the LIVE_LAYERS model ~50 s, so a heartbeat shows it running and quiescing
DRAIN_TOKENS = 3000
_ids = itertools.count()


class Listener:
    def __init__(self) -> None:
        self.hbs: list[Heartbeat] = []
        self.arrived: list[float] = []  # when each heartbeat reached this process (beside hbs)
        self.on_heartbeat = None  # an async hook, awaited on each heartbeat as it arrives
        self.kvs: list[CacheEvent] = []
        self.done: dict[str, Completion] = {}
        self.replies: dict[str, list[Reply]] = {}

    async def start(self, bus: Bus) -> None:
        async def hb(s, d, h):
            self.hbs.append(Heartbeat.decode(d))
            self.arrived.append(time.time())
            if self.on_heartbeat is not None:
                await self.on_heartbeat(self.hbs[-1])

        async def kv(s, d, h):
            self.kvs.append(CacheEvent.decode(d))

        async def done(s, d, h):
            c = Completion.decode(d)
            self.done[c.request_id] = c

        async def reply(s, d, h):
            r = Reply.decode(d)
            self.replies.setdefault(r.request_id, []).append(r)

        await bus.subscribe(S.heartbeat(WID), hb)
        await bus.subscribe(S.cache_events(WID), kv)
        await bus.subscribe(S.COMPLETIONS_ALL, done)
        await bus.subscribe("resp.>", reply)

    def published(self) -> set[int]:
        """The worker's cache as a router following its events sees it."""
        view: set[int] = set()
        for ev in self.kvs:
            if ev.kind in ("snapshot", "cleared"):
                view = set(ev.hashes)
            elif ev.kind == "stored":
                view |= set(ev.hashes)
            elif ev.kind == "removed":
                view -= set(ev.hashes)
        return view


@pytest.fixture(scope="module")
async def worker(nats_url, tmp_path_factory):
    from natsched.workers.tiny_model import LIVE_LAYERS, write_tiny_model

    bus = await Bus.connect(nats_url, name="test-vllm-worker")
    await wipe(bus)
    await bus.provision()
    await store_calibration(bus, Calibration(
        model=MODEL, deployment=DEPLOYMENT, capacity_tokens=CALIBRATED, knee_concurrency=4, knee_reason="test",
        knee_factor=2.0, baseline_ttft=0.01, baseline_tpot=0.01, block_size=32, prompt_tokens=64, output_tokens=8,
        measured_at=time.time()))
    listener = Listener()
    await listener.start(bus)
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-worker"), tokenizer=True, layers=LIVE_LAYERS)
    proc = VllmWorkerProcess(nats_url, WID, path, model=MODEL, deployment=DEPLOYMENT, kv_cache_blocks=256,
                             max_model_len=MAX_LEN, concurrency=4, heartbeat=0.3).start()
    try:
        await proc.await_ready(240)
        yield bus, listener, proc
    finally:
        proc.stop()
        await bus.close()


async def assign(bus: Bus, **fields) -> Request:
    rid = f"q{next(_ids)}"
    req = Request(id=rid, tenant="t1", cls="online", model=MODEL, reply=S.reply(rid), created=time.time(), **fields)
    a = Assignment(request=req, worker=WID, runtime_tokens=200, admitted_at=time.time(), routed_at=time.time())
    await bus.jpublish(S.work(WID), a, msg_id=rid)
    return req


async def finished(listener: Listener, req: Request, timeout: float = 60.0) -> Completion:
    assert await wait_for(lambda: req.id in listener.done and any(r.final for r in listener.replies.get(req.id, [])),
                          timeout), f"no result for {req.id}"
    return listener.done[req.id]


async def test_heartbeats_carry_engine_load_and_the_calibrated_capacity(worker):
    _, listener, proc = worker
    assert "engine=vllm" in proc.ready_line
    assert await wait_for(lambda: len(listener.hbs) >= 2)
    hb = listener.hbs[-1]
    assert hb.state == "healthy" and hb.model == MODEL and hb.block_size == 32
    assert hb.kv_total_blocks == 256 and hb.capacity_tokens == CALIBRATED
    assert listener.kvs and listener.kvs[0].kind == "snapshot"


async def test_token_prompt_hashes_on_the_bus_equal_the_routers(worker):
    bus, listener, _ = worker
    req = await assign(bus, prompt_token_ids=[10 + (i * 37) % 900 for i in range(150)], max_tokens=6)
    c = await finished(listener, req)
    assert c.status == "ok" and c.prompt_tokens == 150 and c.output_tokens == 6 and c.worker == WID
    expected = request_block_hashes(req, 32)
    assert len(expected) == 4
    assert await wait_for(lambda: set(expected) <= listener.published())
    result = [r for r in listener.replies[req.id] if r.final][0]
    assert result.kind == "result" and result.output_tokens == 6


async def test_text_prompt_hashes_on_the_bus_equal_the_routers(worker):
    bus, listener, _ = worker
    system = "System: you answer questions about the routing cache of this knowledge base. " * 3
    prompt = "User question: which worker holds the prefix? " * 10
    req = await assign(bus, prompt=prompt, system_prompt=system, kb_version="kb1", max_tokens=5)
    c = await finished(listener, req)
    assert c.status == "ok"
    expected = request_block_hashes(req, 32)  # text route key: root(model, kb), system + prompt text
    assert len(expected) >= 5
    assert await wait_for(lambda: set(expected) <= listener.published())
    # a follow-up with the same system prompt is served from cache, and the worker says so
    req2 = await assign(bus, prompt="User question: something else entirely? " * 5, system_prompt=system,
                        kb_version="kb1", max_tokens=5)
    c2 = await finished(listener, req2)
    assert c2.cached_tokens >= 32


async def test_cache_events_are_sequenced_without_gaps(worker):
    _, listener, _ = worker
    seqs = [ev.seq for ev in listener.kvs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    # heartbeats name the last sequence number, so a reader can tell it missed the tail
    assert await wait_for(lambda: listener.hbs[-1].kv_seq == listener.kvs[-1].seq)


async def test_too_long_prompt_is_answered_with_an_error(worker):
    bus, listener, _ = worker
    req = await assign(bus, prompt_token_ids=[5] * (MAX_LEN + 400), max_tokens=4)
    c = await finished(listener, req)
    assert c.status == "error" and c.reason == "prompt_too_long"
    err = [r for r in listener.replies[req.id] if r.final][0]
    assert err.kind == "error" and err.reason == "prompt_too_long" and str(MAX_LEN) in err.message


# (before the drain test: the module's worker leaves there)
async def test_heartbeats_carry_the_decode_progress_of_a_real_engine(worker):
    """The early slowness signal (natsched.router.progress) from real vLLM: every token after the
    first counted once, with a gap before it, in the heartbeats after the request ran."""
    bus, listener, _ = worker
    # the earlier tests' last tokens are reported first: a busy CI machine delivered the heartbeat
    # holding them after this test had begun, and counted 4 tokens too many
    before = len(listener.hbs)
    assert await wait_for(lambda: len(listener.hbs) > before + 1)
    start = len(listener.hbs)
    req = await assign(bus, prompt_token_ids=[3 + i % 700 for i in range(80)], max_tokens=40)
    c = await finished(listener, req)
    n = len(listener.hbs)
    assert await wait_for(lambda: len(listener.hbs) > n + 1)  # the interval holding its last tokens was reported
    hbs = listener.hbs[start:]
    assert sum(hb.decode_tokens for hb in hbs) == c.output_tokens - 1
    assert sum(hb.decode_s for hb in hbs) > 0.0


async def test_drain_finishes_inflight_work_then_the_process_leaves(worker):
    """Last in the module: the worker leaves."""
    bus, listener, proc = worker
    # long enough that a fast CPU cannot finish it between two heartbeats. Not streamed: 4,000
    # token replies to decode here, in a process the engine's threads starve of CPU, delayed the
    # heartbeats behind them by 6 s in CI, and the request had ended before the drain went out
    drained: list[float] = []

    async def drain_once_running(hb: Heartbeat) -> None:
        # from the subscription itself, as the heartbeat arrives: a test polling for it noticed
        # one 7 s late in CI (a 4,000-token request), after the request had ended
        if not drained and req.id in hb.inflight:
            drained.append(time.time())
            await bus.publish(S.control(WID), Control(kind="drain", by="test"))

    req = await assign(bus, prompt_token_ids=[7 + i % 500 for i in range(64)], max_tokens=DRAIN_TOKENS)
    listener.on_heartbeat = drain_once_running
    assert await wait_for(lambda: drained, timeout=120), "the request never showed in flight"
    # it says so while the request still runs ...
    assert await wait_for(lambda: any(hb.state == "quiescing" and req.id in hb.inflight for hb in listener.hbs)), \
        _drain_story(listener, req.id, drained[0])  # what the heartbeats said, and when the request ended
    # ... and finishes it
    c = await finished(listener, req, timeout=240)
    assert c.status == "ok" and c.output_tokens == DRAIN_TOKENS
    code = await asyncio.to_thread(proc.wait, 60)
    assert code == 0, proc.tail()
    assert await wait_for(lambda: listener.hbs[-1].inflight == [] and listener.kvs[-1].kind == "cleared")
    assert listener.hbs[-1].state == "quiescing"


def _drain_story(listener: "Listener", rid: str, drained_at: float) -> str:
    """When the drain went out, the heartbeats (time, state, whether ``rid`` was in flight) and the replies."""
    beats = [(round(hb.ts % 1000, 2), round(at % 1000, 2), hb.state, rid in hb.inflight)
             for hb, at in zip(listener.hbs[-40:], listener.arrived[-40:])]
    replies = listener.replies.get(rid, [])
    return (f"drain sent at {drained_at % 1000:.2f}; last heartbeats (sent, arrived, state, running) {beats}; "
            f"{sum(r.kind == 'token' for r in replies)} token replies, "
            f"final: {[(r.kind, r.reason) for r in replies if r.final]}")
