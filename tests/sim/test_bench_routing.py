"""The routing benchmark command: policies, JSON keys, table, plot, and clear errors."""

from __future__ import annotations

import builtins
import json
import logging

import pytest

from natsched.sim.trace import MOONCAKE_TRACE

from natsched.cli.bench import _cmd_routing, add_parsers as add_bench_parser
from natsched.cli.app import main
from natsched.router.policies import POLICIES
from natsched.sim.bench_routing import METRIC_KEYS, RoutingBenchSettings, resolve_policies, run_routing_benchmark
from natsched.sim.bench_routing import _captured_logs  # one run's warning counter
from natsched.sim.errors import SimConfigError
from tests.factories.sim import trace_row, write_trace

TOP_KEYS = {"trace", "requests", "workers", "profile", "speedup", "ceiling_hit_ratio", "policies"}


@pytest.fixture(scope="module")
def trace_file():
    return MOONCAKE_TRACE  # shipped in the package: the benchmark's default trace


def test_all_means_every_registered_policy_and_lists_are_checked():
    assert resolve_policies("all") == list(POLICIES)
    assert resolve_policies(None) == list(POLICIES)
    assert resolve_policies("round_robin, least_loaded,round_robin") == ["round_robin", "least_loaded"]
    with pytest.raises(SimConfigError, match="unknown routing policy nope.*known: "):
        resolve_policies("least_loaded,nope")
    with pytest.raises(SimConfigError, match="no policy"):
        resolve_policies(" , ")


def test_bench_routing_limit_200_writes_the_documented_json(trace_file, tmp_path, capsys):
    out = tmp_path / "out.json"
    code = main(["bench", "routing", "--trace", str(trace_file), "--limit", "200", "--json", str(out),
                 "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    assert TOP_KEYS <= set(data)
    assert data["requests"] == 200 and data["workers"] == 8 and data["profile"] == "h100-llama8b"
    assert data["speedup"] == 1.0 and 0.0 <= data["ceiling_hit_ratio"] <= 1.0
    assert list(data["policies"]) == list(POLICIES)
    for name, m in data["policies"].items():
        assert set(METRIC_KEYS) <= set(m), name
        assert m["completed"] + m["rejected"] == 200
        assert 0.0 <= m["hit_ratio"] <= data["ceiling_hit_ratio"] + 1e-9, name
        assert m["ttft_p50_s"] <= m["ttft_p90_s"] <= m["ttft_p99_s"]
    table = capsys.readouterr().out
    assert all(name in table for name in POLICIES) and "reuse ceiling" in table


def test_in_process_and_pooled_runs_agree(trace_file):
    base = dict(trace=str(trace_file), workers=3, policies="least_loaded,consistent_hash", limit=120,
                progress=False)
    one = run_routing_benchmark(RoutingBenchSettings(**base, jobs=1))
    two = run_routing_benchmark(RoutingBenchSettings(**base, jobs=2))
    strip = lambda r: {n: {k: m[k] for k in METRIC_KEYS} for n, m in r.policies.items()}  # noqa: E731
    assert strip(one) == strip(two)
    assert one.ttfts == two.ttfts


def test_target_busy_calibrates_then_uses_one_speedup(trace_file):
    report = run_routing_benchmark(RoutingBenchSettings(
        trace=str(trace_file), workers=4, policies="least_loaded,round_robin", limit=150, target_busy=0.6,
        calib_limit=150, progress=False))
    cal = report.calibration
    assert cal is not None and report.speedup == cal.speedup
    assert len(cal.points) >= 2
    if cal.busy is not None:
        assert abs(cal.busy - 0.6) <= 0.01
        # the full run of least_loaded is the calibration run (same requests, same speed-up)
        assert report.policies["least_loaded"]["busy"] == pytest.approx(cal.busy)
    assert report.to_json()["calibration"]["target_busy"] == 0.6


def test_a_bad_trace_line_is_reported_with_its_number(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(trace_row(0)) + "\n" + '{"timestamp": 5}\n')
    assert main(["bench", "routing", "--trace", str(bad), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "natsched: error:" in err and f"{bad}:2:" in err and "missing fields" in err


@pytest.mark.parametrize("argv", [
    ["--speedup", "2", "--target-busy", "0.8"],
    ["--target-busy", "1.2"],
    ["--speedup", "0"],
    ["--workers", "0"],
    ["--profile", "nope"],
    ["--kv-blocks", "0"],
    ["--kv-blocks", "1.5"],
])
def test_bad_flags_are_refused_by_the_parser(argv, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "routing", "--trace", str(tmp_path / "t.jsonl"), *argv])
    assert exc.value.code == 2


def test_kv_blocks_sets_every_workers_cache_and_is_reported(trace_file, tmp_path, capsys):
    """A what-if for more or less KV: the size reaches every simulated engine (a small cache serves
    less from cache than an unlimited one), the JSON and the title say it, and the default is the
    profile's capacity over the trace's block size."""
    base = dict(trace=str(trace_file), workers=2, policies="natsched", limit=200, progress=False)
    default = run_routing_benchmark(RoutingBenchSettings(**base))
    small = run_routing_benchmark(RoutingBenchSettings(**base, kv_blocks=64))
    big = run_routing_benchmark(RoutingBenchSettings(**base, kv_blocks=100_000))
    from natsched.workers.profiles import get_profile
    assert default.kv_blocks == get_profile("h100-llama8b").kv_blocks(default.block_size) == 834
    assert (small.kv_blocks, big.kv_blocks) == (64, 100_000)
    hit = lambda r: r.policies["natsched"]["hit_ratio"]  # noqa: E731
    assert hit(small) < hit(default) <= hit(big) <= big.ceiling_hit_ratio + 1e-9
    assert big.to_json()["kv_blocks"] == 100_000
    # the pooled-LRU reference follows the cluster's KV: 2 x 64 blocks keep less than 2 x 100,000
    assert 0.0 <= small.pooled_hit_ratio < big.pooled_hit_ratio == pytest.approx(big.ceiling_hit_ratio)
    assert big.to_json()["pooled_hit_ratio"] == big.pooled_hit_ratio
    out = tmp_path / "kv.json"
    assert main(["bench", "routing", "--trace", str(trace_file), "--limit", "50", "--workers", "2",
                 "--policies", "least_loaded", "--kv-blocks", "64", "--json", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["kv_blocks"] == 64
    table = capsys.readouterr().out
    assert "KV 64 blocks (32,768 tokens) per worker" in table and "one LRU as large as all workers' KV" in table


def test_kv_too_small_for_a_request_rejects_it_and_bad_sizes_are_refused(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [trace_row(0, n_in=512 * 8, n_out=4, ids=list(range(8))),
                                              trace_row(10, n_in=512, n_out=4, ids=[100])])
    report = run_routing_benchmark(RoutingBenchSettings(trace=str(trace), workers=1, policies="least_loaded",
                                                        kv_blocks=4, progress=False))
    m = report.policies["least_loaded"]
    assert (m["completed"], m["rejected"]) == (1, 1)  # 8 blocks never fit in 4; 1 does
    for bad in (0, -3, 2.5):
        with pytest.raises(SimConfigError, match="kv_blocks must be an integer >= 1"):
            RoutingBenchSettings(trace=str(trace), kv_blocks=bad)


def test_unknown_policy_is_a_clear_error(trace_file, capsys):
    assert main(["bench", "routing", "--trace", str(trace_file), "--policies", "fastest", "--no-progress"]) == 1
    assert "unknown routing policy fastest" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install_before_running(trace_file, tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out = tmp_path / "o.png"
    code = main(["bench", "routing", "--trace", str(trace_file), "--limit", "20", "--plot", str(out),
                 "--no-progress"])
    captured = capsys.readouterr()
    assert code == 1 and not out.exists()
    assert "pip install" in captured.err and "matplotlib" in captured.err
    assert "routing benchmark" not in captured.out  # it failed fast, before simulating


def test_plot_is_a_png(trace_file, tmp_path):  # matplotlib comes with the bench extra
    out = tmp_path / "o.png"
    code = main(["bench", "routing", "--trace", str(trace_file), "--limit", "60", "--workers", "2",
                 "--policies", "least_loaded,consistent_hash", "--plot", str(out), "--no-progress"])
    assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parser_can_be_added_to_the_main_cli():
    import argparse

    parser = argparse.ArgumentParser(prog="natsched")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "routing", "--trace", "t.jsonl", "--policies", "all", "--target-busy", "0.8"])
    assert (args.command, args.bench, args.policies, args.target_busy, args.workers) == \
        ("bench", "routing", "all", 0.8, 8)
    assert args.handler is _cmd_routing


def test_a_longer_trace_is_calibrated_again_on_all_of_it(trace_file):
    """The first requests' busy is not the whole run's: the speed-up is refined on the whole trace,
    so the reported run of least_loaded is busy the target share (the point of --target-busy)."""
    report = run_routing_benchmark(RoutingBenchSettings(
        trace=str(trace_file), workers=4, policies="least_loaded", limit=400, target_busy=0.6,
        calib_limit=100, progress=False))
    cal = report.calibration
    assert cal is not None and cal.requests == 400 and report.speedup == cal.speedup
    assert cal.coarse is not None and cal.coarse.requests == 100 and cal.coarse.coarse is None
    assert cal.points and all(p not in cal.coarse.points for p in cal.points)  # runs of its own
    busy = report.policies["least_loaded"]["busy"]
    if cal.busy is not None:  # measured, not interpolated: the reported run is that run
        assert busy == pytest.approx(cal.busy) and abs(busy - 0.6) <= 0.005
    else:
        assert abs(busy - 0.6) <= 0.02
    j = report.to_json()["calibration"]
    assert j["requests"] == 400 and j["coarse"]["requests"] == 100 and "coarse" not in j["coarse"]


def test_a_run_counts_the_services_warnings_and_keeps_them_off_the_console(caplog):
    """The services log under natsched.router / natsched.workers (one import root)."""
    caplog.set_level(logging.INFO)
    with _captured_logs(quiet=True) as logs:
        logging.getLogger("natsched.router.core").warning("no worker may take %s", "r1")
        logging.getLogger("natsched.workers.simengine").warning("preempted")
        logging.getLogger("natsched.router.core").info("routed r2")  # below a warning: not counted
    assert logs.count == 2
    assert logs.examples == ["natsched.router.core: no worker may take r1", "natsched.workers.simengine: preempted"]
    assert caplog.records == []  # quiet: nothing reached the console's handlers
    logging.getLogger("natsched.router.core").warning("after the run")
    assert logs.count == 2 and len(caplog.records) == 1
