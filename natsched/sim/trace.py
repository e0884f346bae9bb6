"""Trace loading: the Mooncake JSONL format, turned into requests the simulator can replay.

One JSON object per line (kvcache-ai/Mooncake, FAST'25 trace release)::

    {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152, ...]}

- ``timestamp``: arrival in milliseconds (any origin: arrivals are shifted so the earliest is 0);
- ``input_length`` / ``output_length``: prompt and generated tokens;
- ``hash_ids``: one id per ``block_size``-token prompt block (512 in Mooncake's traces); equal ids in
  equal positions mean reusable prefix KV.

Each request's ids become a *chained* block-hash list, like :mod:`natsched.wire.blocks` does for token ids:
block *i*'s hash covers its id and the hash of block *i-1*, so equal id prefixes give equal chains and
a hash stands for a whole prefix (what the router's prefix index and the engine's prefix cache key
on). Only *full* blocks are hashed (``input_length // block_size`` of them), as vLLM caches only full
blocks; a trailing partial block can never be shared.

``speedup`` compresses time: arrivals are divided by it (2.0 replays the trace twice as fast).
Bad input raises a :class:`~natsched.sim.errors.TraceError` that names the file and line. Pure apart from
reading the file.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import orjson

from natsched.sim.errors import EmptyTraceError, SimConfigError, TraceError, TraceFormatError

MOONCAKE_BLOCK_TOKENS = 512  # the block size of Mooncake's hash_ids
_SEED = b"natsched/sim/trace/v1"
_MASK = (1 << 63) - 1  # inside msgpack's signed int64, like natsched.wire.blocks
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _hash(parent: int, payload: bytes) -> int:
    digest = hashlib.blake2b(payload, digest_size=8, key=parent.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") & _MASK


ROOT_HASH = _hash(0, _SEED)

#: The public Mooncake FAST'25 synthetic trace, shipped with the package (source and licence in
#: ``traces/README.md`` beside it): the default of ``natsched bench routing --trace``.
MOONCAKE_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl"


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace, ready to replay."""

    index: int  # position in the trace after sorting by arrival (0-based); ids are ``r<index>``
    line: int  # 1-based line in the source file
    base_arrival: float  # seconds from the first arrival, before speed-up
    arrival: float  # seconds from the first arrival, after speed-up
    input_length: int
    output_length: int
    hashes: list[int]  # chained hashes of the full prompt blocks
    # who sent it (generated scenario traffic; None: the simulator's single tenant / class / model)
    tenant: str | None = None
    cls: str | None = None
    model: str | None = None

    @property
    def id(self) -> str:
        return f"r{self.index}"


@dataclass
class Trace:
    source: str
    requests: list[TraceRequest]
    block_size: int = MOONCAKE_BLOCK_TOKENS
    speedup: float = 1.0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival (after speed-up)."""
        return self.requests[-1].arrival if self.requests else 0.0

    def scaled(self, speedup: float) -> "Trace":
        """The same requests with arrivals compressed by ``speedup`` (relative to the file's times)."""
        check_speedup(speedup)
        reqs = [replace(r, arrival=r.base_arrival / speedup) for r in self.requests]
        return Trace(self.source, reqs, self.block_size, speedup)

    def head(self, n: int) -> "Trace":
        """The first ``n`` requests (by arrival)."""
        if n < 1:
            raise SimConfigError(f"limit must be >= 1, got {n}")
        return Trace(self.source, self.requests[:n], self.block_size, self.speedup)


def check_speedup(speedup: float) -> float:
    if not isinstance(speedup, (int, float)) or isinstance(speedup, bool) or not math.isfinite(speedup) \
            or speedup <= 0:
        raise SimConfigError(f"speedup must be a finite number > 0, got {speedup!r}")
    return float(speedup)


class BlockChainer:
    """Turns id lists into chained hashes; memoised, since traces repeat long prefixes."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, object], int] = {}

    def chain(self, ids: Iterable[object]) -> list[int]:
        out: list[int] = []
        parent = ROOT_HASH
        memo = self._memo
        for i in ids:
            key = (parent, i)
            h = memo.get(key)
            if h is None:
                tag = b"i" if isinstance(i, int) else b"s"
                h = memo[key] = _hash(parent, tag + str(i).encode())
            out.append(h)
            parent = h
        return out


def _int_field(obj: dict, name: str, source: str, line: int, minimum: int) -> int:
    value = obj[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceFormatError(source, line, f"field '{name}' must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise TraceFormatError(source, line, f"field '{name}' must be >= {minimum}, got {value}")
    return value


def parse_mooncake(
    lines: Iterable[str | bytes],
    source: str = "<trace>",
    limit: int | None = None,
    speedup: float = 1.0,
    block_size: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """Parse Mooncake JSONL lines. Blank lines are skipped; ``limit`` keeps the first N requests."""
    check_speedup(speedup)
    if limit is not None and limit < 1:
        raise SimConfigError(f"limit must be >= 1, got {limit}")
    if block_size < 1:
        raise SimConfigError(f"block size must be >= 1, got {block_size}")
    chainer = BlockChainer()
    rows: list[tuple[float, int, int, int, list[int]]] = []
    for lineno, raw in enumerate(lines, start=1):
        if limit is not None and len(rows) >= limit:
            break
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise TraceFormatError(source, lineno, f"not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(source, lineno, f"expected a JSON object, got {type(obj).__name__}")
        missing = [f for f in _FIELDS if f not in obj]
        if missing:
            raise TraceFormatError(source, lineno, f"missing field{'s' if len(missing) > 1 else ''} "
                                                   f"{', '.join(repr(m) for m in missing)}")
        ts = obj["timestamp"]
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
            raise TraceFormatError(source, lineno, f"field 'timestamp' must be a number (ms), got {ts!r}")
        n_in = _int_field(obj, "input_length", source, lineno, 1)
        n_out = _int_field(obj, "output_length", source, lineno, 0)
        ids = obj["hash_ids"]
        if not isinstance(ids, list):
            raise TraceFormatError(source, lineno, f"field 'hash_ids' must be a list, got {type(ids).__name__}")
        full = min(len(ids), n_in // block_size)
        for i in ids[:full]:
            if isinstance(i, bool) or not isinstance(i, (int, str)):
                raise TraceFormatError(source, lineno, f"field 'hash_ids' must hold integers, got {i!r}")
        rows.append((ts / 1000.0, lineno, n_in, n_out, chainer.chain(ids[:full])))
    if not rows:
        raise EmptyTraceError(f"{source}: the trace holds no request")
    rows.sort(key=lambda r: (r[0], r[1]))  # stable by line for equal timestamps
    t0 = rows[0][0]
    requests = [
        TraceRequest(index=i, line=line, base_arrival=ts - t0, arrival=(ts - t0) / speedup,
                     input_length=n_in, output_length=n_out, hashes=hashes)
        for i, (ts, line, n_in, n_out, hashes) in enumerate(rows)
    ]
    return Trace(source, requests, block_size, float(speedup))


def load_mooncake(
    path: str | Path,
    limit: int | None = None,
    speedup: float = 1.0,
    block_size: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """Load a Mooncake JSONL trace file (see the module docstring)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return parse_mooncake(f, str(path), limit=limit, speedup=speedup, block_size=block_size)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
