"""Where a run's slowest requests waited: at the door, in the engine, for a missed cache. Pure.

Why: a TTFT p99 says how long the tail is, not where it is, and two contenders level on the
p99 can be level for different reasons. The adaptive-LIFO change came from splitting hetero's
slowest requests by hand: every one was the second model's, each had waited 4-7 s at the door and
under a second in the engine (docs/scenarios.md, "Adaptive LIFO at the door"). The split is now
part of every run, so the next reading needs no script.

The tail of a run is its served requests whose TTFT is at or past the run's p99 (the ones that set
it). One row for the whole tail (model and class :data:`ALL`), then one per (model, class) in it,
each with the tail's size ``n`` and these means:

- ``ttft_s``: arrival (the client's first send) to the first token the client saw;
- ``door_s``: arrival to the hand-off to the worker that gave the first token — the admission's
  queue, its refusals with the client's backoff before each retry, the router's waits for a
  worker, and any earlier attempt lost with a dead worker (a stream migrated after its first
  token counts its first hand-off);
- ``engine_s``: from there to the first token — that worker's queue and the prefill;
  ``door_s + engine_s = ttft_s``. It splits in two: ``prefill_s``, the request's own prefill
  alone on that worker's engine at full speed with the cache it found there, and ``queue_s``,
  the rest — waiting behind other work, sharing steps with it, a slowed engine;
- ``floor_s``: the ideal cluster's TTFT of the same requests (:mod:`natsched.sim.ideal`): each
  alone on an idle engine of the fastest profile with every earlier prompt cached — the part no
  scheduler removes;
- ``missed_cache``: the share of their prompt tokens that the ideal cluster had cached and this
  run computed (what the routing, or evictions, cost them in prefill);
- ``attempts``: the client's sends per request (1 + its retries);
- ``degraded``: the share the admission moved to the offline path (late on purpose).

``merge_tails`` pools the cells of a sweep (means weighted by each cell's tail size); ``natsched
bench scenarios --tails`` prints them, and its JSON holds them (``tails``, and ``tail`` per run).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping

from natsched.sim.ideal import prefill_alone_s
from natsched.sim.metrics import RequestRecord
from natsched.stats import percentile
from natsched.workers.profiles import EngineProfile

ALL = "*"  # the model and class of the whole tail's row
PARTS = ("ttft_s", "door_s", "engine_s", "prefill_s", "queue_s", "floor_s", "missed_cache", "attempts", "degraded")


def tail_split(records: Iterable[RequestRecord], models: Mapping[int, str], floors: Mapping[int, float],
               ideal_cached: Mapping[int, int], profiles: Mapping[str, EngineProfile],
               q: float = 99) -> list[dict[str, Any]]:
    """The rows of the module docstring over the served requests whose TTFT is at or past the run's
    ``q``-th percentile. ``models``, ``floors`` and ``ideal_cached`` are keyed by request index,
    ``profiles`` by worker; an empty run has no tail ([])."""
    served = [r for r in records if r.status == "ok" and r.first_token is not None]
    cut = percentile([r.first_token - r.arrival for r in served], q)
    if cut is None:
        return []
    tail = [r for r in served if r.first_token - r.arrival >= cut]
    groups: dict[tuple[str, str], list[RequestRecord]] = {}
    for r in tail:
        groups.setdefault((models.get(r.index, "default"), r.cls), []).append(r)
    return [{"model": m, "cls": c, **_means(rs, floors, ideal_cached, profiles)}
            for (m, c), rs in [((ALL, ALL), tail), *sorted(groups.items())]]


def _means(tail: list[RequestRecord], floors: Mapping[int, float], ideal_cached: Mapping[int, int],
           profiles: Mapping[str, EngineProfile]) -> dict[str, float]:
    parts = [_parts(r, floors, ideal_cached, profiles) for r in tail]
    return {"n": len(tail), **{p: statistics.fmean(x[p] for x in parts) for p in PARTS}}


def _parts(r: RequestRecord, floors: Mapping[int, float], ideal_cached: Mapping[int, int],
           profiles: Mapping[str, EngineProfile]) -> dict[str, float]:
    """One tail request's :data:`PARTS` (the module docstring)."""
    ttft = r.first_token - r.arrival
    handed = r.routed if r.routed is not None and r.routed <= r.first_token else r.first_routed
    door = min(r.first_token if handed is None else handed, r.first_token) - r.arrival
    engine = ttft - door
    profile = profiles.get(r.worker) if r.worker is not None else None
    # at most what the engine took (a stream migrated after its first token is costed on its last worker)
    prefill = 0.0 if profile is None else min(engine, prefill_alone_s(profile, r.prompt_tokens, r.cached_tokens))
    return {"ttft_s": ttft, "door_s": door, "engine_s": engine, "prefill_s": prefill, "queue_s": engine - prefill,
            "floor_s": floors.get(r.index, 0.0),
            "missed_cache": max(0, ideal_cached.get(r.index, 0) - r.cached_tokens) / max(1, r.prompt_tokens),
            "attempts": float(r.attempts), "degraded": float(r.degraded)}


def merge_tails(cells: Iterable[list[Mapping[str, Any]] | None]) -> list[dict[str, Any]]:
    """The tails of several cells as one: per (model, class), ``n`` summed and each part's mean
    weighted by ``n``; the whole tail's row first."""
    acc: dict[tuple[str, str], dict[str, float]] = {}
    for cell in cells:
        for row in cell or []:
            a = acc.setdefault((row["model"], row["cls"]), {"n": 0, **{p: 0.0 for p in PARTS}})
            a["n"] += row["n"]
            for p in PARTS:
                a[p] += row[p] * row["n"]
    keys = sorted(acc, key=lambda k: (k != (ALL, ALL), k))
    return [{"model": m, "cls": c, "n": acc[m, c]["n"], **{p: acc[m, c][p] / acc[m, c]["n"] for p in PARTS}}
            for m, c in keys if acc[m, c]["n"]]
