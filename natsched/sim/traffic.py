"""Generated scenario traffic: sessions of a customer-service / RAG workload, as replayable requests.

The ``sessions`` generator (the structure of the seeds' workload):

- tenants with their own system prompt (``system_prompt_tokens``, drawn once per tenant) and
  knowledge base of ``kb_chunks`` chunks that changes version every ``kb_version_s`` seconds;
- a session starts as a Poisson arrival (rate ``rate_rps`` x the load x any burst's factor, tenant
  by popularity share, class by ``classes``, model by ``models``); it picks its KB chunks once
  (the conversation is about those documents) and runs ``turns`` turns separated by an
  exponential think time;
- each turn's prompt is ``system | KB chunks (this version) | history | user text``: the history
  is every earlier turn's user text and answer, so it grows turn by turn and is shared only by
  the session; the user text is private.

Prompts become chained block hashes exactly as an engine's prefix cache sees them: a block's
hash covers the segment pieces inside it and its parent block's hash, so two prompts share a
block exactly when they share every token up to its end. Everything is drawn from one seeded
generator per stream (tenant set-up, session starts, each session), so a scenario gives the same
requests on every run, and ``load`` only changes the start rate (the sessions themselves keep
their draws: what the sweep varies is the load, not the population).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from natsched.sim.scenario import Scenario, Traffic
from natsched.sim.trace import Trace, TraceRequest

_MASK = (1 << 63) - 1


def _h(parent: int, payload: str) -> int:
    d = hashlib.blake2b(payload.encode(), digest_size=8, key=parent.to_bytes(8, "little")).digest()
    return int.from_bytes(d, "little") & _MASK


def block_hashes(segments: list[tuple[str, int]], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of a prompt made of ``(segment id, tokens)`` pieces."""
    out: list[int] = []
    parent = 0
    pieces: list[str] = []
    fill = 0
    for seg, n in segments:
        off = 0
        while off < n:
            take = min(n - off, block_size - fill)
            pieces.append(f"{seg}@{off}+{take}")
            off += take
            fill += take
            if fill == block_size:
                parent = _h(parent, "|".join(pieces))
                out.append(parent)
                pieces, fill = [], 0
    return out


def _rng(seed: int, *stream: object) -> random.Random:
    return random.Random(":".join(map(str, (seed, *stream))))


def _uniform_int(rng: random.Random, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    return rng.randint(lo, hi)


def _pick(rng: random.Random, shares: dict[str, float]) -> str:
    x, acc = rng.random(), 0.0
    for name, s in shares.items():
        acc += s
        if x < acc:
            return name
    return next(reversed(shares))


def rate_factor(t: Traffic, at: float) -> float:
    """The burst factor in force at ``at`` seconds (1 outside bursts; overlapping bursts multiply)."""
    f = 1.0
    for b in t.bursts:
        if b.at_s <= at < b.at_s + b.duration_s:
            f *= b.factor
    return f


@dataclass
class _Start:
    at: float
    tenant: str
    cls: str
    model: str
    n: int  # session number


def _starts(sc: Scenario, rate: float, duration: float) -> list[_Start]:
    """Session starts: a Poisson process of ``rate`` x the burst factor, thinned from its maximum."""
    t = sc.traffic
    peak = rate * max([1.0] + [rate_factor(t, b.at_s) for b in t.bursts])
    rng = _rng(sc.seed, "starts")
    out: list[_Start] = []
    now = 0.0
    shares = {x.name: x.share for x in t.tenants}
    while True:
        now += rng.expovariate(peak)
        if now >= duration:
            return out
        keep = rng.random() < rate * rate_factor(t, now) / peak
        tenant, cls, model = _pick(rng, shares), _pick(rng, t.classes), _pick(rng, t.models)
        if keep:
            out.append(_Start(now, tenant, cls, model, len(out)))


def generate(sc: Scenario, load: float = 1.0, rate_rps: float | None = None, scale: float = 1.0) -> Trace:
    """The scenario's requests at ``load`` x its base rate, over ``scale`` x its duration."""
    t = sc.traffic
    rate = (rate_rps if rate_rps is not None else t.rate_rps) * load
    if not rate or rate <= 0:
        raise ValueError("generate needs a positive rate (rate_rps, or the calibrated one)")
    duration = t.duration_s * scale
    bs = sc.block_size
    tenants = {}
    for x in t.tenants:
        r = _rng(sc.seed, "tenant", x.name)
        tenants[x.name] = _uniform_int(r, t.system_prompt_tokens)
    rows: list[tuple[float, str, str, str, int, int, list[int]]] = []
    for st in _starts(sc, rate, duration):
        r = _rng(sc.seed, "session", st.n)
        chunks = sorted(r.sample(range(t.kb_chunks), _uniform_int(r, t.kb_per_request))) if t.kb_chunks else []
        turns = _uniform_int(r, t.turns) if st.cls == "online" else 1
        history: list[tuple[str, int]] = []
        at = st.at
        for k in range(turns):
            user = _uniform_int(r, t.user_tokens)
            out = _uniform_int(r, t.output_tokens)
            version = int(at // t.kb_version_s)
            segs = [(f"sys:{st.tenant}", tenants[st.tenant])]
            segs += [(f"kb:{st.tenant}:{version}:{c}", t.kb_chunk_tokens) for c in chunks]
            segs += history + [(f"user:{st.n}:{k}", user)]
            prompt = sum(n for _, n in segs)
            rows.append((at, st.tenant, st.cls, st.model, prompt, out, block_hashes(segs, bs)))
            history = history + [(f"user:{st.n}:{k}", user), (f"ans:{st.n}:{k}", out)]
            # the next turn comes after this one is answered (its output at ~30 tokens/s) and a pause
            at += out / 30.0 + r.expovariate(1.0 / t.think_s) if t.think_s > 0 else out / 30.0
            if at >= duration:
                break
    rows.sort(key=lambda x: x[0])
    reqs = [TraceRequest(index=i, line=i + 1, base_arrival=a, arrival=a, input_length=p, output_length=o,
                         hashes=h, tenant=tn, cls=c, model=m)
            for i, (a, tn, c, m, p, o, h) in enumerate(rows)]
    return Trace(source=f"scenario:{sc.name}", requests=reqs, block_size=bs)


def session_rate_for(sc: Scenario) -> float:
    """A first guess of the start rate that keeps the cluster busy ``target_busy``: the prefill and
    decode seconds an average session costs on the cluster's profiles, cache ignored (an overestimate
    of the work, so the calibration starts low and climbs)."""
    t = sc.traffic
    prof = sc.profile(sc.workers[0].profile)
    mean_prompt = (sum(t.system_prompt_tokens) / 2 + sum(t.kb_per_request) / 2 * t.kb_chunk_tokens
                   + sum(t.user_tokens) / 2)
    out = sum(t.output_tokens) / 2
    turns = sum(t.turns) / 2 * t.classes.get("online", 0.0) + (1 - t.classes.get("online", 0.0))
    per_req = prof.prefill_seconds(int(mean_prompt)) + out * prof.memory_seconds(0) / 32  # a batch of ~32
    target = t.target_busy[0] if t.target_busy else 0.7
    return max(1e-3, target * sc.n_workers / max(1e-6, per_req * turns))


def mean(xs) -> float:
    xs = list(xs)
    return math.fsum(xs) / len(xs) if xs else 0.0
