"""The scenario suite: generated traffic, the contenders' admission rules, reproducibility, the verdicts."""

from __future__ import annotations

import copy

import pytest

from natsched.router.core import RouterCore, RouterSettings
from natsched.sim.admission import ALLOW, QUEUE, REJECT
from natsched.sim.bench_scenarios import (SuiteSettings, judge, run_suite, scenario_table, summary_table, to_json,
                                          Load)
from natsched.sim.contenders import CONTENDERS, DynamoGate, LlmdFlowGate, NatschedGate
from natsched.sim.des import SimSettings, Simulator
from natsched.sim.scenario import parse_scenario
from natsched.sim.trace import Trace, TraceRequest
from natsched.sim.traffic import block_hashes, generate
from tests.factories.router import make_hb
from tests.factories.sim import make_record

TINY = {
    "name": "tiny",
    "seed": 2,
    "cluster": {"workers": [{"count": 2, "profile": "h100-llama8b"}]},
    "traffic": {"generator": "sessions", "duration_s": 20, "rate_rps": 2.0,
                "tenants": [{"name": "a", "share": 0.6, "floor": 0.5}, {"name": "b", "share": 0.4}],
                "classes": {"online": 0.8, "batch": 0.2}, "system_prompt_tokens": [500, 900],
                "kb_chunks": 4, "kb_chunk_tokens": 128, "kb_per_request": [1, 2], "turns": [1, 3],
                "think_s": 1.0, "output_tokens": [10, 40]},
    "events": [{"at_s": 8, "kind": "kill", "worker": "w1"}, {"at_s": 4, "kind": "add", "count": 1}],
    "slo": {"ttft_s": {"online": 1.0}},
    "headline": {"metric": "online_goodput", "also": ["ttft_p99_s"]},
    "sweep": {"points": 2, "span": 0.2},
    "contenders": ["natsched", "dynamo", "sglang"],
}


def test_block_hashes_share_exactly_the_common_prefix():
    a = block_hashes([("sys", 100), ("kb1", 60), ("u1", 10)], 32)
    b = block_hashes([("sys", 100), ("kb1", 60), ("u2", 50)], 32)
    c = block_hashes([("sys", 100), ("kb2", 60)], 32)
    assert len(a) == 170 // 32 and len(b) == 210 // 32
    assert a[:5] == b[:5]  # the first 160 tokens are equal
    assert a[:3] == c[:3] and a[3] != c[3]  # block 3 (96-127) holds the first kb tokens


def test_generated_sessions_grow_their_history_and_share_the_tenant_prefix():
    sc = parse_scenario(copy.deepcopy(TINY), "t")
    trace = generate(sc)
    assert trace.requests and all(r.tenant in ("a", "b") and r.cls in ("online", "batch") for r in trace.requests)
    assert [r.arrival for r in trace.requests] == sorted(r.arrival for r in trace.requests)
    again = generate(sc)
    assert [(r.arrival, r.hashes) for r in again.requests] == [(r.arrival, r.hashes) for r in trace.requests]
    a = [r for r in trace.requests if r.tenant == "a"]
    first = {r.hashes[0] for r in a}
    assert len(first) == 1  # one system prompt per tenant
    longer = generate(sc, load=2.0)
    assert len(longer.requests) > 1.5 * len(trace.requests)


def _sim_with_views(n=2, **hb):
    """A router that heard one heartbeat from each of ``n`` workers (with ``hb`` fields)."""
    router = RouterCore(RouterSettings(block_size=64))
    for i in range(n):
        router.on_heartbeat(make_hb(f"w{i}", ts=0.0, **hb), 0.0)

    class S:
        pass

    s = S()
    s.router = router
    return s


def _req(i=0, cls="online", tenant="a", prompt=1000, out=50):
    return TraceRequest(i, i + 1, 0.0, 0.0, prompt, out, [], tenant=tenant, cls=cls, model="default")


def test_dynamo_rejects_only_when_every_worker_is_busy():
    gate = DynamoGate()
    gate.bind(_sim_with_views(kv_used_blocks=90, kv_total_blocks=100))
    assert gate.admit(_req(), 0.5) == (REJECT, None)
    gate.bind(_sim_with_views(kv_used_blocks=50, kv_total_blocks=100))
    assert gate.admit(_req(), 0.5) == ALLOW
    gate.bind(_sim_with_views(kv_used_blocks=10, kv_total_blocks=100, queued_prefill_tokens=20_000))
    assert gate.admit(_req(), 0.5) == (REJECT, None)  # active prefill tokens over 10000


def test_llmd_flow_control_queues_by_band_and_sheds_sheddable():
    gate = LlmdFlowGate()
    s = _sim_with_views(waiting=9, kv_total_blocks=100)  # every endpoint over the queue-depth threshold
    gate.bind(s)
    assert gate.admit(_req(0, "batch"), 0.5) == QUEUE
    assert gate.admit(_req(1, "online"), 0.6) == QUEUE
    assert gate.admit(_req(2, "offline"), 0.7) == (REJECT, None)
    assert gate.release(1.0) == []  # still saturated
    for i in range(2):
        s.router.on_heartbeat(make_hb(f"w{i}", seq=2, ts=1.0, waiting=4, kv_total_blocks=100), 1.0)
    out = gate.release(1.1)
    assert [r.index for r in out] == [1, 0]  # online band first, then batch
    for i in range(2):
        s.router.on_heartbeat(make_hb(f"w{i}", seq=3, ts=2.0, waiting=9, kv_total_blocks=100), 2.0)
    assert gate.admit(_req(3), 2.0) == QUEUE
    assert gate.release(61.0) == [] and gate.expired(61.0) == []  # within the 60 s TTL
    assert gate.release(62.5) == []
    assert [(r.index, ra) for r, ra in gate.expired(62.5)] == [(3, None)]  # 429 after the TTL


def test_natsched_gate_drives_the_admitter_core():
    from natsched.sim.des import WorkerSpec

    trace = Trace("t", [_req(0, "online"), _req(1, "offline")], block_size=64)
    gate = NatschedGate({"a": (0.5, 1.0)})
    sim = Simulator(trace, SimSettings(worker_specs=(WorkerSpec(),)), admission=gate)
    gate.bind(sim)
    assert gate.core.total == sim.workers["w0"].core.kv_blocks * 64
    assert gate.admit(trace.requests[0], 0.0) == ALLOW
    assert gate.admit(trace.requests[1], 0.0) == QUEUE and 1 in gate.degraded  # offline: degraded
    assert [r.index for r in gate.release(0.1)] == [1]  # room below the watermark: the offline path runs it
    gate.on_finish(trace.requests[0], True, 1.0)
    gate.on_finish(trace.requests[1], True, 1.0)
    assert gate.core.used == 0


@pytest.fixture(scope="module")
def tiny_report():
    sc = parse_scenario(copy.deepcopy(TINY), "tiny.yaml")
    return run_suite([sc], SuiteSettings(jobs=1, progress=False))


def test_the_suite_is_bit_for_bit_reproducible(tiny_report):
    sc = parse_scenario(copy.deepcopy(TINY), "tiny.yaml")
    again = run_suite([sc], SuiteSettings(jobs=2, progress=False))

    def strip(rep):
        j = to_json(rep)
        j.pop("wall_s")
        for s in j["scenarios"].values():
            for runs in s["runs"].values():
                for m in runs.values():
                    m.pop("wall_s")
        return j

    ref = strip(tiny_report)
    assert strip(again) == ref
    # two scenarios are prepared side by side in the pool: the same loads, the same numbers
    other = parse_scenario({**copy.deepcopy(TINY), "name": "tiny2", "seed": 3}, "tiny2.yaml")
    both = run_suite([parse_scenario(copy.deepcopy(TINY), "tiny.yaml"), other], SuiteSettings(jobs=2, progress=False))
    assert strip(both)["scenarios"]["tiny"] == ref["scenarios"]["tiny"]


def test_every_contender_finishes_every_request_one_way_or_another(tiny_report):
    j = tiny_report["scenarios"]["tiny"]
    assert set(j["mean"]) == {"natsched", "dynamo", "sglang"}
    for c, runs in j["runs"].items():
        for m in runs.values():
            assert m["completed"] + m["rejected"] + m["failed"] == m["requests"]
    nat = j["runs"]["natsched"]
    assert all(m["lost"] == 0 for m in nat.values())  # rescued, not lost
    assert j["headline"] == "online_goodput" and j["verdict"] in ("ahead", "behind", "level")
    table = scenario_table("tiny", j)
    assert "natsched" in table and "online_goodput" in table
    assert "tiny" in summary_table(tiny_report)


def test_goodput_ceiling_splits_what_was_offered_in_the_burst_windows():
    from natsched.sim.bench_scenarios import _burst_goodput, _goodput_ceiling

    sc = parse_scenario({**copy.deepcopy(TINY), "traffic": {**TINY["traffic"], "bursts": [
        {"at_s": 4, "duration_s": 2, "factor": 2}]}}, "t")  # windows: [4, 6) and [6, 8)
    recs = [make_record(0, arrival=1.0),  # before the windows: not counted
            make_record(1, arrival=4.0, ttft=0.5),  # good
            make_record(2, arrival=5.0, ttft=3.0),  # late
            make_record(3, arrival=6.5, ttft=30.0, degraded=True),  # degraded
            make_record(4, arrival=7.0, status="rejected"),  # unserved
            make_record(5, arrival=7.5, cls="batch"),  # not online
            make_record(6, arrival=8.0)]  # after the windows
    c = _goodput_ceiling(sc, recs, 0.0, 1.0, 20.0)
    assert c == {"online_offered": 4 / 4, "online_good": 1 / 4, "online_late": 1 / 4, "online_degraded": 1 / 4,
                 "online_unserved": 1 / 4}
    good = [r for r in recs if r.cls == "online" and r.first_token is not None and r.first_token - r.arrival <= 1.0]
    assert c["online_good"] == _burst_goodput(sc, good, 0.0)["goodput_bursts_and_after"]


def test_no_contender_beats_the_goodput_ceiling(tiny_report):
    j = tiny_report["scenarios"]["tiny"]
    c = j["ceiling"]
    for runs in j["runs"].values():
        for m in runs.values():
            parts = sum(m[f"online_{k}"] for k in ("good", "late", "degraded", "unserved"))
            assert parts == pytest.approx(m["online_offered"])
            assert m["online_good"] == pytest.approx(m["online_goodput"])  # no bursts: the whole window
    offered = {lb: {runs[lb]["online_offered"] for runs in j["runs"].values()} for lb in j["loads"]}
    assert all(len(v) == 1 for v in offered.values())  # every contender saw the same arrivals
    assert c["offered"] > 0 and j["ratio"] <= c["max_ratio"]
    assert "can be at most" in summary_table(tiny_report)


def test_every_phase_gets_its_own_paired_verdict_against_its_own_best_peer():
    sc = parse_scenario({**copy.deepcopy(TINY), "headline": {"metric": "phase_ttft_p99_s", "phases_s": [8]}}, "t")
    loads = [Load("l1", None, 1), Load("l2", None, 2), Load("l3", None, 3)]
    res = []  # phase 1: natsched beats both; phase 2: dynamo is the best peer there and beats natsched
    for lb, k in zip(["l1", "l2", "l3"], [0.0, 0.01, 0.02]):
        for c, (p1, p2) in (("natsched", (1.0 + k, 3.0 + k)), ("dynamo", (2.0 + k, 2.0 - k)),
                            ("sglang", (1.5 + k, 4.0))):
            res.append({"contender": c, "load": lb, "ttft": [], "metrics": {
                "phase_ttft_p99_s": max(p1, p2), "phase1_ttft_p99_s": p1, "phase2_ttft_p99_s": p2,
                "ttft_p99_s": 1.0, "ttft_p50_s": 0.1, "hit_ratio": 0.5}})
    j = judge(sc, loads, res)
    one, two = j["paired"]["phase1_ttft_p99_s"], j["paired"]["phase2_ttft_p99_s"]
    assert (one["peer"], one["verdict"]) == ("sglang", "ahead")
    assert (two["peer"], two["verdict"]) == ("dynamo", "behind")
    assert [(p["from_s"], p["to_s"]) for p in j["phases"]] == [(0.0, 8.0), (8.0, None)]
    line = summary_table({"scenarios": {"t": j}}).splitlines()[-1]
    assert line.startswith("t per phase") and "0-8 s 1.010 / sglang 1.510 ahead" in line
    assert "8-end s 3.010 / dynamo 1.990 behind" in line


def test_a_run_reports_each_phase_as_its_own_metric():
    sc = parse_scenario({**copy.deepcopy(TINY), "headline": {"metric": "phase_ttft_p99_s", "phases_s": [8]},
                         "contenders": ["natsched"], "sweep": {"points": 1}}, "t")
    j = run_suite([sc], SuiteSettings(jobs=1, progress=False))["scenarios"]["tiny"]
    m = next(iter(j["runs"]["natsched"].values()))
    assert [m["phase1_ttft_p99_s"], m["phase2_ttft_p99_s"]] == [p["ttft_p99_s"] for p in m["phases"]]
    assert m["phase_ttft_p99_s"] == max(m["phase1_ttft_p99_s"], m["phase2_ttft_p99_s"])


def test_natsched_alone_is_shown_and_not_judged():
    sc = parse_scenario(copy.deepcopy(TINY), "t")
    loads = [Load("l1", None, 1), Load("l2", None, 2)]
    res = [{"contender": "natsched", "load": lb, "ttft": [], "metrics": {
        "online_goodput": v, "ttft_p99_s": 1.0, "ttft_p50_s": 0.1, "hit_ratio": 0.5}}
        for lb, v in (("l1", 2.0), ("l2", 4.0))]
    j = judge(sc, loads, res)
    assert j["paired"]["online_goodput"] == {"ours": 3.0} and j["verdict"] is None and j["ceiling"] is None
    row = summary_table({"scenarios": {"t": j}}).splitlines()[-1].split()
    assert row[0] == "t" and "3.000" in row and row[-2:] == ["-", "0"]


def test_paired_verdict_over_loads():
    loads = [Load("l1", None, 1), Load("l2", None, 2), Load("l3", None, 3)]
    sc = parse_scenario(copy.deepcopy(TINY), "t")
    res = []
    for lb, (ours, theirs, other) in zip(["l1", "l2", "l3"], [(10, 5, 1), (11, 5.2, 1), (12, 5.1, 1)]):
        for c, v in (("natsched", ours), ("dynamo", theirs), ("sglang", other)):
            res.append({"contender": c, "load": lb, "metrics": {"online_goodput": v, "ttft_p99_s": 1.0,
                                                               "ttft_p50_s": 0.1, "hit_ratio": 0.5},
                        "ttft": []})
    j = judge(sc, loads, res)
    assert j["best_peer"] == "dynamo" and j["verdict"] == "ahead" and j["ratio"] == pytest.approx(11 / 5.1)


def test_contender_names():
    assert {"natsched", "natsched-noadmit", "sglang", "smg-priority", "dynamo", "llm-d", "vllm-router",
            "production-stack", "aibrix"} == set(CONTENDERS)


def test_the_command_runs_a_file_and_refuses_a_bad_one(tmp_path, capsys):
    import json

    import orjson

    from natsched.cli.app import main

    good = tmp_path / "tiny.json"
    spec = copy.deepcopy(TINY)
    spec["contenders"] = ["natsched", "sglang"]
    spec["sweep"] = {"points": 1}
    good.write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    assert main(["bench", "scenarios", str(good), "--json", str(out), "--no-progress", "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "scenario tiny" in printed and "summary" in printed and "sglang" in printed
    data = orjson.loads(out.read_bytes())
    assert set(data["scenarios"]["tiny"]["mean"]) == {"natsched", "sglang"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncluster: {workers: [{count: 1, profile: h200}]}\n")
    assert main(["bench", "scenarios", str(bad), "--no-progress"]) == 1
    assert "cluster.workers[0].profile: unknown profile 'h200'" in capsys.readouterr().err
    assert main(["bench", "scenarios", str(good), "--only", "nope", "--no-progress"]) == 1
    assert "no scenario named nope" in capsys.readouterr().err


def test_quick_runs_two_loads_and_no_unjudged_variant():
    raw = {**copy.deepcopy(TINY), "sweep": {"points": 3, "span": 0.2}}
    raw.pop("contenders")
    rep = run_suite([parse_scenario(raw, "tiny.yaml")], SuiteSettings(jobs=1, quick=True, progress=False))
    j = rep["scenarios"]["tiny"]
    assert j["loads"] == ["load0.8", "load1.2"] and j["verdict"] in ("ahead", "behind", "level")
    assert "natsched-noadmit" not in j["runs"] and {"natsched", "llm-d", "dynamo"} <= set(j["runs"])
    named = run_suite([parse_scenario(raw, "tiny.yaml")], SuiteSettings(jobs=1, quick=True, progress=False,
                                                                          contenders=["natsched", "natsched-noadmit"]))
    assert set(named["scenarios"]["tiny"]["runs"]) == {"natsched", "natsched-noadmit"}


def test_seeds_redraw_the_traffic_of_every_load_and_pair_the_verdict_over_the_draws():
    from natsched.sim.bench_scenarios import build_loads

    sc = parse_scenario({**copy.deepcopy(TINY), "sweep": {"points": 2, "span": 0.2}}, "tiny.yaml")
    one = build_loads(sc, SuiteSettings(progress=False))
    three = build_loads(sc, SuiteSettings(progress=False, seeds=3))
    assert [ld.label for ld in one] == ["load0.8", "load1.2"]
    assert [ld.label for ld in three] == [f"load{f}-s{s}" for f in ("0.8", "1.2") for s in (2, 3, 4)]
    assert [ld.seed for ld in three[:3]] == [None, 3, 4]  # the file's seed draws what one draw would
    assert [r.arrival for r in three[0].trace.requests] == [r.arrival for r in one[0].trace.requests]
    first = [(r.arrival, r.input_length) for r in three[0].trace.requests]
    assert first != [(r.arrival, r.input_length) for r in three[1].trace.requests]
    assert {ld.speed for ld in three[:3]} == {one[0].speed}  # the same load, another draw
    rep = run_suite([sc], SuiteSettings(jobs=1, progress=False, seeds=2, contenders=["natsched", "sglang"]))
    j = rep["scenarios"]["tiny"]
    assert len(j["loads"]) == 4 and j["paired"]["online_goodput"]["loads"] == 4
    assert all(set(j["runs"][c]) == set(j["loads"]) for c in ("natsched", "sglang"))


def test_seeds_do_not_redraw_a_trace():
    from natsched.sim.bench_scenarios import build_loads

    raw = {"name": "tr", "cluster": {"workers": [{"count": 2, "profile": "h100-llama8b"}]},
           "traffic": {"trace": "mooncake", "limit": 60, "target_busy": [0.5]},
           "headline": {"metric": "ttft_p50_s"}, "sweep": {"points": 1}}
    sc = parse_scenario(raw, "tr.yaml")
    loads = build_loads(sc, SuiteSettings(progress=False, seeds=3))
    assert len(loads) == 1 and loads[0].seed is None


def test_peers_and_the_load_yardstick_keep_the_router_rule_they_were_measured_with():
    """natsched's panic threshold is natsched's: every peer (and the least_loaded yardstick that sets
    every scenario's loads) opens half-open and backoff workers only when no other may take it."""
    from natsched.router.core import RouterSettings
    from natsched.sim.bench_scenarios import YARDSTICK_ROUTER

    assert RouterSettings().panic_threshold == 0.5 and YARDSTICK_ROUTER["panic_threshold"] == 0.0
    for name, c in CONTENDERS.items():
        got = RouterSettings(**c.router_settings()).panic_threshold
        assert got == (0.5 if name.startswith("natsched") else 0.0), name
