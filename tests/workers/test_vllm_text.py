"""VllmEngine with a tokenizer: text prompts, and text-route-key hashes that follow vLLM's cache.

The tiny model directory carries a small byte-level BPE tokenizer (BOS prepended, like Llama's)
written by :mod:`natsched.workers.tiny_model`. One engine for the module.
"""

from __future__ import annotations

import itertools
import os

import pytest

from natsched.wire.blocks import request_block_hashes, root_hash, token_block_hashes
from natsched.wire.schema import Request
from natsched.workers.engine import EngineRequest
from natsched.workers.vllm_engine import VllmEngine, VllmEngineSettings
from tests.factories.core import wait_for

# no skip when vLLM is missing: CI installs the cpu extra, and a missing engine must fail loudly
pytestmark = pytest.mark.vllm

MODEL = "tiny-text"
_ids = itertools.count()
SYSTEM = "You are the system prompt of the knowledge base; answer the user question about routing. " * 3


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, list[int]]] = []

    def __call__(self, kind, hashes) -> None:
        self.events.append((kind, list(hashes)))

    def stored(self) -> set[int]:
        return {h for k, hs in self.events if k == "stored" for h in hs}


@pytest.fixture(scope="module")
async def engine(tmp_path_factory):
    from natsched.workers.tiny_model import DTYPE, write_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-text"), tokenizer=True)
    eng = VllmEngine(VllmEngineSettings(model_path=str(path), model=MODEL, load_format="dummy", dtype=DTYPE, enforce_eager=True,
                                        ignore_eos=True,  # random weights: no early EOS, exact token counts
                                        max_model_len=2048, max_num_seqs=8, kv_cache_blocks=256))
    eng.recorder = Recorder()
    eng.set_cache_listener(eng.recorder)
    await eng.start()
    yield eng
    await eng.stop()


def text_request(prompt: str, system: str | None = None, kb: str | None = None, max_tokens: int = 6):
    rid = f"x{next(_ids)}"
    req = Request(id=rid, tenant="t", cls="online", model=MODEL, prompt=prompt, system_prompt=system, kb_version=kb,
                  max_tokens=max_tokens)
    text = (system or "") + prompt  # as the agent builds it
    return req, EngineRequest(id=rid, prompt_tokens=len(text) // 4, hashes=request_block_hashes(req, 32),
                              max_tokens=max_tokens, prompt=text)


async def run(engine, er):
    return [out async for out in engine.generate(er)]


async def test_generates_text_for_a_text_prompt(engine):
    _, er = text_request("the quick brown fox jumps over the lazy dog", max_tokens=8)
    outs = await run(engine, er)
    final = outs[-1]
    assert final.error is None and final.finished and final.output_tokens == 8
    assert final.prompt_tokens > 5
    assert isinstance("".join(o.text for o in outs), str)
    assert all(o.token_ids for o in outs)


@pytest.mark.parametrize("system,kb", [(None, None), (SYSTEM, "kb-7")])
async def test_published_hashes_equal_the_routers_for_text_prompts(engine, system, kb):
    rec = engine.recorder
    prompt = f"user question {next(_ids)}: " + "which worker holds the prefix cache for this token batch? " * 12
    req, er = text_request(prompt, system, kb)
    expected = request_block_hashes(req, 32)  # what the router computes for this text request
    assert len(expected) >= 4
    await run(engine, er)
    assert await wait_for(lambda: set(expected) <= rec.stored())
    assert set(expected) <= set(engine.cached_hashes())
    # and the token blocks themselves, for token-id requests of the same tokens
    ids = engine._tokenizer(req.system_prompt + prompt if system else prompt)["input_ids"]
    assert ids[0] == 1  # BOS, as vLLM would have added it
    assert set(token_block_hashes(ids, 32, root_hash(MODEL))) <= rec.stored()


async def test_a_shared_text_prefix_hits_the_cache_and_its_hashes_stay_published(engine):
    rec = engine.recorder
    shared = SYSTEM + f"context {next(_ids)} " + "the routing cache keeps the prefix of every token batch. " * 6
    req_a, a = text_request(shared + "first question?")
    await run(engine, a)
    req_b, b = text_request(shared + "a different second question, longer than the first one?")
    final = (await run(engine, b))[-1]
    assert final.cached_tokens >= 64
    common = [h for h, g in zip(request_block_hashes(req_a, 32), request_block_hashes(req_b, 32)) if h == g]
    assert common and set(common) <= set(engine.cached_hashes())
    assert await wait_for(lambda: set(request_block_hashes(req_b, 32)) <= rec.stored())


async def test_non_ascii_text(engine):
    req, er = text_request("Grüße aus Zürich — 東京の天気は？ " * 20)
    final = (await run(engine, er))[-1]
    assert final.error is None
    assert await wait_for(lambda: set(request_block_hashes(req, 32)) <= engine.recorder.stored())


async def test_token_id_prompts_work_beside_text_prompts(engine):
    ids = [1] + [10 + i % 300 for i in range(100)]
    req = Request(id=f"x{next(_ids)}", tenant="t", cls="online", model=MODEL, prompt_token_ids=ids, max_tokens=4)
    er = EngineRequest(id=req.id, prompt_tokens=len(ids), hashes=request_block_hashes(req, 32), max_tokens=4,
                       prompt_token_ids=ids)
    final = (await run(engine, er))[-1]
    assert final.error is None and final.output_tokens == 4
    assert await wait_for(lambda: set(request_block_hashes(req, 32)) <= engine.recorder.stored())


async def test_a_chat_rendered_by_the_tiny_models_template_runs(engine):
    text = engine._tokenizer.apply_chat_template([{"role": "user", "content": "which worker is idle?"}],
                                                 tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s><|user|>") and text.endswith("<|assistant|>\n")
    _, er = text_request(text[len("<s>"):], max_tokens=3)  # the engine's tokenizer adds BOS itself
    final = (await run(engine, er))[-1]
    assert final.error is None and final.output_tokens == 3
    ids = engine._tokenizer(text[len("<s>"):])["input_ids"]
    assert ids[:2] == [engine._tokenizer.bos_token_id, engine._tokenizer.convert_tokens_to_ids("<|user|>")]
