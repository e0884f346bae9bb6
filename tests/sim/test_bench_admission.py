"""The admission benchmark: workload parsing and generation, the run, its JSON and its errors."""

import argparse

import orjson
import pytest

from natsched.admitter.policy import AdmitterCore
from natsched.sim.admission_policies import make_request
from natsched.sim.admission_workload import DEFAULT_WORKLOAD, AdmissionWorkload, AdmissionWorkloadError, generate
from natsched.cli.bench import add_admission_parser, run_admission
from natsched.sim.bench_admission import POLICIES, run_admission_benchmark
from natsched.sim.errors import SimError

POLICY_KEYS = {"long_token_share", "long_completion_ratio", "short_completion_ratio", "tenants", "jain_backlogged",
               "queue_wait_p50_s", "queue_wait_p99_s", "decision_latency_p50_ms", "decision_latency_p99_ms",
               "max_overadmit_tokens"}


def tiny(**changes) -> dict:
    w = {"total_runtime_tokens": 100_000, "duration_s": 8, "overload": 3.0, "long_threshold_tokens": 4096,
         "long_fraction": 0.3, "reserve_long_share": 0.2, "queue_timeout_s": 5,
         "tenants": [{"name": "a", "floor": 0.6, "weight": 1, "rate_share": 0.3},
                     {"name": "b", "floor": 0.4, "weight": 2, "rate_share": 0.7}]}
    w.update(changes)
    return w


def parse(argv):
    parser = argparse.ArgumentParser()
    add_admission_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["admission", *argv])


def test_generated_requests_follow_the_workload():
    w = AdmissionWorkload.from_dict(tiny(duration_s=60))
    reqs = generate(w)
    assert reqs == generate(w)  # deterministic
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    assert all(r.cost == 2 * r.prompt_tokens + r.output_tokens for r in reqs)
    assert all(r.long == (r.cost >= 4096) for r in reqs)
    core = AdmitterCore()
    assert all(core.cost(make_request(r)) == r.cost for r in reqs[:200])  # the admitter prices them alike
    load = sum(r.cost * r.hold_s for r in reqs)
    assert load == pytest.approx(3.0 * 100_000 * 60, rel=0.25)  # overload x capacity x duration
    long_load = sum(r.cost * r.hold_s for r in reqs if r.long)
    assert long_load / load == pytest.approx(0.3, abs=0.1)
    a_load = sum(r.cost * r.hold_s for r in reqs if r.tenant == "a")
    assert a_load / load == pytest.approx(0.3, abs=0.1)


def test_benchmark_json_has_every_key_on_a_tiny_workload():
    report = run_admission_benchmark(AdmissionWorkload.from_dict(tiny()))
    out = orjson.loads(orjson.dumps(report.to_json()))
    assert set(out["policies"]) == set(POLICIES)
    for name, metrics in out["policies"].items():
        assert POLICY_KEYS <= set(metrics), name
        assert set(metrics["tenants"]) == {"a", "b"}
        for t in metrics["tenants"].values():
            assert {"share", "floor", "floor_ratio"} <= set(t)
        assert metrics["max_overadmit_tokens"] == 0
        assert metrics["admitted"] <= metrics["offered"] == out["requests"]
    assert out["workload"]["total_runtime_tokens"] == 100_000
    assert set(out["targets"]) >= {"natsched_long_token_share", "natsched_max_overadmit_tokens"}
    assert "natsched" in report.table() and "count_fifo" in report.table()


def test_both_policies_see_identical_arrivals():
    report = run_admission_benchmark(AdmissionWorkload.from_dict(tiny()))
    offered = {m["offered"] for m in report.policies.values()}
    assert offered == {report.requests}


def test_command_writes_json(tmp_path, capsys):
    wl = tmp_path / "w.json"
    wl.write_bytes(orjson.dumps(tiny()))
    out = tmp_path / "sub" / "out.json"
    assert run_admission(parse(["--workload", str(wl), "--json", str(out), "--no-progress"])) == 0
    data = orjson.loads(out.read_bytes())
    assert set(data["policies"]) == {"natsched", "count_fifo"}
    assert "admission benchmark" in capsys.readouterr().out


def test_default_workload_is_the_issue_one():
    w = AdmissionWorkload.load(None)
    assert (w.total_runtime_tokens, w.duration_s, w.overload, w.reserve_long_share) == (400_000, 120, 3.0, 0.2)
    assert [(t.name, t.floor, t.rate_share) for t in w.tenants] == [("a", 0.5, 0.2), ("b", 0.3, 0.3), ("c", 0.2, 0.5)]
    assert AdmissionWorkload.from_dict(DEFAULT_WORKLOAD, "built-in default") == w


@pytest.mark.parametrize("data,message", [
    ([1, 2], "must be a JSON object"),
    ({k: v for k, v in tiny().items() if k != "overload"}, "missing field(s) 'overload'"),
    (tiny(overlaod=2), "unknown field(s) 'overlaod'"),
    (tiny(overload=0), "'overload' must be >"),
    (tiny(overload="3"), "'overload' must be a number"),
    (tiny(total_runtime_tokens=1.5), "'total_runtime_tokens' must be an integer"),
    (tiny(long_fraction=1.2), "'long_fraction'"),
    (tiny(tenants=[]), "non-empty list"),
    (tiny(tenants=[{"name": "a", "floor": 0.7, "weight": 1, "rate_share": 0.5},
                   {"name": "b", "floor": 0.4, "weight": 1, "rate_share": 0.5}]), "floors sum to 1.100"),
    (tiny(tenants=[{"name": "a", "floor": 0.5, "weight": 1, "rate_share": 0.5}]), "rate_share values must sum to 1"),
    (tiny(tenants=[{"name": "a", "floor": 0.5, "weight": 1}]), "missing field(s) rate_share"),
    (tiny(tenants=[{"name": "a b", "floor": 0.5, "weight": 1, "rate_share": 1}]), "name must be"),
    (tiny(tenants=[{"name": "a", "floor": 0.5, "weight": 1, "rate_share": 0.5},
                   {"name": "a", "floor": 0.1, "weight": 1, "rate_share": 0.5}]), "appears twice"),
    (tiny(long_threshold_tokens=200), "so that short requests exist"),
    (tiny(long_threshold_tokens=100_000), "cannot fit in the total"),
    (tiny(output_tokens=[10]), "'output_tokens'"),
    (tiny(profile="tpu"), "unknown engine profile"),
])
def test_bad_workloads_are_refused_with_a_clear_message(data, message):
    with pytest.raises(AdmissionWorkloadError) as err:
        AdmissionWorkload.from_dict(data, "w.json")
    assert message in str(err.value) and str(err.value).startswith("w.json: ")
    assert isinstance(err.value, SimError)  # the bench command's error path catches it


def test_command_reports_bad_files_and_exits_1(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_admission(parse(["--workload", str(bad), "--no-progress"])) == 1
    assert "not JSON" in capsys.readouterr().err
    assert run_admission(parse(["--workload", str(tmp_path / "missing.json"), "--no-progress"])) == 1
    assert "cannot read workload" in capsys.readouterr().err
    floors = tmp_path / "floors.json"
    floors.write_bytes(orjson.dumps(tiny(tenants=[{"name": "a", "floor": 0.8, "weight": 1, "rate_share": 0.5},
                                                   {"name": "b", "floor": 0.8, "weight": 1, "rate_share": 0.5}])))
    assert run_admission(parse(["--workload", str(floors), "--no-progress"])) == 1
    assert "floors sum to 1.600" in capsys.readouterr().err


def test_metrics_on_a_hand_made_run():
    """One long request stuck behind a big short one: count_fifo lets a later short one pass it,
    natsched keeps the order (and the reserve), which the long-token share tells apart."""
    from natsched.sim.admission_metrics import summarize
    from natsched.sim.admission_policies import CountFifo, NatschedAdmission
    from natsched.sim.admission_sim import run_policy
    from natsched.sim.admission_workload import SimRequest

    w = AdmissionWorkload.from_dict(tiny(total_runtime_tokens=1000, duration_s=10, long_threshold_tokens=400,
                                         output_tokens=[2, 2], tenants=[{"name": "a", "floor": 1.0, "weight": 1,
                                                                         "rate_share": 1.0}]))
    reqs = [SimRequest(0, "a", 0.0, 449, 2, 900, 5.0, False), SimRequest(1, "a", 1.0, 249, 2, 500, 1.0, True),
            SimRequest(2, "a", 2.0, 49, 2, 100, 1.0, False)]
    nat = summarize(run_policy(NatschedAdmission(w), w, reqs), w, 0.0)
    fifo = summarize(run_policy(CountFifo(w, per_tick=5), w, reqs), w, 0.0)
    assert nat["long_token_share"] == pytest.approx(500 / 600, abs=1e-4)  # both admitted at t=5, long first
    assert fifo["long_token_share"] == 0.0  # the short one passed the long one while both waited
    assert nat["utilization"] == pytest.approx((900 * 5 + 500 + 100) / (1000 * 10), abs=1e-4)
    assert nat["queue_wait_p50_s"] == pytest.approx(3.0)  # waits 0, 4 and 3 s
    assert fifo["queue_wait_p50_s"] <= 0.1  # S goes at the next tick, L only at 5 s
    assert nat["max_overadmit_tokens"] == fifo["max_overadmit_tokens"] == 0
    assert nat["long_completion_ratio"] == nat["short_completion_ratio"] == 1.0
    assert nat["tenants"]["a"]["floor_ratio"] == pytest.approx(1.0)
