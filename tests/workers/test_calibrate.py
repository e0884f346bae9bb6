"""Capacity calibration: the knee, the stored record, and the agent using it."""

from __future__ import annotations

import asyncio

import pytest

from natsched.wire import subjects as S
from natsched.wire.schema import Heartbeat, WorkerId
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.wire.subjects import calibration_key
from natsched.workers.calibrate import (
    Calibration,
    CalibrationSettings,
    LevelResult,
    calibrate,
    find_knee,
    load_calibration,
    store_calibration,
)
from natsched.workers.engine import EngineOutput, EngineStats
from natsched.workers.errors import CalibrationError
from tests.factories.core import run_in_virtual_time


def level(c, ttft, tpot, errors=0):
    return LevelResult(concurrency=c, requests=4, errors=errors, ttft_p50=ttft, ttft_p90=ttft, tpot_p50=tpot,
                       tpot_p90=tpot, runtime_tokens=100 * c, peak_engine_runtime_tokens=0,
                       output_tokens_per_s=1.0, duration_s=1.0)


def test_knee_is_the_first_level_past_k_times_the_low_load_latency():
    levels = [level(1, 0.01, 0.01), level(2, 0.011, 0.012), level(4, 0.015, 0.019), level(8, 0.03, 0.025)]
    cap, knee, why = find_knee(levels, 2.0)
    assert (cap, knee) == (2, 3) and "TTFT p90" in why and "TPOT" in why
    cap, knee, why = find_knee(levels, 5.0)
    assert (cap, knee) == (3, None) and "no knee" in why


def test_levels_that_only_failed_are_skipped():
    with pytest.raises(CalibrationError):
        find_knee([level(1, 0, 0, errors=4)], 2.0)
    cap, knee, _ = find_knee([level(1, 0, 0, errors=4), level(2, 0.01, 0.01), level(4, 0.05, 0.01)], 2.0)
    assert (cap, knee) == (1, 2)


def test_keys_are_kv_safe_and_distinct():
    assert calibration_key("meta-llama/Llama-3.1-8B", "h100x1") == "capacity.meta-llama=2FLlama-3=2E1-8B.h100x1"
    assert calibration_key("a.b", "c") != calibration_key("a", "b.c")


class LoadSensitiveEngine:
    """Each decode step takes longer once more than ``knee`` requests share it (a fake roofline)."""

    block_size = 32

    def __init__(self, knee: int = 4, step_s: float = 0.02) -> None:
        self.knee, self.step_s, self.active = knee, step_s, 0

    def stats(self) -> EngineStats:
        return EngineStats(runtime_tokens=self.active * 40)

    async def generate(self, request):
        self.active += 1
        try:
            for i in range(request.max_tokens):
                await asyncio.sleep(self.step_s * max(1.0, self.active / self.knee) ** 2)
                last = i == request.max_tokens - 1
                yield EngineOutput(i, token_ids=[1], finished=last, finish_reason="length" if last else None,
                                   prompt_tokens=request.prompt_tokens, output_tokens=i + 1)
        finally:
            self.active -= 1


def test_calibrate_finds_the_knee_of_a_load_sensitive_engine():
    s = CalibrationSettings(model="m", deployment="d", levels=[1, 2, 4, 8, 16], rounds=2, prompt_tokens=32,
                            output_tokens=4, knee_factor=2.0)
    # virtual time: the fake engine's step times are exact, whatever else the machine runs
    cal = run_in_virtual_time(calibrate(LoadSensitiveEngine(knee=4), s))
    assert cal.knee_concurrency == 8  # 4 share a step at full speed; 8 make each step 4x slower
    assert cal.capacity_tokens == cal.levels[-2].runtime_tokens
    assert cal.capacity_tokens >= 4 * (32 + 4)
    assert cal.levels[0].tpot_p90 > 0 and cal.levels[-1].peak_engine_runtime_tokens > 0
    back = Calibration.from_json(cal.to_json())
    assert back == cal


async def test_stored_calibration_becomes_the_workers_capacity(bus):
    cal = Calibration(model="m1", deployment="dep-a", capacity_tokens=12345, knee_concurrency=8, knee_reason="test",
                      knee_factor=2.0, baseline_ttft=0.01, baseline_tpot=0.01, block_size=32, prompt_tokens=256,
                      output_tokens=64, measured_at=0.0)
    await store_calibration(bus, cal)
    assert (await load_calibration(bus, "m1", "dep-a")).capacity_tokens == 12345
    assert await load_calibration(bus, "m1", "other") is None
    await bus.kv(S.BUCKET_WORKERS).put(calibration_key("m1", "broken"), b"{not json")
    assert await load_calibration(bus, "m1", "broken") is None

    from tests.workers.test_agent_states import ScriptedEngine, collect, wait_for

    hbs = await collect(bus, S.heartbeat(WorkerId("wc")), Heartbeat)
    agent = WorkerAgent(bus, ScriptedEngine(), WorkerSettings(id="wc", model="m1", deployment="dep-a",
                                                               heartbeat_interval_s=0.05))
    await agent.start()
    try:
        assert agent.capacity_tokens == 12345 and agent.capacity_source == "calibration dep-a"
        assert await wait_for(lambda: hbs and hbs[-1].capacity_tokens == 12345)
    finally:
        await agent.stop()
    # an explicit setting wins; no calibration falls back to the engine's figure
    a2 = WorkerAgent(bus, ScriptedEngine(), WorkerSettings(id="wc2", model="m1", deployment="dep-a",
                                                            capacity_tokens=7))
    await a2._load_calibration()
    assert a2.capacity_tokens == 7
    a3 = WorkerAgent(bus, ScriptedEngine(), WorkerSettings(id="wc3", model="m1", deployment="nope"))
    await a3._load_calibration()
    assert a3.capacity_tokens is None


async def test_calibrate_command_prints_and_stores_the_record(bus, nats_url, capsys):
    import argparse

    from natsched.cli.up import add_calibrate_flags, calibrate_command
    from natsched.workers.profiles import get_profile
    from natsched.workers.simengine import SimEngine

    p = argparse.ArgumentParser()
    p.add_argument("--nats-url")
    p.add_argument("--credentials", default=None)
    add_calibrate_flags(p)
    args = p.parse_args(["--nats-url", nats_url, "--engine", "sim", "--model", "m9", "--levels", "1,2", "--rounds", "1",
                         "--prompt-tokens", "64", "--output-tokens", "8", "--time-scale", "0.1", "--deployment", "d9"])
    engine = SimEngine(get_profile(args.profile), block_size=args.block_size, time_scale=args.time_scale)
    assert await calibrate_command(args, engine) == 0
    printed = Calibration.from_json(capsys.readouterr().out.strip().splitlines()[-1].encode())
    assert printed.model == "m9" and printed.deployment == "d9" and printed.capacity_tokens > 0
    assert await load_calibration(bus, "m9", "d9") == printed


async def test_calibrate_command_reports_bad_levels_in_one_line(capsys):
    import argparse

    from natsched.cli.up import add_calibrate_flags, calibrate_command

    p = argparse.ArgumentParser()
    p.add_argument("--nats-url")
    p.add_argument("--credentials", default=None)
    add_calibrate_flags(p)
    args = p.parse_args(["--levels", "4,2", "--dry-run"])
    assert await calibrate_command(args, LoadSensitiveEngine()) == 1
    assert "calibration failed" in capsys.readouterr().err
