"""The engine model: batching, prefix cache, KV limits and preemption behave like vLLM's."""

from natsched.workers.profiles import H100_LLAMA8B, H100_27B_INT4
from natsched.workers.simcore import SimCore


def make_core(**kw) -> SimCore:
    kw.setdefault("block_size", 16)
    return SimCore(H100_LLAMA8B, **kw)


def run(core: SimCore, now: float = 0.0, limit: int = 100_000):
    """Step until idle; return (finished seqs, end time, all stored, all removed)."""
    finished, stored, removed = [], [], []
    for _ in range(limit):
        if not core.has_work():
            break
        r = core.step(now)
        now += r.duration
        finished += r.finished
        stored += r.stored
        removed += r.removed
    return finished, now, stored, removed


def chain(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_profile_arithmetic_matches_the_design_numbers():
    p = H100_LLAMA8B
    assert p.kv_bytes_per_token == 128 * 1024
    assert 400_000 < p.kv_capacity_tokens < 450_000
    assert 0.005 < p.memory_seconds(0) < 0.007  # ≈ 6 ms per decode step
    assert 30_000 < 1000 / p.prefill_seconds(1000) < 40_000  # ≈ 35k prefill tokens/s
    assert H100_27B_INT4.kv_capacity_tokens < p.kv_capacity_tokens / 2


def test_generates_exactly_the_requested_tokens():
    core = make_core()
    core.add("a", 100, chain(6), 7, 0)
    finished, _, stored, _ = run(core)
    assert [(s.id, s.generated, s.cached_tokens) for s in finished] == [("a", 7, 0)]
    assert stored == chain(6)  # every full prompt block became cacheable


def test_repeated_prefix_hits_cache_except_last_token():
    core = make_core()
    core.add("a", 96, chain(6), 2, 0)
    run(core)
    core.add("b", 96, chain(6), 2, 0)
    (b,), *_ = run(core)
    assert b.cached_tokens == 80  # 5 of 6 blocks: the last prompt token is always recomputed
    core.add("c", 200, chain(6) + chain(6, 100), 2, 0)
    (c,), *_ = run(core)
    assert c.cached_tokens == 96


def test_cached_prefix_makes_first_token_faster():
    core = make_core()
    core.add("a", 8000, chain(500), 1, 0)
    (a,), t1, *_ = run(core)
    core.add("b", 8000, chain(500), 1, t1)
    (b,), t2, *_ = run(core, now=t1)
    assert (b.first_token_at - t1) < (a.first_token_at - 0) / 5


def test_lru_eviction_when_kv_is_full():
    core = make_core(kv_blocks=10)
    core.add("a", 64, chain(4), 1, 0)
    run(core)
    core.add("b", 64, chain(4, 100), 1, 0)
    run(core)
    assert len(core.evictable) == 8 and core.free == 2
    core.add("c", 64, chain(4, 200), 1, 0)
    _, _, _, removed = run(core)
    assert removed[:2] == [3, 2]  # a's blocks, least recently used, go first, deepest first
    assert core.cached_prefix_blocks(chain(4, 100)) == 4


def test_waits_when_kv_cannot_hold_the_prompt():
    core = make_core(kv_blocks=10)
    core.add("a", 100, chain(6), 50, 0)
    core.add("b", 100, chain(6, 50), 1, 0)
    r = core.step(0)
    assert [s.id for s in core.running] == ["a"] and [s.id for s in core.waiting] == ["b"]
    finished, *_ = run(core, now=r.duration)
    assert {s.id for s in finished} == {"a", "b"}


def test_decode_growth_preempts_the_youngest():
    core = make_core(kv_blocks=6)
    core.add("a", 32, chain(2), 40, 0)
    core.add("b", 32, chain(2, 10), 40, 0)
    finished, *_ = run(core)
    assert {s.id: s.generated for s in finished} == {"a": 40, "b": 40}
    assert core.preemptions >= 1
    assert core.free + len(core.evictable) == core.kv_blocks  # nothing leaked


def test_chunked_prefill_respects_token_budget():
    core = make_core(max_batched_tokens=512)
    core.add("a", 2000, chain(125), 1, 0)
    r = core.step(0)
    assert core.running[0].computed == 512 and not r.tokens


def test_abort_frees_blocks():
    core = make_core(kv_blocks=20)
    core.add("a", 100, chain(6), 100, 0)
    core.step(0)
    assert core.abort("a") and not core.abort("a")
    assert core.free + len(core.evictable) == 20 and not core.has_work()


def test_runtime_tokens_and_queue_stats():
    core = make_core()
    core.add("a", 100, chain(6), 5, 0)
    assert core.queued_prefill_tokens() == 100 and core.runtime_tokens() == 100
    core.step(0)
    assert core.queued_prefill_tokens() == 0 and core.runtime_tokens() == 101


def test_a_sequence_that_can_never_fit_is_refused_up_front():
    core = make_core(kv_blocks=8)
    import pytest

    with pytest.raises(ValueError, match="KV blocks"):
        core.add("a", 100, chain(6), 50, 0)


def test_decode_takes_a_new_block_exactly_when_a_block_fills():
    core = make_core(kv_blocks=100)
    core.add("a", 32, chain(2), 20, 0)
    core.step(0)  # prefill 32 tokens, first token sampled: its KV is written next step
    assert core.used_blocks == 2
    core.step(0)  # input position 32 starts block 3
    assert core.used_blocks == 3
    for _ in range(15):  # positions 33..47 stay in block 3
        core.step(0)
    assert core.used_blocks == 3
    core.step(0)  # position 48 starts block 4
    assert core.used_blocks == 4


def test_preempted_sequence_counts_its_tokens_once():
    core = make_core(kv_blocks=6)
    core.add("a", 32, chain(2), 40, 0)
    core.add("b", 32, chain(2, 10), 40, 0)
    now = 0.0
    while core.preemptions == 0:
        now += core.step(now).duration
    for seq in core.running + list(core.waiting):
        assert seq.kv_tokens <= seq.prompt_tokens + seq.generated
    assert core.runtime_tokens() <= sum(s.prompt_tokens + s.generated for s in core.seqs.values())


def test_partial_eviction_keeps_the_shared_root():
    core = make_core(kv_blocks=10)
    core.add("a", 96, chain(6), 1, 0)  # 6 blocks cached, tail released first
    run(core)
    core.add("b", 64, chain(4, 100), 1, 0)  # needs 4: evicts a's 2 deepest blocks... and 2 more
    run(core)
    assert core.cached_prefix_blocks(chain(6)) >= 2  # a's root survives a partial eviction


# ------------------------------------------------------------------ speed factor and host tier

def test_speed_factor_scales_every_step_and_applies_from_the_next_step():
    nominal, slow = make_core(), make_core(speed=1 / 3)
    for core in (nominal, slow):
        core.add("a", 2000, chain(125), 20, 0)
    (_, t_nominal, *_), (_, t_slow, *_) = run(nominal), run(slow)
    assert abs(t_slow - 3 * t_nominal) < 1e-9 * t_slow
    core = make_core()
    core.add("a", 2000, chain(125), 20, 0)
    first = core.step(0).duration
    core.set_speed(0.5)
    assert core.step(first).duration > 0
    core.set_speed(1.0)
    for bad in (0, -1, float("nan"), float("inf")):
        try:
            core.set_speed(bad)
        except ValueError:
            continue
        raise AssertionError(f"speed {bad} accepted")


BS = 256  # large blocks: prefill compute, not the step's weight read, dominates a recompute


def host_core(host_blocks: int = 64, kv_blocks: int = 12) -> SimCore:
    # 12 GPU blocks: a second 8-block prompt evicts the first one's blocks
    return make_core(block_size=BS, kv_blocks=kv_blocks, host_blocks=host_blocks, host_bandwidth=64e9)


def run_host(core: SimCore, now: float = 0.0):
    """Step until idle; return (finished seqs, end time, host-tier stores, host-tier evictions)."""
    results = []
    while core.has_work():
        results.append(core.step(now))
        now += results[-1].duration
    return ([s for r in results for s in r.finished], now, [h for r in results for h in r.host_stored],
            [h for r in results for h in r.host_removed])


def test_gpu_evictions_go_to_the_host_tier_and_come_back_cheaper_than_a_recompute():
    core = host_core()
    core.add("a", 8 * BS, chain(8), 2, 0)
    run_host(core)
    core.add("b", 8 * BS, chain(8, 100), 2, 0)  # evicts a's blocks from the GPU...
    _, _, host_stored, _ = run_host(core)
    assert host_stored and set(host_stored) <= set(chain(8))  # ...into the host tier (tail first)
    assert core.cached_prefix_blocks(chain(8)) < 7
    core.add("a2", 8 * BS, chain(8), 2, 0)
    (a2,), t_end, _, _ = run_host(core, 0.0)
    assert a2.cached_tokens == 7 * BS and a2.host_cached_tokens > 0  # never the last prompt token
    # the same request on an engine without a host tier recomputes what was evicted
    plain = make_core(block_size=BS, kv_blocks=12)
    for rid, c in (("a", chain(8)), ("b", chain(8, 100))):
        plain.add(rid, 8 * BS, c, 2, 0)
        run(plain)
    plain.add("a2", 8 * BS, chain(8), 2, 0)
    (p2,), t_plain, *_ = run(plain)
    assert p2.cached_tokens < a2.cached_tokens
    p = H100_LLAMA8B
    load = a2.host_cached_tokens * p.kv_bytes_per_token / 64e9
    assert load > 0 and t_end + 10 * load < t_plain  # loading is far cheaper than recomputing


def test_host_tier_is_bounded_lru_and_reports_its_evictions():
    core = host_core(host_blocks=4)
    for i in range(4):
        core.add(f"r{i}", 8 * BS, chain(8, 100 * i), 2, 0)
        _, _, stored, removed = run_host(core)
    assert len(core.host) == 4
    assert removed  # the host tier evicted its oldest blocks, and said so
    try:
        SimCore(H100_LLAMA8B, 16, host_blocks=4)  # a tier without bandwidth
    except ValueError:
        return
    raise AssertionError("host tier without bandwidth accepted")


def test_simengine_reports_runtime_tokens_as_vllm_does_a_shared_prefix_once():
    """Heartbeats carry what a vLLM engine reports (blocks in use x block size + prefill owed):
    two sequences on one 96-token prefix hold its 6 blocks once, not twice."""
    from natsched.workers.simengine import SimEngine

    eng = SimEngine(H100_LLAMA8B, 16)
    core = eng.core
    core.add("a", 100, chain(6), 50, 0)
    core.step(0)
    core.add("b", 100, chain(6), 50, 0)
    core.step(0.01)
    st = eng.stats()
    assert st.kv_used_blocks < 2 * 7  # the prefix's blocks are shared
    assert st.runtime_tokens == st.kv_used_blocks * 16 + core.queued_prefill_tokens()
    assert st.runtime_tokens < core.runtime_tokens()  # the per-sequence sum counts the prefix twice
