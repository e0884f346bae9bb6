"""VllmEngine on real vLLM (CPU, tiny dummy-weights model, token-id prompts, no tokenizer).

One engine serves the whole module (start ≈ 15–20 s). The last test kills its engine core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time

import pytest

from natsched.wire.blocks import request_block_hashes
from natsched.wire.schema import Request
from natsched.workers.backoff import BackoffMonitor, BackoffSettings
from natsched.workers.calibrate import CalibrationSettings, calibrate
from natsched.workers.engine import EngineRequest
from natsched.workers.vllm_engine import VllmEngine, VllmEngineSettings
from tests.factories.core import wait_for

# no skip when vLLM is missing: CI installs the cpu extra, and a missing engine must fail loudly
pytestmark = pytest.mark.vllm

MODEL = "tiny"
KV_BLOCKS = 64  # 2048 tokens: small enough to see evictions
_ids = itertools.count()


class Recorder:
    """The engine's cache listener: every (kind, hashes) it was told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[int]]] = []

    def __call__(self, kind, hashes) -> None:
        self.events.append((kind, list(hashes)))

    def stored(self) -> set[int]:
        return {h for k, hs in self.events if k in ("stored", "snapshot") for h in hs}

    def removed(self) -> set[int]:
        return {h for k, hs in self.events if k == "removed" for h in hs}


@pytest.fixture(scope="module")
async def engine(tmp_path_factory):
    from natsched.workers.tiny_model import DTYPE, write_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-ids"))
    eng = VllmEngine(VllmEngineSettings(model_path=str(path), model=MODEL, load_format="dummy", dtype=DTYPE, enforce_eager=True,
                                        ignore_eos=True,  # random weights: no early EOS, exact token counts
                                        skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=8,
                                        kv_cache_blocks=KV_BLOCKS))
    eng.recorder = Recorder()
    eng.set_cache_listener(eng.recorder)
    await eng.start()
    yield eng
    await eng.stop()


def token_request(ids: list[int], max_tokens: int = 8) -> tuple[Request, EngineRequest]:
    rid = f"v{next(_ids)}"
    req = Request(id=rid, tenant="t", cls="online", model=MODEL, prompt_token_ids=ids, max_tokens=max_tokens)
    return req, EngineRequest(id=rid, prompt_tokens=len(ids), hashes=request_block_hashes(req, 32),
                              max_tokens=max_tokens, prompt_token_ids=ids)


def unique_ids(n: int, seed: int) -> list[int]:
    return [10 + (seed * 7919 + i * 31) % 1000 for i in range(n)]


async def run(engine, er):
    outs = []
    async for out in engine.generate(er):
        outs.append(out)
    return outs


async def test_generates_for_token_ids(engine):
    _, er = token_request(unique_ids(40, 1), max_tokens=6)
    outs = await run(engine, er)
    final = outs[-1]
    assert final.finished and final.error is None and final.finish_reason == "length"
    assert final.prompt_tokens == 40 and final.output_tokens == 6
    assert sum(len(o.token_ids or []) for o in outs) == 6
    assert [o.index for o in outs] == list(range(len(outs)))


async def test_prefix_caching_reports_cached_tokens(engine):
    prefix = unique_ids(200, 2)
    _, a = token_request(prefix + [11, 12, 13])
    _, b = token_request(prefix + [21, 22, 23, 24])
    first = (await run(engine, a))[-1]
    second = (await run(engine, b))[-1]
    assert first.cached_tokens == 0
    assert second.cached_tokens >= 192  # the 6 full 32-token blocks of the shared prefix


async def test_published_hashes_equal_the_routers_for_token_prompts(engine):
    rec = engine.recorder
    req, er = token_request(unique_ids(100, 3) + [5, 5], max_tokens=4)  # 3 full blocks + a partial one
    expected = request_block_hashes(req, 32)
    assert len(expected) == 3
    n = len(rec.events)
    await run(engine, er)
    assert await wait_for(lambda: set(expected) <= rec.stored())
    new = [h for k, hs in rec.events[n:] if k == "stored" for h in hs]
    assert new[:3] == expected  # in chain order, nothing before them
    assert set(expected) <= set(engine.cached_hashes())


async def test_evicted_blocks_are_reported_removed(engine):
    rec = engine.recorder
    req, er = token_request(unique_ids(600, 4), max_tokens=2)
    await run(engine, er)
    first = request_block_hashes(req, 32)
    for seed in range(5, 9):  # 4 × 19 blocks do not fit beside it in 64 blocks
        await run(engine, token_request(unique_ids(600, seed), max_tokens=2)[1])
    assert await wait_for(lambda: set(first) & rec.removed())
    assert len(engine.cached_hashes()) <= KV_BLOCKS
    assert not (set(first) & rec.removed()) & set(engine.cached_hashes())  # what was removed is not claimed
    c = engine.translator.counters
    assert c.undecodable == 0 and c.unresolved_parent == 0 and c.gaps == 0


async def test_too_long_prompt_is_a_clear_error(engine):
    _, er = token_request(unique_ids(1100, 9))
    outs = await run(engine, er)
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "error"
    assert outs[0].error.startswith("prompt_too_long:") and "1024" in outs[0].error
    assert outs[0].prompt_tokens == 1100


async def test_output_is_cut_at_max_model_len(engine):
    _, er = token_request(unique_ids(1000, 10), max_tokens=500)
    final = (await run(engine, er))[-1]
    assert final.error is None and final.finish_reason == "length" and final.output_tokens == 24


async def test_abort_ends_the_request(engine):
    _, er = token_request(unique_ids(50, 11), max_tokens=800)
    outs = []
    async for out in engine.generate(er):
        outs.append(out)
        if len(outs) == 2:
            await engine.abort(er.id)
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs) < 100
    assert await wait_for(lambda: engine._llm.get_num_unfinished_requests() == 0)


async def test_a_consumer_that_stops_reading_aborts_the_vllm_request(engine):
    _, er = token_request(unique_ids(50, 12), max_tokens=800)
    async with contextlib.aclosing(engine.generate(er)) as stream:
        async for _ in stream:
            break
    assert await wait_for(lambda: engine._llm.get_num_unfinished_requests() == 0)

    _, er2 = token_request(unique_ids(50, 13), max_tokens=800)

    async def consume():
        async for _ in engine.generate(er2):
            pass

    task = asyncio.create_task(consume())
    assert await wait_for(lambda: er2.id in engine._live and engine._live[er2.id].started)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert await wait_for(lambda: engine._llm.get_num_unfinished_requests() == 0)
    assert engine.stats().running == 0


async def test_stats_show_load_while_running(engine):
    """The load is a mean over the stats window, so the first busy reading can
    still average in idle samples (288 of 300 tokens seen once on a loaded
    machine): wait until the mean covers the prompt while it is still running."""
    _, er = token_request(unique_ids(300, 14), max_tokens=300)
    task = asyncio.create_task(run(engine, er))
    try:
        assert await wait_for(lambda: engine.stats().running >= 1 and engine.stats().kv_used_blocks > 0)
        st = engine.stats()
        assert st.kv_total_blocks == KV_BLOCKS and st.capacity_tokens == KV_BLOCKS * 32
        assert await wait_for(lambda: engine.stats().runtime_tokens >= 300 and not task.done())
    finally:
        await engine.abort(er.id)
        await task
    st = engine.stats()
    assert st.running == 0 and st.runtime_tokens == 0


async def test_kv_pressure_shows_as_preemptions_and_backoff(engine):
    """6 sequences growing to 25 blocks each in a 64-block cache: vLLM must preempt."""
    reqs = [token_request(unique_ids(200, 20 + i), max_tokens=600)[1] for i in range(6)]
    monitor = BackoffMonitor(BackoffSettings(min_backoff_s=0.0, rate_window_s=2.0))
    before = engine.stats().preemptions
    task = asyncio.gather(*(run(engine, er) for er in reqs))
    entered = []
    while not task.done():
        if monitor.update(engine.stats(), time.monotonic()):
            entered.append(monitor.reason)
        await asyncio.sleep(0.05)
    finals = [outs[-1] for outs in await task]
    assert all(f.error is None and f.output_tokens == 600 for f in finals)
    assert engine.stats().preemptions > before
    assert entered, "neither KV usage nor the preemption rate triggered backoff"


async def test_a_tiny_calibration_runs_on_the_real_engine(engine):
    s = CalibrationSettings(model=MODEL, deployment=engine.deployment, levels=[1, 2], rounds=1, prompt_tokens=64,
                            output_tokens=8, knee_factor=10.0)
    cal = await calibrate(engine, s)
    assert [lv.errors for lv in cal.levels] == [0, 0]
    assert cal.capacity_tokens > 0 and cal.levels[0].tpot_p90 > 0
    assert engine.deployment.startswith("cpu-kv2048")


async def test_bad_token_ids_are_refused_not_fatal(engine):
    for ids, what in (([5, 1024, 7], "token id 1024"), ([], "empty"), ([-1], "token id -1")):
        outs = await run(engine, token_request(ids)[1])
        assert len(outs) == 1 and outs[0].error.startswith("invalid_request:") and what in outs[0].error
    assert engine.failure is None
    assert (await run(engine, token_request(unique_ids(40, 30))[1]))[-1].error is None


async def test_a_resumed_request_goes_on_after_its_output_so_far(engine):
    """A migrated stream's next try (``resume_token_ids``): vLLM runs prompt + those ids and
    generates the rest. Greedy for this test (the module's engine samples), so the 10 tokens of
    one run, resumed after 4, must give the other 6; an id outside the vocabulary is refused."""
    import dataclasses

    sampling = engine.settings
    engine.settings = dataclasses.replace(sampling, temperature=0.0)
    try:
        ids = unique_ids(60, 40)
        whole = [t for o in await run(engine, token_request(ids, max_tokens=10)[1]) for t in (o.token_ids or [])]
        _, er = token_request(ids, max_tokens=6)
        er.resume_token_ids, er.prompt_tokens = whole[:4], len(ids) + 4
        outs = await run(engine, er)
        assert [t for o in outs for t in (o.token_ids or [])] == whole[4:]
        assert (outs[-1].prompt_tokens, outs[-1].output_tokens) == (64, 6)
    finally:
        engine.settings = sampling
    er.resume_token_ids = [5, 1024]
    outs = await run(engine, er)
    assert len(outs) == 1 and outs[0].error.startswith("invalid_request: resume token id 1024")
    assert engine.failure is None


async def test_text_prompt_without_tokenizer_is_refused(engine):
    er = EngineRequest(id="text-no-tok", prompt_tokens=5, hashes=[], max_tokens=4, prompt="hello there")
    outs = await run(engine, er)
    assert outs[-1].error.startswith("no_tokenizer:")


async def test_engine_death_mid_request_is_an_error_output(engine):
    """Last in the module: it kills the shared engine's core process."""
    import psutil

    rec = engine.recorder
    _, er = token_request(unique_ids(50, 15), max_tokens=800)
    outs = []

    async def consume():
        async for out in engine.generate(er):
            outs.append(out)

    task = asyncio.create_task(consume())
    assert await wait_for(lambda: len(outs) >= 2)
    cores = [p for p in psutil.Process().children() if p.name().startswith("VLLM::EngineCore")]
    assert cores
    for p in cores:
        p.kill()
    await asyncio.wait_for(task, 30)
    final = outs[-1]
    assert final.finished and final.finish_reason == "error" and final.error.startswith("engine_dead:")
    assert engine.failure and rec.events[-1] == ("cleared", [])
    after = await run(engine, token_request([1, 2, 3])[1])
    assert after[-1].error.startswith("engine_dead:")
