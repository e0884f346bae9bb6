"""Judging routing on a sweep of loads (sim/sweep.py) and ``bench routing --sweep``."""

from __future__ import annotations

import json

import pytest

from natsched.cli.app import main
from natsched.sim.sweep import summarize, sweep_speedups, targets, verdict
from tests.sim.test_bench_routing import trace_file  # noqa: F401  (the module fixture: the shared trace)


def metrics(p50=0.1, p99=3.0, hit=0.3, cv=0.05, **extra) -> dict:
    """One policy's result with keyword defaults; every key summarize() averages."""
    m = {"ttft_p50_s": p50, "ttft_p90_s": p99 / 2, "ttft_p99_s": p99, "e2e_p50_s": 1.0, "e2e_p99_s": 5.0,
         "tpot_p50_s": 0.01, "hit_ratio": hit, "throughput_tok_s": 1000.0, "load_cv": cv, "migration_rate": 0.1,
         "busy": 0.8}
    m.update(extra)
    return m


def test_speedups_are_spread_evenly_around_the_chosen_one():
    assert sweep_speedups(2.0, 1, 0.05) == [2.0]
    assert sweep_speedups(2.0, 5, 0.05) == pytest.approx([1.9, 1.95, 2.0, 2.05, 2.1])
    assert sweep_speedups(1.0, 2, 0.1) == pytest.approx([0.9, 1.1])


def test_targets_compare_ours_with_every_peer():
    run = {"natsched": metrics(p50=0.1, p99=2.9, hit=0.35, cv=0.02),
           "least_loaded": metrics(p50=0.3, p99=3.5, hit=0.05, cv=0.12),
           "preble_e2": metrics(p50=0.12, p99=3.0, hit=0.36, cv=0.15)}
    t = targets(run)
    assert t["ttft_p50"] and t["ttft_p99"] and t["load_cv"]
    assert not t["hit_ratio"] and t["best_peer_hit"] == "preble_e2"
    assert t["hit_ratio_gap"] == pytest.approx(-0.01)
    run["natsched"]["load_cv"] = 0.23  # least_loaded's + more than 0.1
    assert not targets(run)["load_cv"]
    assert targets({"natsched": metrics()}) == {}  # no peer: nothing to judge


def test_summary_means_and_point_by_point_wins():
    runs = {
        0.95: {"natsched": metrics(hit=0.34), "preble_e2": metrics(p50=0.2, p99=4.0, hit=0.35)},
        1.00: {"natsched": metrics(hit=0.36), "preble_e2": metrics(p50=0.2, p99=4.0, hit=0.34)},
        1.05: {"natsched": metrics(hit=0.35), "preble_e2": metrics(p50=0.2, p99=4.0, hit=0.33)},
    }
    s = summarize(runs)
    assert s["points"] == 3 and s["speedups"] == [0.95, 1.0, 1.05]
    assert s["mean"]["natsched"]["hit_ratio"] == pytest.approx(0.35)
    assert s["mean"]["preble_e2"]["hit_ratio"] == pytest.approx(0.34)
    assert s["mean"]["natsched"]["hit_ratio_stdev"] > 0
    assert s["targets_on_mean"]["hit_ratio"] and s["wins"]["hit_ratio"] == 2  # lost the first point
    assert s["wins"]["ttft_p50"] == 3 and set(s["runs"]) == {"0.95", "1", "1.05"}
    hit = s["paired"]["hit_ratio"]  # ours minus the peer, load by load: -0.01, +0.02, +0.02
    assert hit["peer"] == "preble_e2" and hit["mean_diff"] == pytest.approx(0.01)
    assert hit["se"] == pytest.approx(0.03 ** 0.5 / 10 / 3 ** 0.5)  # sample stdev sqrt(0.0003), over sqrt(3)
    p99 = s["paired"]["ttft_p99_s"]
    assert p99["peer"] == "preble_e2" and p99["mean_diff"] == pytest.approx(-1.0) and p99["se"] == pytest.approx(0.0)
    assert hit["verdict"] == "level"  # +0.01 with a standard error of 0.01: within two of them
    assert p99["verdict"] == "ahead" and s["paired"]["ttft_p50_s"]["verdict"] == "ahead"


@pytest.mark.parametrize("diff, se, higher, want", [
    (0.05, 0.01, True, "ahead"), (-0.05, 0.01, True, "behind"), (0.015, 0.01, True, "level"),
    (-0.05, 0.01, False, "ahead"), (0.05, 0.01, False, "behind"), (0.02, 0.01, False, "level"),
    (0.3, None, True, "level"), (0.0, 0.0, True, "level"), (-0.1, 0.0, False, "ahead"),
])
def test_a_paired_difference_ranks_only_beyond_two_standard_errors(diff, se, higher, want):
    assert verdict(diff, se, higher) == want


def test_paired_differences_take_the_closest_peer_per_metric_and_need_two_loads_for_an_error():
    runs = {1.0: {"natsched": metrics(p50=0.10, p99=3.0, hit=0.30),
                  "fast": metrics(p50=0.05, p99=3.5, hit=0.10),
                  "sticky": metrics(p50=0.20, p99=2.9, hit=0.31)}}
    s = summarize(runs)
    assert {k: v["peer"] for k, v in s["paired"].items()} == {
        "ttft_p50_s": "fast", "ttft_p99_s": "sticky", "hit_ratio": "sticky"}
    assert s["paired"]["ttft_p50_s"]["mean_diff"] == pytest.approx(0.05)
    assert all(v["se"] is None for v in s["paired"].values())  # one load: no spread to measure
    assert {v["verdict"] for v in s["paired"].values()} == {"level"}  # ... so it ranks nothing
    assert summarize({1.0: {"natsched": metrics()}})["paired"] == {}  # no peer


def test_bench_routing_sweep_writes_means_and_verdicts(trace_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "sweep.json"
    code = main(["bench", "routing", "--trace", str(trace_file), "--limit", "150", "--workers", "4",
                 "--policies", "natsched,least_loaded,consistent_hash", "--speedup", "1.5", "--sweep", "3",
                 "--sweep-span", "0.1", "--jobs", "1", "--no-progress", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["speedup"] == 1.5 and set(data["targets"]) >= {"ttft_p50", "ttft_p99", "hit_ratio", "load_cv"}
    sweep = data["sweep"]
    assert sweep["speedups"] == pytest.approx([1.35, 1.5, 1.65]) and sweep["points"] == 3
    assert set(sweep["mean"]) == {"natsched", "least_loaded", "consistent_hash"}
    # the chosen speed-up's runs are the single-run table's, and the means are of the three runs
    assert sweep["runs"]["1.5"]["natsched"]["hit_ratio"] == data["policies"]["natsched"]["hit_ratio"]
    hits = [sweep["runs"][k]["natsched"]["hit_ratio"] for k in sweep["runs"]]
    assert sweep["mean"]["natsched"]["hit_ratio"] == pytest.approx(sum(hits) / 3)
    pair = sweep["paired"]["hit_ratio"]  # load by load against the best peer on the means
    peer_hits = [sweep["runs"][k][pair["peer"]]["hit_ratio"] for k in sweep["runs"]]
    assert pair["mean_diff"] == pytest.approx((sum(hits) - sum(peer_hits)) / 3) and pair["se"] is not None
    text = capsys.readouterr().out
    assert "targets (this run)" in text and "targets on the means" in text and "met point by point" in text
    assert "natsched minus the closest peer, mean ± standard error over 3 loads (level: within 2 standard " \
        "errors): ttft p50" in text
    assert f"vs {pair['peer']} ({pair['verdict']})" in text and pair["verdict"] in {"ahead", "behind", "level"}


@pytest.mark.parametrize("argv", [["--sweep", "0"], ["--sweep-span", "1.5"], ["--sweep-span", "0"]])
def test_bad_sweep_flags_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "routing", "--trace", str(tmp_path / "t.jsonl"), *argv])
    assert exc.value.code == 2
