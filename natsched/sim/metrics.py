"""Benchmark metrics over the per-request records of one simulated run. Pure.

Definitions (each is a key of the routing benchmark's JSON):

- ``ttft_*``: first-token time minus *arrival* (queueing, routing retries and prefill included);
- ``e2e_*``: finish minus arrival; ``tpot_p50_s``: (finish - first token) / (output tokens - 1),
  over requests that generate more than one token;
- ``hit_ratio``: prompt tokens served from an engine's prefix cache / all prompt tokens (completed
  requests);
- ``ceiling_hit_ratio``: the same for one infinite cache that has seen every earlier request's full
  blocks: per request, its longest previously-seen prefix (capped, like the engine, so that at
  least the last prompt token is computed);
- ``pooled_hit_ratio``: the same for one LRU cache as large as all workers' KV together, fed every
  request in arrival order (a request's blocks freed tail-first, as vLLM frees them): what the
  cluster's KV keeps if placement never duplicated a block. A reference for capacity, not a bound:
  per-worker caches that the router keeps apart can do a little better than one LRU;
- ``throughput_tok_s``: (prompt + output tokens of completed requests) / (last finish - first arrival);
- ``load_cv``: coefficient of variation (population std / mean) of per-worker busy time;
- ``migration_rate``: among requests whose first block was seen before, the share routed to a
  different worker than the previous request with that first block (how often a prefix moves);
- ``busy``: mean over workers of the busy share of the arrival window [first, last arrival];
- ``completed`` / ``rejected``: requests that finished / that never ran (admission, no worker, too
  large for one engine); ``failed``: lost when their worker died and the client's retries ran out.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Container, Iterable, Sequence

from natsched.stats import percentile  # the sim metrics name it here too
from natsched.sim.trace import TraceRequest


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request in a simulated run."""

    index: int
    arrival: float  # simulator time (the trace's arrival + the warm-up)
    prompt_tokens: int
    output_tokens: int
    first_block: int | None  # hash of the first full block, or None
    worker: str | None = None
    routed: float | None = None  # when it was handed to a worker
    first_routed: float | None = None  # when it was first handed to a worker (a rescue routes it again)
    first_token: float | None = None  # the first token the client saw (of any attempt)
    finish: float | None = None
    cached_tokens: int = 0
    expected_cached_tokens: int = 0
    status: str = "pending"  # pending | queued | running | ok | rejected | failed
    reason: str | None = None  # why it was rejected (or failed: lost with a worker, retries used up)
    tenant: str = ""
    cls: str = "online"
    attempts: int = 1  # times the client sent it (1 + its retries)
    refused: int = 0  # refusals it met (each answered by a retry, or the last one final)
    refused_retry_after: int = 0  # ... of which carried a retry_after
    degraded: bool = False  # the admission moved it to the offline path
    rescued: int = 0  # times the scheduler re-ran it elsewhere after its worker died
    migrated: int = 0  # times its stream went on after its output so far on another worker


def ceiling_hit_ratio(requests: Iterable[TraceRequest], block_size: int) -> float:
    """Share of prompt tokens one infinite cache could serve (see the module docstring)."""
    return pooled_hit_ratio(requests, block_size, None)


def pooled_hit_ratio(requests: Iterable[TraceRequest], block_size: int, capacity_blocks: int | None) -> float:
    """Share of prompt tokens one LRU cache of ``capacity_blocks`` (None: unlimited) would serve.

    Each request reuses its longest cached prefix (capped so that its last prompt token is
    computed), then its blocks become the most recent ones, its first block last: a chain is
    evicted from its tail, so what stays cached is always a usable prefix."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in sorted(requests, key=lambda r: r.index):
        n = reusable_blocks(r, lru, block_size)
        hit += n * block_size
        total += max(1, r.input_length)
        for h in reversed(r.hashes):
            lru[h] = None
            lru.move_to_end(h)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return hit / total if total else 0.0


def reusable_blocks(r: TraceRequest, cached: Container[int], block_size: int) -> int:
    """Leading blocks of ``r`` found in ``cached`` (chained hashes: a block implies its whole
    prefix), capped as the engine caps a match so that the last prompt token is computed."""
    n = 0
    for h in r.hashes:
        if h not in cached:
            break
        n += 1
    return min(n, (max(1, r.input_length) - 1) // block_size)


def migration_rate(records: Iterable[RequestRecord]) -> float:
    """Share of repeated-first-block requests sent to another worker than the previous one."""
    last: dict[int, str] = {}
    moved = repeated = 0
    for rec in sorted(records, key=lambda r: (r.routed if r.routed is not None else math.inf, r.index)):
        if rec.worker is None or rec.first_block is None:
            continue
        prev = last.get(rec.first_block)
        if prev is not None:
            repeated += 1
            moved += prev != rec.worker
        last[rec.first_block] = rec.worker
    return moved / repeated if repeated else 0.0


def coefficient_of_variation(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    if mean <= 0:
        return 0.0
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean


def summarize(records: Sequence[RequestRecord], busy_time: Sequence[float], busy_window: Sequence[float],
              window: float) -> dict:
    """The benchmark's per-policy metrics (keys as documented in the module docstring)."""
    done = [r for r in records if r.status == "ok"]
    ttft = [r.first_token - r.arrival for r in done]
    e2e = [r.finish - r.arrival for r in done]
    tpot = [(r.finish - r.first_token) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    tokens = prompt + sum(r.output_tokens for r in done)
    span = (max(r.finish for r in done) - min(r.arrival for r in records)) if done else 0.0
    busy = (sum(busy_window) / len(busy_window) / window) if (window > 0 and busy_window) else (
        sum(busy_time) / len(busy_time) / span if span > 0 and busy_time else 0.0)
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "hit_ratio": cached / prompt if prompt else 0.0,
        "throughput_tok_s": tokens / span if span > 0 else 0.0,
        "load_cv": coefficient_of_variation(list(busy_time)),
        "migration_rate": migration_rate(records),
        "busy": min(1.0, busy),
        "completed": len(done),
        "rejected": sum(1 for r in records if r.status == "rejected"),
        "failed": sum(1 for r in records if r.status == "failed"),
    }
