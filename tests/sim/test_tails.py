"""Where the tail waits (sim/tails.py): the split of the slowest requests, pooled, printed, and on real runs."""

from __future__ import annotations

import copy
import json

import orjson
import pytest

from natsched.sim.bench_scenarios import SuiteSettings, run_suite, tail_table
from natsched.sim.scenario import parse_scenario
from natsched.sim.ideal import prefill_alone_s
from natsched.sim.tails import ALL, merge_tails, tail_split
from natsched.workers.profiles import H100_LLAMA8B
from tests.factories.sim import make_record
from tests.sim.test_bench_scenarios import TINY


def row(tail, model=ALL, cls=ALL):
    """The row of ``tail`` for (model, class)."""
    found = [t for t in tail if t["model"] == model and t["cls"] == cls]
    assert len(found) == 1, (model, cls, tail)
    return found[0]


def _run():
    """203 served requests: 200 quick ones on model a, three slow (two of b held at the door, one of a
    slow in the engine), and one refused."""
    recs = [make_record(i, arrival=float(i), ttft=0.1 + i * 1e-4) for i in range(200)]
    recs += [make_record(200, arrival=200.0, ttft=5.0, door=4.5, degraded=True, prompt_tokens=1000, cached_tokens=200, attempts=3),
             make_record(201, arrival=201.0, ttft=4.0, door=3.0, prompt_tokens=1000, cached_tokens=960, attempts=2),
             make_record(202, arrival=202.0, ttft=6.0, door=0.0, prompt_tokens=2000, cached_tokens=0),
             make_record(203, arrival=203.0, status="rejected", ttft=None)]
    models = {i: "a" for i in range(204)} | {200: "b", 201: "b"}
    floors = {i: 0.05 for i in range(204)} | {202: 0.5}
    ideal = {200: 800, 201: 600, 202: 1000}
    return recs, models, floors, ideal, {"w0": H100_LLAMA8B}


def test_the_tail_is_what_sets_the_p99_split_at_the_door_and_in_the_engine():
    got = tail_split(*_run())
    assert row(got)["n"] == 3  # the three slow ones; the refused one has no TTFT
    assert [(t["model"], t["cls"]) for t in got] == [(ALL, ALL), ("a", "online"), ("b", "online")]
    b, a = row(got, "b", "online"), row(got, "a", "online")
    assert b["n"] == 2 and a["n"] == 1
    assert b["ttft_s"] == pytest.approx(4.5) and b["door_s"] == pytest.approx(3.75)
    assert b["engine_s"] == pytest.approx(0.75) and b["attempts"] == pytest.approx(2.5)
    assert b["degraded"] == 0.5 and a["degraded"] == 0.0
    # the engine's part: its own prefill alone on the worker's engine with the cache it had, and the rest
    own = [prefill_alone_s(H100_LLAMA8B, 1000, 200), prefill_alone_s(H100_LLAMA8B, 1000, 960)]
    assert 0 < own[1] < own[0] < 0.5
    assert b["prefill_s"] == pytest.approx(sum(own) / 2) and b["queue_s"] == pytest.approx(0.75 - sum(own) / 2)
    assert a["prefill_s"] == pytest.approx(prefill_alone_s(H100_LLAMA8B, 2000, 0))
    assert b["missed_cache"] == pytest.approx((600 / 1000 + 0) / 2)  # the second had more cached than ideal
    assert a["door_s"] == 0.0 and a["engine_s"] == pytest.approx(6.0) and a["floor_s"] == pytest.approx(0.5)
    assert a["missed_cache"] == pytest.approx(0.5)
    every = row(got)
    assert every["door_s"] + every["engine_s"] == pytest.approx(every["ttft_s"])


def test_an_attempt_lost_with_a_worker_counts_at_the_door_and_a_migrated_stream_keeps_its_first_hand_off():
    recs, models, floors, ideal, profiles = _run()
    recs[202].first_routed, recs[202].routed = 202.0, 205.0  # lost on its first worker, served by the second
    assert row(tail_split(recs, models, floors, ideal, profiles), "a", "online")["door_s"] == pytest.approx(3.0)
    recs[202].first_routed, recs[202].routed = 202.5, 209.0  # its stream went on elsewhere after the first token
    a = row(tail_split(recs, models, floors, ideal, profiles), "a", "online")
    assert a["door_s"] == pytest.approx(0.5) and a["engine_s"] == pytest.approx(5.5)


def test_no_served_request_no_tail():
    assert tail_split([make_record(0, status="rejected", ttft=None)], {}, {}, {}, {}) == []


def test_cells_pool_weighted_by_their_tail_size():
    def cell(n, ttft, door, missed, attempts, cls="online"):
        return {"model": "m", "cls": cls, "n": n, "ttft_s": ttft, "door_s": door, "engine_s": ttft - door,
                "prefill_s": 0.0, "queue_s": ttft - door,
                "floor_s": 0.1, "missed_cache": missed, "attempts": attempts, "degraded": 0.0}

    got = merge_tails([[cell(1, 1.0, 1.0, 0.0, 1.0)], None, [cell(3, 5.0, 1.0, 0.4, 2.0), cell(2, 9.0, 9.0, 0.0, 1.0,
                                                                                          "batch")], []])
    assert [(t["model"], t["cls"]) for t in got] == [("m", "batch"), ("m", "online")]
    online = row(got, "m", "online")
    assert online["n"] == 4
    assert online["ttft_s"] == pytest.approx(4.0) and online["engine_s"] == pytest.approx(3.0)
    assert online["missed_cache"] == pytest.approx(0.3) and online["attempts"] == pytest.approx(1.75)
    assert row(got, "m", "batch")["door_s"] == 9.0
    assert merge_tails([None, []]) == []


@pytest.fixture(scope="module")
def tiny_report():
    sc = parse_scenario({**copy.deepcopy(TINY), "contenders": ["natsched", "sglang"]}, "tiny.yaml")
    return run_suite([sc], SuiteSettings(jobs=1, progress=False))


def test_every_run_reports_a_tail_that_adds_up_and_sits_above_its_floor(tiny_report):
    j = tiny_report["scenarios"]["tiny"]
    for contender, runs in j["runs"].items():
        for m in runs.values():
            t = row(m["tail"])
            assert t["n"] >= 1
            assert t["door_s"] + t["engine_s"] == pytest.approx(t["ttft_s"])
            assert t["queue_s"] + t["prefill_s"] == pytest.approx(t["engine_s"]) and t["prefill_s"] > 0
            assert 0 <= t["floor_s"] <= t["ttft_s"] and 0 <= t["missed_cache"] <= 1 and t["attempts"] >= 1
            assert t["ttft_s"] >= m["ttft_p99_s"]  # the requests at or past the p99
        pooled = row(j["tails"][contender])
        assert pooled["n"] == sum(row(m["tail"])["n"] for m in runs.values())
        assert pooled["n"] == sum(t["n"] for t in j["tails"][contender] if t["model"] != ALL)
    # sglang neither queues nor rescues: a tail request retried after its worker died waited at the door
    for m in j["runs"]["sglang"].values():
        t = row(m["tail"])
        assert (t["attempts"] > 1) == (t["door_s"] > 0)
    table = tail_table("tiny", j)
    assert "where the tail waits (tiny)" in table and "natsched" in table and "sglang" in table


def test_a_rescued_request_keeps_its_first_hand_off():
    from natsched.sim.bench_scenarios import build_loads, sim_settings, drawn
    from natsched.sim.contenders import CONTENDERS, make_gate
    from natsched.sim.des import simulate

    sc = parse_scenario(copy.deepcopy(TINY), "tiny.yaml")
    load = build_loads(sc, SuiteSettings(jobs=1, progress=False))[-1]
    c = CONTENDERS["natsched"]
    res = simulate(load.trace, sim_settings(drawn(sc, load.seed), c.policy, c.rescue, router=c.router_settings()),
                   admission=make_gate(c, {t.name: (t.floor, t.weight) for t in sc.traffic.tenants}, sc.slo_ttft_s))
    routed = [r for r in res.records if r.routed is not None]
    assert routed and all(r.first_routed is not None and r.first_routed <= r.routed for r in routed)
    again = [r for r in routed if r.rescued or r.migrated]
    assert again and all(r.first_routed < r.routed for r in again)  # the kill at 8 s: routed twice


def test_the_command_prints_the_tails_and_writes_them(tmp_path, capsys):
    from natsched.cli.app import main

    spec = {**copy.deepcopy(TINY), "contenders": ["natsched", "sglang"], "sweep": {"points": 1}}
    good = tmp_path / "tiny.json"
    good.write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    assert main(["bench", "scenarios", str(good), "--no-progress", "--jobs", "1", "--json", str(out)]) == 0
    assert "where the tail waits" not in capsys.readouterr().out  # only asked for
    data = orjson.loads(out.read_bytes())
    assert set(data["scenarios"]["tiny"]["tails"]) == {"natsched", "sglang"}
    assert main(["bench", "scenarios", str(good), "--no-progress", "--jobs", "1", "--tails"]) == 0
    printed = capsys.readouterr().out
    assert "where the tail waits (tiny)" in printed and "door s" in printed
