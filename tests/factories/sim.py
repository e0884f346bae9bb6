"""Factories for simulator tests and benchmark experiments: every argument has a keyword default.

``trace_line(ts=1000, ids=[1, 2, 3])`` is one Mooncake JSONL line; ``make_trace(rows)`` parses
such lines (dicts or strings); ``repeated_prefix_rows(...)`` builds the classic "one shared
prefix, requests spaced far apart" workload whose cache hits are exactly predictable.
Pure, no I/O except :func:`write_trace`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import orjson

from natsched.sim.metrics import RequestRecord
from natsched.sim.trace import MOONCAKE_BLOCK_TOKENS, Trace, parse_mooncake


def trace_row(ts: float = 0, *, n_in: int | None = None, n_out: int = 4, ids: Sequence[Any] = (1,),
              block: int = MOONCAKE_BLOCK_TOKENS, **extra: Any) -> dict[str, Any]:
    """One request as a dict; ``n_in`` defaults to exactly ``len(ids)`` full blocks."""
    return {"timestamp": ts, "input_length": n_in if n_in is not None else max(1, len(ids) * block),
            "output_length": n_out, "hash_ids": list(ids), **extra}


def trace_line(ts: float = 0, **kw: Any) -> str:
    return orjson.dumps(trace_row(ts, **kw)).decode()


def make_trace(rows: Iterable[dict[str, Any] | str], *, speedup: float = 1.0, limit: int | None = None,
               block_size: int = MOONCAKE_BLOCK_TOKENS, source: str = "<test>") -> Trace:
    lines = [r if isinstance(r, str) else orjson.dumps(r).decode() for r in rows]
    return parse_mooncake(lines, source, limit=limit, speedup=speedup, block_size=block_size)


def repeated_prefix_rows(n: int = 4, *, shared: Sequence[Any] = (1, 2, 3, 4), gap_ms: float = 10_000,
                         tail_tokens: int = 100, n_out: int = 4, block: int = MOONCAKE_BLOCK_TOKENS
                         ) -> list[dict[str, Any]]:
    """``n`` requests sharing ``shared`` full blocks plus a unique partial tail, ``gap_ms`` apart."""
    return [trace_row(i * gap_ms, n_in=len(shared) * block + tail_tokens, n_out=n_out,
                      ids=[*shared, 1_000_000 + i], block=block) for i in range(n)]


def write_trace(path: str | Path, rows: Iterable[dict[str, Any] | str]) -> Path:
    path = Path(path)
    path.write_text("".join((r if isinstance(r, str) else orjson.dumps(r).decode()) + "\n" for r in rows))
    return path


def make_record(index: int = 0, *, arrival: float = 0.0, cls: str = "online", status: str = "ok",
                ttft: float | None = 0.1, degraded: bool = False, tenant: str = "a", prompt_tokens: int = 100,
                output_tokens: int = 4, door: float = 0.0, cached_tokens: int = 0, attempts: int = 1) -> RequestRecord:
    """One simulated request's outcome; ``ttft`` sets its first token after ``arrival`` (None: none),
    ``door`` its hand-off to a worker."""
    first = None if ttft is None or status != "ok" else arrival + ttft
    return RequestRecord(index, arrival, prompt_tokens, output_tokens, None, worker="w0", routed=arrival + door,
                         first_routed=arrival + door, first_token=first, finish=first, cached_tokens=cached_tokens,
                         status=status, tenant=tenant, cls=cls, degraded=degraded, attempts=attempts)
