"""The admission benchmark's workload: a JSON description, validated, turned into arrivals.

File format (every key below is required; the optional ones follow)::

    {"total_runtime_tokens": 400000,   cluster total the policies admit against
     "duration_s": 120,                arrivals happen in [0, duration_s)
     "overload": 3.0,                  offered load / capacity (see below)
     "long_threshold_tokens": 8192,    a request costing at least this many runtime tokens is long
     "long_fraction": 0.3,             share of the offered load that comes from long requests
     "reserve_long_share": 0.2,        natsched's reserve for long requests
     "tenants": [{"name": "a", "floor": 0.5, "weight": 1, "rate_share": 0.2}, ...]}

    optional: "seed" (1), "queue_timeout_s" (30), "aging_s" (10), "tick_s" (0.1, the service's
    dequeue interval),
    "output_tokens" ([32, 512]), "profile" (h100-llama8b), tenant "cap" (null)

*Load* is measured in runtime-token-seconds: a request holding ``cost`` runtime tokens for
``hold`` seconds offers ``cost × hold``; the cluster's capacity is ``total × 1 s`` per second.
``overload`` = offered load / capacity, ``rate_share`` = a tenant's share of the offered load
(they must sum to 1), ``long_fraction`` = the long requests' share of it.

Requests (one seeded random stream per tenant and size class, so adding a tenant leaves the
others' arrivals unchanged):

- output tokens log-uniform in ``output_tokens``;
- short: prompt log-uniform in [16, (threshold − output − 1) / 2], so cost = 2·prompt + output
  stays below the threshold; long: cost from the threshold up to 4× it (at most a quarter of
  the total), prompt = (cost − output) / 2;
- hold time (the service-time model): the profile's prefill time of the prompt plus one decode
  step per output token at a full KV cache (:func:`hold_seconds`);
- arrivals: a Poisson process per stream, marked by each request's load, with rate
  ``overload × total × rate_share × kind share``.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from natsched.sim.errors import SimConfigError
from natsched.workers.profiles import DEFAULT_PROFILE, EngineProfile, get_profile

REQUIRED = ("total_runtime_tokens", "duration_s", "overload", "long_threshold_tokens", "long_fraction",
            "reserve_long_share", "tenants")
OPTIONAL = ("seed", "queue_timeout_s", "aging_s", "tick_s", "output_tokens", "profile")
TENANT_KEYS = ("name", "floor", "weight", "rate_share", "cap")
MIN_SHORT_PROMPT = 16
LONG_MAX_FACTOR = 4
DEFAULT_WORKLOAD: dict[str, Any] = {
    "total_runtime_tokens": 400000, "duration_s": 120, "overload": 3.0, "long_threshold_tokens": 8192,
    "long_fraction": 0.3, "reserve_long_share": 0.2,
    "tenants": [{"name": "a", "floor": 0.5, "weight": 1, "rate_share": 0.2},
                {"name": "b", "floor": 0.3, "weight": 1, "rate_share": 0.3},
                {"name": "c", "floor": 0.2, "weight": 1, "rate_share": 0.5}],
}


class AdmissionWorkloadError(SimConfigError):
    """A workload file (or dict) that cannot be used; the message names the field."""


@dataclass
class TenantLoad:
    name: str
    floor: float
    weight: float
    rate_share: float
    cap: int | None = None


@dataclass
class AdmissionWorkload:
    total_runtime_tokens: int
    duration_s: float
    overload: float
    long_threshold_tokens: int
    long_fraction: float
    reserve_long_share: float
    tenants: list[TenantLoad]
    seed: int = 1
    queue_timeout_s: float = 30.0
    aging_s: float = 10.0
    tick_s: float = 0.1
    output_tokens: tuple[int, int] = (32, 512)
    profile: str = DEFAULT_PROFILE
    source: str = "built-in default"

    @property
    def long_max_cost(self) -> int:
        return max(self.long_threshold_tokens,
                   min(LONG_MAX_FACTOR * self.long_threshold_tokens, self.total_runtime_tokens // 4))

    @classmethod
    def from_dict(cls, data: Any, source: str = "workload") -> "AdmissionWorkload":
        return _Parser(source).parse(data)

    @classmethod
    def load(cls, path: str | Path | None) -> "AdmissionWorkload":
        """The file's workload, or the built-in default when ``path`` is None."""
        if path is None:
            return cls.from_dict(DEFAULT_WORKLOAD, "built-in default")
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise AdmissionWorkloadError(f"cannot read workload {path}: {exc.strerror or exc}") from None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise AdmissionWorkloadError(f"{path}: not JSON ({exc})") from None
        return cls.from_dict(data, str(path))


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, message: str) -> AdmissionWorkloadError:
        return AdmissionWorkloadError(f"{self.source}: {message}")

    def number(self, data: dict, key: str, lo: float, hi: float, integer: bool = False,
               lo_open: bool = False) -> Any:
        value = data[key]
        ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type or not math.isfinite(value):
            raise self.fail(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}")
        if value < lo or value > hi or (lo_open and value == lo):
            raise self.fail(f"'{key}' must be {'>' if lo_open else '>='} {lo:g} and <= {hi:g}, got {value!r}")
        return value

    def parse(self, data: Any) -> AdmissionWorkload:
        if not isinstance(data, dict):
            raise self.fail(f"must be a JSON object, got {type(data).__name__}")
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise self.fail(f"missing field(s) {', '.join(repr(k) for k in missing)}")
        unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise self.fail(f"unknown field(s) {', '.join(repr(k) for k in unknown)}; "
                            f"known: {', '.join(REQUIRED + OPTIONAL)}")
        total = self.number(data, "total_runtime_tokens", 1000, 1e12, integer=True)
        kw: dict[str, Any] = dict(
            total_runtime_tokens=total,
            duration_s=float(self.number(data, "duration_s", 0, 86400, lo_open=True)),
            overload=float(self.number(data, "overload", 0, 100, lo_open=True)),
            long_threshold_tokens=self.number(data, "long_threshold_tokens", 1, total, integer=True),
            long_fraction=float(self.number(data, "long_fraction", 0, 1)),
            reserve_long_share=float(self.number(data, "reserve_long_share", 0, 0.9)),
            tenants=self.tenants(data["tenants"]), source=self.source,
        )
        self.optional(data, kw)
        self.check_sizes(kw)
        return AdmissionWorkload(**kw)

    def optional(self, data: dict, kw: dict) -> None:
        if "seed" in data:
            kw["seed"] = self.number(data, "seed", 0, 2**63, integer=True)
        for key, lo in (("queue_timeout_s", 0), ("aging_s", 0), ("tick_s", 0)):
            if key in data:
                kw[key] = float(self.number(data, key, lo, 3600, lo_open=key != "aging_s"))
        if "output_tokens" in data:
            pair = data["output_tokens"]
            ints = isinstance(pair, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
            if not ints or len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
                raise self.fail(f"'output_tokens' must be [min, max] integers with 1 <= min <= max, got {pair!r}")
            kw["output_tokens"] = (pair[0], pair[1])
        if "profile" in data:
            try:
                get_profile(str(data["profile"]))
            except ValueError as exc:
                raise self.fail(str(exc)) from None
            kw["profile"] = str(data["profile"])

    def tenants(self, value: Any) -> list[TenantLoad]:
        if not isinstance(value, list) or not value:
            raise self.fail("'tenants' must be a non-empty list of {name, floor, weight, rate_share}")
        out, seen = [], set()
        for i, t in enumerate(value):
            where = f"tenants[{i}]"
            if not isinstance(t, dict):
                raise self.fail(f"{where} must be an object, got {type(t).__name__}")
            missing = [k for k in ("name", "floor", "weight", "rate_share") if k not in t]
            unknown = sorted(set(t) - set(TENANT_KEYS))
            if missing or unknown:
                raise self.fail(f"{where}: " + (f"missing field(s) {', '.join(missing)}" if missing else
                                                f"unknown field(s) {', '.join(unknown)}"))
            name = t["name"]
            if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum() or len(name) > 64:
                raise self.fail(f"{where}.name must be letters, digits, '-' or '_', got {name!r}")
            if name in seen:
                raise self.fail(f"tenant {name!r} appears twice")
            seen.add(name)
            cap = t.get("cap")
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
                raise self.fail(f"{where}.cap must be an integer >= 0 or null, got {cap!r}")
            out.append(TenantLoad(name, float(self.number(t, "floor", 0, 1)), float(self.number(t, "weight", 0, 1e6)),
                                  float(self.number(t, "rate_share", 0, 1)), cap))
        floors = sum(t.floor for t in out)
        if floors > 1.0 + 1e-9:
            raise self.fail(f"tenant floors sum to {floors:.3f} > 1.0 "
                            f"({', '.join(f'{t.name}={t.floor:g}' for t in out)})")
        shares = sum(t.rate_share for t in out)
        if abs(shares - 1.0) > 1e-6:
            raise self.fail(f"tenant rate_share values must sum to 1 (they are shares of the offered load), "
                            f"got {shares:.4f}")
        return out

    def check_sizes(self, kw: dict) -> None:
        lo, hi = kw.get("output_tokens", (32, 512))
        threshold = kw["long_threshold_tokens"]
        need = 2 * MIN_SHORT_PROMPT + hi + 1
        if kw["long_fraction"] < 1 and threshold < need:
            raise self.fail(f"'long_threshold_tokens' must be >= {need} so that short requests exist "
                            f"(prompt >= {MIN_SHORT_PROMPT} tokens, up to {hi} output tokens)")
        if kw["long_fraction"] > 0 and threshold + hi > kw["total_runtime_tokens"]:
            raise self.fail(f"long requests (>= {threshold} runtime tokens) cannot fit in the total "
                            f"{kw['total_runtime_tokens']}")


# ---------------------------------------------------------------------- arrivals

@dataclass(slots=True)
class SimRequest:
    index: int
    tenant: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cost: int  # runtime tokens: 2 × prompt + output (the admitter's rule, max_tokens = output)
    hold_s: float  # how long it holds its runtime tokens once admitted
    long: bool

    @property
    def id(self) -> str:
        return f"r{self.index}"


def hold_seconds(profile: EngineProfile, prompt_tokens: int, output_tokens: int) -> float:
    """Prefill of the prompt, then one decode step per output token with the KV cache full
    (the admission total is what keeps it full in an overload)."""
    decode_step = profile.memory_seconds(profile.kv_capacity_tokens) + profile.step_overhead_s
    return profile.prefill_seconds(prompt_tokens) + output_tokens * decode_step


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    if hi <= lo:
        return lo
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def _sample(rng: random.Random, w: AdmissionWorkload, long: bool) -> tuple[int, int]:
    """(prompt, output) tokens of one request of the given size class."""
    out = _log_uniform(rng, *w.output_tokens)
    threshold = w.long_threshold_tokens
    if not long:
        return _log_uniform(rng, MIN_SHORT_PROMPT, max(MIN_SHORT_PROMPT, (threshold - out - 1) // 2)), out
    cost = _log_uniform(rng, threshold + out, max(threshold + out, w.long_max_cost))
    return max(1, -(-(cost - out) // 2)), out


def generate(w: AdmissionWorkload) -> list[SimRequest]:
    """Every arrival of the workload, sorted by time (ties by stream), indexed in that order."""
    profile = get_profile(w.profile)
    raw: list[tuple[float, int, SimRequest]] = []
    for ti, tenant in enumerate(w.tenants):
        for long, kind_share in ((False, 1.0 - w.long_fraction), (True, w.long_fraction)):
            rate = w.overload * w.total_runtime_tokens * tenant.rate_share * kind_share  # token-seconds / s
            if rate <= 0:
                continue
            seed = zlib.crc32(f"{w.seed}/{tenant.name}/{'long' if long else 'short'}".encode())
            rng = random.Random(seed)
            t = 0.0
            while True:
                prompt, out = _sample(rng, w, long)
                cost = 2 * prompt + out
                hold = hold_seconds(profile, prompt, out)
                t += rng.expovariate(1.0) * cost * hold / rate
                if t >= w.duration_s:
                    break
                raw.append((t, 2 * ti + long, SimRequest(0, tenant.name, t, prompt, out, cost, hold, long)))
    raw.sort(key=lambda x: (x[0], x[1]))
    for i, (_, _, req) in enumerate(raw):
        req.index = i
    return [r for _, _, r in raw]
