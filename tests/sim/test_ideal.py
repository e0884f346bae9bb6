"""The ideal cluster's TTFT (sim/ideal.py): the engine's own arithmetic, and a floor nobody beats."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from natsched.sim import bench_scenarios as B
from natsched.sim.contenders import CONTENDERS, make_gate
from natsched.sim.des import simulate
from natsched.sim.ideal import fastest_per_model, ideal_cached, ideal_ttfts, prefill_alone_s
from natsched.sim.scenario import parse_scenario
from natsched.sim.traffic import generate
from natsched.workers.profiles import H100_27B_INT4, H100_LLAMA8B
from natsched.workers.simcore import SimCore
from tests.factories.sim import make_trace, trace_row
from tests.sim.test_bench_scenarios import TINY

BS = 64


def _alone_on_simcore(profile, *prompts: tuple[int, list[int]]) -> float:
    """TTFT of the last of ``prompts`` run one after the other on one idle SimCore (the earlier ones
    leave their blocks cached)."""
    core = SimCore(profile, BS)
    now, ttft = 0.0, None
    for i, (n, hashes) in enumerate(prompts):
        seq = core.add(f"s{i}", n, hashes, 1, now)
        start = now
        while core.has_work():
            now += core.step(now).duration
        ttft = seq.first_token_at - start
    return ttft


@pytest.mark.parametrize("prompt", [1, 100, 8192, 8193, 20_000])
def test_prefill_alone_is_what_the_simulated_engine_charges_a_lone_cold_request(prompt):
    hashes = list(range(prompt // BS))
    assert prefill_alone_s(H100_LLAMA8B, prompt, 0) == pytest.approx(_alone_on_simcore(H100_LLAMA8B, (prompt, hashes)))


def test_prefill_alone_with_a_cached_prefix_is_what_the_engine_charges_after_it():
    first = (12_800, list(range(200)))  # 200 blocks of 64
    second = (12_800 + 900, list(range(200)) + [10_000 + i for i in range(14)])
    want = _alone_on_simcore(H100_LLAMA8B, first, second)
    assert prefill_alone_s(H100_LLAMA8B, second[0], 12_800) == pytest.approx(want)
    assert want < prefill_alone_s(H100_LLAMA8B, second[0], 0)  # the cached prefix was used


def test_ideal_ttfts_cache_every_earlier_prompt_and_take_each_models_fastest_profile():
    slow = dataclasses.replace(H100_LLAMA8B, name="slow", peak_flops=H100_LLAMA8B.peak_flops / 8)
    fastest = fastest_per_model([("default", slow), ("default", H100_LLAMA8B), ("big", H100_27B_INT4)])
    assert fastest == {"default": H100_LLAMA8B, "big": H100_27B_INT4}
    trace = make_trace([trace_row(0, ids=[1, 2, 3], block=BS), trace_row(1, ids=[1, 2, 4], block=BS),
                        trace_row(2, ids=[1, 2, 3], block=BS)], block_size=BS)
    trace.requests[2].model = "big"
    got = ideal_ttfts(trace.requests, BS, fastest)
    assert got[0] == pytest.approx(prefill_alone_s(H100_LLAMA8B, 192, 0))  # nothing seen before
    assert got[1] == pytest.approx(prefill_alone_s(H100_LLAMA8B, 192, 128))  # blocks 1, 2 seen
    # all three blocks seen, capped so that the last prompt token is computed; on the big model
    assert got[2] == pytest.approx(prefill_alone_s(H100_27B_INT4, 192, 128))
    assert ideal_cached(reversed(trace.requests), BS) == {0: 0, 1: 128, 2: 128}  # by arrival, whatever the order
    assert ideal_ttfts(trace.requests, BS, fastest, speed=2.0)[0] == pytest.approx(got[0] / 2)
    with pytest.raises(ValueError):
        ideal_ttfts(trace.requests, BS, {})
    with pytest.raises(ValueError):
        ideal_ttfts(trace.requests, BS, fastest, speed=0.0)


@pytest.mark.parametrize("contender", ["natsched", "llm-d", "sglang", "dynamo"])
def test_no_request_of_any_contender_gets_its_first_token_sooner_than_on_the_ideal_cluster(contender):
    sc = parse_scenario({**copy.deepcopy(TINY), "contenders": None}, "tiny.yaml")
    trace = generate(sc, 1.0, 3.0)  # busy enough to queue
    c = CONTENDERS[contender]
    tenants = {t.name: (t.floor, t.weight) for t in sc.traffic.tenants}
    res = simulate(trace, B.sim_settings(sc, c.policy, c.rescue, router=c.router_settings()),
                   admission=make_gate(c, tenants, sc.slo_ttft_s))
    specs = [*B.worker_specs(sc), *(e.spec for e in B.worker_events(sc) if e.kind == "add")]
    ideal = ideal_ttfts(trace.requests, trace.block_size, fastest_per_model((s.model, s.engine_profile()) for s in specs))
    served = [r for r in res.records if r.status == "ok"]
    assert len(served) > 20
    gaps = [r.first_token - r.arrival - ideal[r.index] for r in served]
    assert min(gaps) >= -1e-9
    assert max(gaps) > 0.05  # the floor is a floor: queues and misses do cost something here


def test_the_report_gives_each_ttft_metric_its_ideal_value_and_the_least_ratio():
    sc = parse_scenario({**copy.deepcopy(TINY), "headline": {"metric": "phase_ttft_p99_s", "phases_s": [8]},
                         "sweep": {"points": 2}}, "t")
    rep = B.run_suite([sc], B.SuiteSettings(jobs=1, progress=False))
    j = rep["scenarios"]["tiny"]
    runs = {lb: {c: j["runs"][c][lb] for c in j["runs"]} for lb in j["loads"]}
    for by_c in runs.values():  # the arrivals alone decide it: the same for every contender of a cell
        assert len({m["ideal_phase_ttft_p99_s"] for m in by_c.values()}) == 1
        nat = by_c["natsched"]
        assert nat["ideal_phase_ttft_p99_s"] == max(nat["ideal_phase1_ttft_p99_s"], nat["ideal_phase2_ttft_p99_s"])
    b = j["ideal"]["phase_ttft_p99_s"]
    assert b["min_ratio"] == pytest.approx(b["ideal"] / j["paired"]["phase_ttft_p99_s"]["theirs"])
    assert 0 < b["min_ratio"] < 1
    text = B.summary_table(rep)
    assert "of the ideal cluster" in text and f"no lower than {b['min_ratio']:.2f}" in text
    assert "(ideal " in text.splitlines()[-1]
