"""Capacity calibration: how many runtime tokens an engine holds before latency breaks.

Admission meters work in *runtime tokens* (prompt + output KV a request holds), so a worker's
capacity is best stated in the same unit, measured rather than guessed from KV size: a full KV
cache is usually far past the point where time-per-output-token (TPOT) and time-to-first-token
(TTFT) degrade. The calibration runs closed loops of increasing concurrency (each of *c*
clients sends its next request when the previous ends, ``rounds`` times) with unique prompts (no
prefix hits), and records per level the p50/p90 of TTFT and TPOT and the runtime tokens in
flight (*c* × mean(prompt + output tokens)). The **knee** is the first level whose TTFT p90 or
TPOT p90 exceeds ``knee_factor`` × its value at the lowest level; the capacity is the runtime
tokens of the level before it (or of the last level when no knee was reached — then the
result says so and a wider sweep would raise it).

Results are stored as JSON in the JetStream KV bucket ``workers`` under
:func:`calibration_key` (model, deployment); a worker agent reads it at start and uses it as
its ``capacity_tokens`` (heartbeats), unless the operator set one explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from natsched.wire import subjects as S
from natsched.workers.engine import Engine, EngineRequest
from natsched.workers.errors import CalibrationError

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 1
@dataclass
class CalibrationSettings:
    model: str
    deployment: str
    levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    rounds: int = 3  # requests per client at each level
    prompt_tokens: int = 256
    output_tokens: int = 64
    knee_factor: float = 2.0
    vocab: int = 1000  # prompt token ids are drawn from [10, vocab)
    seed: int = 0
    level_timeout_s: float = 600.0
    stop_at_knee: bool = True

    def __post_init__(self) -> None:
        if not self.levels or any(c < 1 for c in self.levels) or sorted(self.levels) != self.levels:
            raise ValueError("calibration levels must be increasing positive integers")
        if self.knee_factor <= 1.0:
            raise ValueError("knee_factor must be > 1")
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.rounds < 1:
            raise ValueError("prompt_tokens, output_tokens and rounds must be >= 1")


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float
    runtime_tokens: int  # concurrency × mean(prompt + output) of the finished requests
    peak_engine_runtime_tokens: int  # as the engine's own stats reported it
    output_tokens_per_s: float
    duration_s: float


@dataclass
class Calibration:
    model: str
    deployment: str
    capacity_tokens: int
    knee_concurrency: int | None  # first level past the knee; None when no knee was reached
    knee_reason: str
    knee_factor: float
    baseline_ttft: float
    baseline_tpot: float
    block_size: int
    prompt_tokens: int
    output_tokens: int
    measured_at: float
    levels: list[LevelResult] = field(default_factory=list)
    v: int = CALIBRATION_VERSION

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> "Calibration":
        raw = orjson.loads(data)
        if not isinstance(raw, dict) or not isinstance(raw.get("capacity_tokens"), int):
            raise ValueError("not a calibration record (capacity_tokens missing)")
        known = {f for f in cls.__dataclass_fields__}
        raw = {k: v for k, v in raw.items() if k in known}
        lf = set(LevelResult.__dataclass_fields__)
        raw["levels"] = [LevelResult(**{k: v for k, v in lv.items() if k in lf}) for lv in raw.get("levels", [])]
        return cls(**raw)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def find_knee(levels: list[LevelResult], factor: float) -> tuple[int, int | None, str]:
    """(index of the capacity level, index of the knee level or None, why). Pure."""
    usable = [i for i, lv in enumerate(levels) if lv.requests > lv.errors]
    if not usable:
        raise CalibrationError("no level finished a request")
    base = levels[usable[0]]
    last_ok = usable[0]
    for i in usable[1:]:
        lv = levels[i]
        reasons = []
        if base.ttft_p90 > 0 and lv.ttft_p90 > factor * base.ttft_p90:
            reasons.append(f"TTFT p90 {lv.ttft_p90 * 1e3:.1f} ms > {factor:g} × {base.ttft_p90 * 1e3:.1f} ms")
        if base.tpot_p90 > 0 and lv.tpot_p90 > factor * base.tpot_p90:
            reasons.append(f"TPOT p90 {lv.tpot_p90 * 1e3:.1f} ms > {factor:g} × {base.tpot_p90 * 1e3:.1f} ms")
        if reasons:
            return last_ok, i, f"knee at concurrency {lv.concurrency}: " + "; ".join(reasons)
        last_ok = i
    return last_ok, None, f"no knee up to concurrency {levels[last_ok].concurrency}"


def _now() -> float:
    """The running loop's clock (monotonic in production): one clock for every measurement, which a
    test can replace with virtual time by running the calibration on a loop of its own."""
    return asyncio.get_running_loop().time()


async def _one(engine: Engine, rid: str, ids: list[int], max_tokens: int) -> tuple[float | None, float | None, int, bool]:
    """Run one request: (ttft, tpot, prompt+output tokens, ok)."""
    start = _now()
    first = None
    out_tokens = 0
    req = EngineRequest(id=rid, prompt_tokens=len(ids), hashes=[], max_tokens=max_tokens,
                        prompt_token_ids=ids, output_tokens_hint=max_tokens)
    async with contextlib.aclosing(engine.generate(req)) as stream:  # closed now, not at GC: load is exact
        async for out in stream:
            if out.error:
                log.warning("calibration request %s failed: %s", rid, out.error)
                return None, None, 0, False
            if first is None and (out.token_ids or out.text or out.finished):
                first = _now()
            if out.finished:
                out_tokens = out.output_tokens
                break
    end = _now()
    ttft = (first - start) if first is not None else None
    tpot = ((end - first) / (out_tokens - 1)) if first is not None and out_tokens > 1 else None
    return ttft, tpot, len(ids) + out_tokens, True


async def run_level(engine: Engine, c: int, s: CalibrationSettings, rng: random.Random, tag: str) -> LevelResult:
    """A closed loop of ``c`` clients × ``s.rounds`` requests with unique prompts."""
    ttfts: list[float] = []
    tpots: list[float] = []
    tokens: list[int] = []
    errors = 0
    peak = 0
    out_total = 0

    async def client(k: int) -> None:
        nonlocal errors, out_total
        for r in range(s.rounds):
            ids = [rng.randrange(10, max(11, s.vocab)) for _ in range(s.prompt_tokens)]
            ttft, tpot, n, ok = await _one(engine, f"calib-{tag}-{c}-{k}-{r}", ids, s.output_tokens)
            if not ok:
                errors += 1
                continue
            if ttft is not None:
                ttfts.append(ttft)
            if tpot is not None:
                tpots.append(tpot)
            tokens.append(n)
            out_total += n - s.prompt_tokens

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, engine.stats().runtime_tokens)
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    started = _now()
    try:
        await asyncio.wait_for(asyncio.gather(*(client(k) for k in range(c))), s.level_timeout_s)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    duration = _now() - started
    mean_tokens = sum(tokens) / len(tokens) if tokens else 0.0
    return LevelResult(
        concurrency=c, requests=c * s.rounds, errors=errors,
        ttft_p50=_pct(ttfts, 0.5), ttft_p90=_pct(ttfts, 0.9), tpot_p50=_pct(tpots, 0.5), tpot_p90=_pct(tpots, 0.9),
        runtime_tokens=round(c * mean_tokens), peak_engine_runtime_tokens=peak,
        output_tokens_per_s=out_total / duration if duration > 0 else 0.0, duration_s=duration,
    )


async def calibrate(engine: Engine, settings: CalibrationSettings) -> Calibration:
    """Sweep the levels on a started engine; returns the calibration (not stored)."""
    rng = random.Random(settings.seed)
    tag = f"{int(time.time() * 1000) % 10**8}"
    levels: list[LevelResult] = []
    for c in settings.levels:
        lv = await run_level(engine, c, settings, rng, tag)
        levels.append(lv)
        log.info("calibration %s c=%d: ttft p90 %.1f ms, tpot p90 %.1f ms, %d runtime tokens, %d/%d errors",
                 settings.model, c, lv.ttft_p90 * 1e3, lv.tpot_p90 * 1e3, lv.runtime_tokens, lv.errors, lv.requests)
        if settings.stop_at_knee and len(levels) > 1 and find_knee(levels, settings.knee_factor)[1] is not None:
            break
    cap_i, knee_i, reason = find_knee(levels, settings.knee_factor)
    base = levels[0]
    return Calibration(
        model=settings.model, deployment=settings.deployment, capacity_tokens=levels[cap_i].runtime_tokens,
        knee_concurrency=levels[knee_i].concurrency if knee_i is not None else None, knee_reason=reason,
        knee_factor=settings.knee_factor, baseline_ttft=base.ttft_p90, baseline_tpot=base.tpot_p90,
        block_size=engine.block_size, prompt_tokens=settings.prompt_tokens, output_tokens=settings.output_tokens,
        measured_at=time.time(), levels=levels,
    )


async def store_calibration(bus: Any, cal: Calibration) -> int:
    """Put the calibration in bucket ``workers``; returns the KV revision."""
    return await bus.kv(S.BUCKET_WORKERS).put(S.calibration_key(cal.model, cal.deployment), cal.to_json())


async def load_calibration(bus: Any, model: str, deployment: str) -> Calibration | None:
    """The stored calibration for (model, deployment), or None (absent or unreadable, logged)."""
    entry = await bus.kv(S.BUCKET_WORKERS).get(S.calibration_key(model, deployment))
    if entry is None:
        return None
    try:
        return Calibration.from_json(entry[0])
    except (ValueError, TypeError) as exc:
        log.warning("ignoring unreadable calibration for %s/%s: %s", model, deployment, exc)
        return None
