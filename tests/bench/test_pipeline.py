"""``natsched bench pipeline``'s memory sampling: the pure verdict, and one short real run."""

from __future__ import annotations

import json
import random

import pytest

from natsched.bench.memory import (
    FlatRule,
    least_squares_slope,
    memory_report,
    memory_verdict,
    process_series,
    soak_summary,
    stream_summaries,
    warmup_seconds,
)
from natsched.bench.pipeline import PipelineRun, _Tally, find_max
from natsched.cli.app import main

SOAK_S = 600.0
EVERY_S = 10.0


def series(rss_at, duration_s: float = SOAK_S, every_s: float = EVERY_S) -> list[tuple[float, float | None]]:
    """``(t, rss_at(t))`` at every sample of a run, like the sampler takes them."""
    n = int(duration_s / every_s)
    return [(k * every_s, rss_at(k * every_s)) for k in range(n + 1)]


def warming(t: float, level: float = 50.0) -> float:
    """Imports and caches: from 20 MiB up to ``level`` during the first minute."""
    return 20.0 + (level - 20.0) * min(1.0, t / 60.0)


def test_warmup_is_the_first_third_or_four_minutes():
    assert warmup_seconds(600) == pytest.approx(200.0)
    assert warmup_seconds(6) == pytest.approx(2.0)
    assert warmup_seconds(3600) == 240.0


def test_least_squares_slope_is_per_minute_and_exact_on_a_line():
    assert least_squares_slope([(t, 40.0 + t / 30.0) for t in range(0, 300, 10)]) == pytest.approx(2.0)
    assert least_squares_slope([(5.0, 1.0)]) == 0.0
    assert least_squares_slope([(5.0, 1.0), (5.0, 9.0)]) == 0.0


def test_a_steadily_growing_process_is_not_flat():
    verdict = memory_verdict(series(lambda t: warming(t) + 3.0 * max(0.0, t - 60) / 60), warmup_seconds(SOAK_S))
    assert verdict.flat is False and verdict.note == "grew beyond the allowance"
    assert verdict.growth_mib == pytest.approx(20.0)  # 3 MiB/min from 200 s to 600 s
    assert verdict.slope_mib_per_min == pytest.approx(3.0)


def test_a_noisy_but_level_process_is_flat():
    rng = random.Random(8)
    verdict = memory_verdict(series(lambda t: warming(t) + rng.uniform(-3.0, 3.0)), warmup_seconds(SOAK_S))
    assert verdict.flat is True, verdict
    assert abs(verdict.slope_mib_per_min) < 1.0
    assert verdict.start_mib > 45 and verdict.samples == 41  # 200 s .. 600 s


def test_warm_up_is_excluded():
    ramp_then_level = series(lambda t: warming(t, level=80.0))
    assert memory_verdict(ramp_then_level, warmup_seconds(SOAK_S)).flat is True
    without = memory_verdict(ramp_then_level, 0.0)
    assert without.flat is False and without.growth_mib == pytest.approx(60.0)


def test_growth_still_under_way_at_the_end_is_not_flat_even_within_the_allowance():
    late = memory_verdict(series(lambda t: warming(t) + 2.0 * max(0.0, t - 420) / 60), warmup_seconds(SOAK_S))
    assert late.growth_mib == pytest.approx(6.0) and late.growth_mib < late.allowance_mib
    assert late.flat is False and late.note == "still growing at the end"


def test_a_large_process_gets_a_relative_allowance():
    assert FlatRule().allowance_mib(40.0) == 10.0
    assert FlatRule().allowance_mib(1000.0) == 50.0
    big = memory_verdict(series(lambda t: 1000.0 + 30.0 * t / SOAK_S), warmup_seconds(SOAK_S))
    assert big.flat is True and big.allowance_mib == pytest.approx(1010.0 * 0.05)  # RSS at 200 s


def test_a_process_that_exits_is_not_flat_and_too_few_samples_say_nothing():
    gone = memory_verdict([(t, v if t < 300 else None) for t, v in series(warming)], warmup_seconds(SOAK_S))
    assert gone.flat is False and gone.note == "exited during the run"
    short = memory_verdict([(0.0, 40.0), (10.0, 41.0), (20.0, 90.0)], 10.0)
    assert short.flat is None and "too few samples" in short.note


def test_report_from_sampler_shaped_samples():
    samples = [{"t": float(t), "rss_kib": {"admitter": 40 * 1024 + t, "router": 50 * 1024},
                "streams": {"REQUESTS": {"messages": 100 * t, "bytes": 20_000 * t}}} for t in range(0, 70, 10)]
    assert process_series(samples, "router")[-1] == (60.0, 50.0)
    report = memory_report(samples, duration_s=60, sample_every_s=10)
    assert report["warmup_s"] == pytest.approx(20.0) and len(report["samples"]) == 7
    assert set(report["processes"]) == {"admitter", "router"}
    assert all(v["flat"] is True for v in report["processes"].values())
    streams = stream_summaries(samples, 6.0)
    assert streams["REQUESTS"].start_messages == 1000 and streams["REQUESTS"].end_messages == 6000
    assert streams["REQUESTS"].messages_per_min == pytest.approx(6000.0)
    assert soak_summary(report, lost=0) == "soak: nothing lost; memory flat in 2 of 2 processes"
    report["processes"]["router"].update(flat=False, note="grew beyond the allowance")
    assert "NOT flat: router (grew beyond the allowance)" in soak_summary(report, lost=3)


@pytest.mark.parametrize("flags, message", [
    (["--max-rate", "800"], "--max-rate goes with --soak"),
    (["--soak", "--max-rate", "800", "--rate", "300"], "not both"),
    (["--routers", "0"], "--routers 0 needs --inline-routing"),
    (["--floor", "--inline-routing"], "--floor puts a bare relay in place of the admitters and routers"),
    (["--floor", "--admitters", "2"], "leave out --admitters"),
    (["--floor", "--no-credit"], "--no-credit"),
])
def test_soak_flags_are_checked_before_anything_starts(flags, message, capsys):
    assert main(["bench", "pipeline", *flags]) == 1
    assert message in capsys.readouterr().err


def run_bench(tmp_path, *flags: str) -> dict:
    """``natsched bench pipeline FLAGS --json OUT`` on a fresh system; its exit code 0, its JSON."""
    out = tmp_path / "bench.json"
    assert main(["--log-level", "warning", "bench", "pipeline", *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_short_soak_samples_every_process_and_loses_nothing(tmp_path, capsys):
    data = run_bench(tmp_path, "--soak", "--duration", "6", "--rate", "100", "--sample-every", "1")
    assert data["lost"] == 0 and data["requests"] == 600
    memory = data["memory"]
    samples = memory["samples"]
    assert len(samples) >= 3  # t = 0, the ticks during the load, one after the drain
    expected = {"nats-server", "admitter", "router", "offline", "worker w1", "worker w2", "load generator"}
    for sample in samples:
        assert set(sample["rss_kib"]) == expected
        assert all(kib is not None and kib > 0 for kib in sample["rss_kib"].values()), sample
    assert {"REQUESTS", "ADMITTED", "WORK", "KV_inflight"} <= set(samples[-1]["streams"])
    assert samples[-1]["streams"]["REQUESTS"]["messages"] == 600
    assert set(memory["processes"]) == expected
    cpu = data["cpu_ms_per_request"]  # every process's CPU over the run, per request served
    assert set(cpu) == expected | {"total"} and all(ms > 0 for name, ms in cpu.items() if name != "offline")
    assert cpu["total"] == pytest.approx(sum(ms for name, ms in cpu.items() if name != "total"))
    assert all(0 <= int(sec) < 6 and ms >= 100 for sec, ms in data["slow_seconds"].items())
    per_second = data["per_second"]  # every assignment counted once, under the second it was published in
    assert sum(row["n"] for row in per_second.values()) == data["assigned"] == 600
    assert all(0 <= int(sec) <= 6 and 0 <= row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
               for sec, row in per_second.items()), per_second
    assert max(row["max_ms"] for row in per_second.values()) >= data["overhead_p99_ms"]
    stages = data["stages_ms"]  # where the hand-off's time goes, from the assignments' timestamps
    assert list(stages) == ["admission", "routing", "delivery"]
    assert all(0 <= v["p50"] <= v["p99"] for v in stages.values()), stages
    assert sum(v["p50"] for v in stages.values()) <= data["overhead_p99_ms"] + 1.0, (stages, data["overhead_p99_ms"])
    batches = data["admitter_batches"]  # read from the admitter's own metrics, before and after the load
    assert batches["batches"] >= 1 and batches["handoff_mean_ms"] > 0
    assert batches["batches"] * batches["mean_requests"] == pytest.approx(600)  # every request, pulled once
    text = capsys.readouterr().out
    assert "admitter batches:" in text
    assert "p99 ms by publish second:" in text
    assert "slope MiB/min" in text and "soak: nothing lost;" in text and "CPU ms per request:" in text
    assert "stages p50/p99 ms: admission" in text


def test_stage_samples_stay_bounded_and_uniform():
    """A soak's millions of requests keep a fixed-size uniform sample of stage durations."""
    tally = _Tally(stage_cap=500)
    for k in range(20_000):  # admission k/1000 ms, routing 1 ms, delivery 2 ms
        tally.on_stages((100.0, 100.0 + k / 1e6, 100.001 + k / 1e6, 100.003 + k / 1e6))
    assert len(tally.stage_samples) == 500 and tally.stage_seen == 20_000
    stages = tally.stages_ms()
    assert stages["admission"]["p50"] == pytest.approx(10.0, abs=1.5)  # the median of 0..20 ms, not of the first 500
    assert stages["routing"]["p50"] == pytest.approx(1.0) and stages["delivery"]["p99"] == pytest.approx(2.0)
    assert _Tally().stages_ms() == {}


def test_the_floor_runs_the_same_harness_with_a_bare_relay_and_loses_nothing(tmp_path, capsys):
    """``--floor``: no admitter or router runs; the relay's CPU is counted in their place."""
    data = run_bench(tmp_path, "--floor", "--duration", "2", "--rate", "100", "--workers", "2")
    assert data["floor"] is True and (data["admitters"], data["routers"]) == (0, 0)
    assert data["lost"] == 0 and data["requests"] == data["assigned"] == data["completed"] == 200
    assert 0 < data["overhead_p50_ms"] <= data["overhead_p99_ms"]
    cpu = data["cpu_ms_per_request"]
    assert "relay" in cpu and "admitter" not in cpu and "router" not in cpu
    assert "admitter_batches" not in data  # no admitter ran
    assert {"worker w1", "worker w2"} <= set(cpu)
    assert "-  flr" in capsys.readouterr().out  # the table's row says what ran


def ramp_with_limit(limit_rate: float, lost_from: float | None = None):
    """A stand-in for one live run (the ramp's logic is what is tested here; the live runs are
    above): p99 rises past 10 ms above ``limit_rate``; requests are lost from ``lost_from``."""
    def run(cfg: PipelineRun, _url):
        return {"rate": cfg.rate, "admitters": 1, "routers": 1, "requests": int(cfg.rate), "sustained_rps": cfg.rate,
                "overhead_p50_ms": 1.0, "overhead_p99_ms": 5.0 if cfg.rate <= limit_rate else 20.0,
                "lost": 1 if lost_from is not None and cfg.rate >= lost_from else 0}
    return run


@pytest.mark.parametrize("limit, refine, expect_best, expect_rates", [
    (800, 2, 750, [250, 500, 1000, 750, 900]),  # the gap 500..1,000 halved twice
    (500, 2, 500, [250, 500, 1000, 750, 600]),
    (100, 2, 100, [250, 100, 200]),  # even the first rate fails: halved from 0
    (2500, 1, 2500, [250, 500, 1000, 2000, 3000, 2500]),
    (800, 0, 500, [250, 500, 1000]),  # the coarse ramp alone
])
def test_find_max_ramps_then_halves_the_gap_to_the_first_failure(limit, refine, expect_best, expect_rates):
    best, results = find_max(PipelineRun(rate=0, duration_s=1), [250, 500, 1000, 2000, 3000], None,
                             refine=refine, run=ramp_with_limit(limit))
    assert [r["rate"] for r in results] == expect_rates
    assert best["rate"] == expect_best


def test_find_max_counts_a_lost_request_as_a_failure():
    best, results = find_max(PipelineRun(rate=0, duration_s=1), [250, 500, 1000], None,
                             run=ramp_with_limit(10_000, lost_from=500))
    assert [r["rate"] for r in results] == [250, 500, 400, 450]
    assert best["rate"] == 450
