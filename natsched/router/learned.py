"""The learned cost model: each worker's prefill and decode speed, fitted online. Pure, no I/O.

Why: the fixed :class:`~natsched.router.costmodel.CostModel` holds the constants of one GPU and
one model. Every time the router reasons in seconds (``natsched``'s score, ``preble_e2``, the
busy-until queue estimate) it is wrong by the ratio of the real worker's speed to those
constants — 3-5x for a 27B model, more for an older GPU, and differently for each worker of a
mixed cluster. Each completion already says what happened (prompt, cached and output tokens,
TTFT, TPOT), and the router knows what it assumed when it routed (the predicted wait ahead,
the batch on the worker), so the constants can be fitted per worker as it runs.

The two fits (per worker; a worker serves one model, so this is per (worker, model))::

    prefill:  ttft - predicted wait  ~  t0 + t1 * u/1e3 + t2 * u*(c + u/2)/1e6 + t3 * h/1e3
    decode:   tpot                   ~  d0 + d1 * batch/100 + d2 * batch_kv/1e5

``u`` uncached and ``c`` cached prompt tokens (what the completion reports: the physics of a
prefill, linear plus attention over the context, as in the fixed model), ``batch`` and
``batch_kv`` the running sequences and their KV tokens on the worker when the request was
routed, ``h`` the cached tokens the router expected in the worker's host tier. ``t0`` is the
first-token overhead (at least one engine step); ``t1`` maps to ``1e3 / prefill_tokens_per_s``,
``t2`` to the attention term, ``t3`` to ``1e3 / host_tokens_per_s`` (the host tier's bandwidth,
learned where hosts hits happen, else the configured value); ``d0`` is the empty-batch step.

How (:class:`Fit`): a weighted least-squares regression on decayed sufficient statistics
(``A = sum w x x'``, ``b = sum w x y``) with a ridge towards a prior, solved on demand — the
same estimate as recursive least squares with exponential forgetting, but in a form that
*adds up*: statistics of several router replicas sum to the fit of all their samples, which is
how replicas share one estimate (:meth:`CostBook.export` / :meth:`CostBook.merge`, stored in
bucket ``workers``, see ``subjects.md``). Choices:

- **relative errors**: each sample is weighted by ``1 / prediction^2``, so a 10 ms TTFT and a
  10 s TTFT count alike (absolute errors would fit only the long prompts);
- **decay by time** (``tau_s``, 10 s): statistics are multiplied by ``exp(-dt / tau)`` at each
  new sample, so a changed worker is re-learned within a minute (a worker slowed to a third:
  ~17 % off after 30 s, ~3 % after 60 s in the tests; relative weighting makes the old, faster
  samples weigh more, hence 10 s and not 20);
  never below ``min_weight`` samples' worth, so a worker that was idle for an hour keeps what
  was learned instead of falling back to its prior on its first sample;
- **prior** (``prior_weight`` pseudo-samples): the calibration stored by ``natsched worker
  calibrate`` when there is one, else the fixed model; a worker that reports nothing keeps it;
- **pooled within a group**: workers of one (model, deployment) run the same engine on the same
  hardware, so they are routed with the fit of all of them together, unless a worker's own fit
  (drawn towards the group's by ``group_weight`` samples) predicts a reference prefill or decode
  step more than ``group_deviation`` away from it — then it really differs (another GPU under
  the same name, a slowed one) and its own fit is used. Fitted alone, eight identical workers
  came out a few % apart, and the policies, which trust every difference, loaded them unevenly:
  the first "faster" one collected the hot prefixes (load CV 0.02 -> 0.2 on the routing
  benchmark);
- **robust**: a sample whose relative residual exceeds ``huber_k`` robust scales is
  down-weighted (Huber); only a TTFT with (nearly) no predicted queue ahead teaches the prefill
  (``max_queue_share``): the queue estimate's error grows with the load, and learning through it
  made busy workers look faster, so they got more work (load CV 0.02 -> 0.2 on the routing
  benchmark);
- **refused and counted** (:attr:`CostBook.refused`): non-finite or negative times, cached >
  prompt, TTFT or TPOT beyond ``max_ttft_s`` / ``max_tpot_s``, and rates no hardware reaches
  (``max_prefill_tokens_per_s``, ``min_step_s``). They never reach the statistics;
- **physical coefficients**: negative solutions are clipped (a worker never prefills faster with
  more tokens); the slopes keep at least ``min_slope_share`` of the prior's.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from natsched.router.costmodel import CostModel
from natsched.router.errors import ConfigError

PREFILL, DECODE = "prefill", "decode"
#: where a worker's own fit is compared with its group's: short and long cold prompts, a busy batch
REFERENCE_PROMPTS = (512, 8192)
REFERENCE_BATCH = (100_000, 32)  # KV tokens, sequences


@dataclass
class LearnSettings:
    enabled: bool = True  # False: every worker uses the fixed model (the comparison baseline)
    tau_s: float = 10.0  # decay time of old samples: a changed worker is re-learned within a minute
    min_weight: float = 100.0  # decay never takes the samples below this many samples' worth
    prior_weight: float = 2.0  # pseudo-samples of the prior (calibration, else the fixed model)
    group_weight: float = 20.0  # samples' worth of the group's pooled fit in each member's (per coefficient)
    group_refresh: int = 20  # the group's fit is re-solved after this many new samples in it
    group_deviation: float = 0.25  # a member this far from the group's estimate is routed on its own fit
    max_queue_share: float = 0.1  # a TTFT teaches the prefill only if the predicted wait was below this x it
    huber_k: float = 3.0  # residuals beyond k robust scales are down-weighted
    min_slope_share: float = 0.02  # a fitted slope stays >= this share of the prior's
    max_ttft_s: float = 3600.0  # longer reports are refused (a clock jump, not a prefill)
    max_tpot_s: float = 60.0
    max_prefill_tokens_per_s: float = 5e7  # faster than any accelerator: refused
    min_step_s: float = 1e-5  # a decode step shorter than this is refused

    def __post_init__(self) -> None:
        if self.tau_s <= 0 or self.min_weight < 0 or self.prior_weight <= 0 or self.huber_k <= 0:
            raise ConfigError("learned cost: tau_s, prior_weight, huber_k > 0 and min_weight >= 0")
        if not 0.0 < self.min_slope_share <= 1.0:
            raise ConfigError("learned cost: min_slope_share must be within (0, 1]")


# ------------------------------------------------------------------ features


def prefill_features(uncached: float, cached: float, host: float = 0.0) -> list[float]:
    """[1, u/1e3, u (c + u/2) / 1e6, h/1e3]: overhead, linear, attention and host-load terms."""
    return [1.0, uncached / 1e3, uncached * (cached + uncached / 2.0) / 1e6, host / 1e3]


def decode_features(batch: float, batch_kv: float) -> list[float]:
    """[1, batch/100, batch_kv/1e5]: empty-batch step, per sequence and per KV token terms."""
    return [1.0, batch / 100.0, batch_kv / 1e5]


def prior_theta(cost: CostModel) -> dict[str, list[float]]:
    """The coefficients a fixed :class:`CostModel` stands for, in the fits' units."""
    inv = 1e3 / cost.prefill_tokens_per_s
    return {
        PREFILL: [cost.ttft_overhead_s, inv, 1e3 * inv / cost.attention_ctx_tokens, 1e3 / cost.host_tokens_per_s],
        DECODE: [cost.decode_step_s, cost.decode_s_per_seq * 100.0, cost.decode_s_per_1k_ctx * 100.0],
    }


def to_cost(base: CostModel, theta: Mapping[str, Sequence[float]]) -> CostModel:
    """The :class:`CostModel` of fitted coefficients (capacities and the rest from ``base``)."""
    t0, t1, t2, t3 = theta[PREFILL]
    d0, d1, d2 = theta[DECODE]
    tps = 1e3 / t1
    return replace(base, ttft_overhead_s=t0, prefill_tokens_per_s=tps, host_tokens_per_s=1e3 / t3,
                   attention_ctx_tokens=(1e3 * t1 / t2) if t2 > 0 else 1e12,
                   decode_step_s=d0, decode_s_per_seq=d1 / 100.0, decode_s_per_1k_ctx=d2 / 100.0)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (3x3: no library needed); None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


# ------------------------------------------------------------------ one regression


class Fit:
    """Decayed weighted sufficient statistics of ``y ~ theta . x`` (see the module docstring)."""

    __slots__ = ("k", "a", "b", "n", "at", "scale")

    def __init__(self, k: int = 3) -> None:
        self.k = k
        self.a = [[0.0] * k for _ in range(k)]
        self.b = [0.0] * k
        self.n = 0.0  # decayed sample count (unweighted), for the floor and for reports
        self.at: float | None = None  # time of the last sample
        self.scale = 1.0  # robust scale of the relative residuals (EWMA of |r|)

    def decay_to(self, now: float, tau: float, min_weight: float) -> None:
        if self.at is None or now <= self.at:
            return
        f = math.exp(-(now - self.at) / tau)
        if self.n * f < min_weight:  # keep at least min_weight samples' worth
            f = min(1.0, min_weight / self.n) if self.n > 0 else 1.0
        if f < 1.0:
            self.n *= f
            self.b = [v * f for v in self.b]
            self.a = [[v * f for v in row] for row in self.a]

    def add(self, x: Sequence[float], y: float, w: float, now: float) -> None:
        for i in range(self.k):
            wx = w * x[i]
            self.b[i] += wx * y
            row = self.a[i]
            for j in range(self.k):
                row[j] += wx * x[j]
        self.n += 1.0
        self.at = now if self.at is None or now > self.at else self.at

    def solve(self, prior: Sequence[float], prior_weight: float, min_slope: Sequence[float],
              extra: Sequence["Fit"] = (), scaled: bool = True) -> list[float]:
        """Coefficients of this fit plus ``extra`` ones (other replicas'), ridged towards ``prior``.

        The ridge is ``prior_weight`` pseudo-samples at the prior's own relative weight, so a fit
        with no samples returns ``prior`` exactly. Components are clipped to ``min_slope``
        (>= 0) and the rest re-solved with them fixed: a small active-set step.
        """
        k = self.k
        a = [row[:] for row in self.a]
        b = self.b[:]
        for f in extra:
            for i in range(k):
                b[i] += f.b[i]
                for j in range(k):
                    a[i][j] += f.a[i][j]
        # ridge: prior_weight pseudo-samples of each coefficient at relative weighting (a sample
        # whose prediction is all coefficient i carries 1 / theta_i^2 of information on it); the
        # features are scaled so that every coefficient is "seconds for a typical amount", so a
        # zero prior borrows a tenth of the largest one as its scale
        # The samples are weighted 1 / prediction^2, as if their noise were 100 %: the prior is
        # scaled by the fit's robust relative scale squared (its real noise) to stay comparable
        ref = 0.1 * max(prior)
        # symmetric in the replicas, so that they agree exactly; ``scaled`` False: the pseudo-samples
        # are as informative as real ones whatever the noise (the group's pooled fit, not a guess)
        noise = max([self.scale, *(f.scale for f in extra)]) ** 2 if scaled else 1.0
        for i in range(k):
            p = prior[i] if prior[i] > ref else ref
            lam = (prior_weight * noise / (p * p)) if p > 0 else prior_weight
            a[i][i] += lam
            b[i] += lam * prior[i]
        fixed: dict[int, float] = {}
        theta = list(prior)
        for _ in range(k):
            free = [i for i in range(k) if i not in fixed]
            sub_a = [[a[i][j] for j in free] for i in free]
            sub_b = [b[i] - sum(a[i][j] * v for j, v in fixed.items()) for i in free]
            sol = _solve(sub_a, sub_b)
            if sol is None:
                return list(prior)
            for i, v in zip(free, sol):
                theta[i] = v
            low = [i for i in free if theta[i] < min_slope[i]]
            if not low:
                break
            for i in low:
                fixed[i] = theta[i] = min_slope[i]
        return theta

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "n": self.n, "at": self.at, "scale": self.scale}

    @classmethod
    def from_json(cls, raw: Any, k: int = 3) -> "Fit":
        """Parse another replica's statistics; raises ValueError on anything malformed."""
        if not isinstance(raw, dict):
            raise ValueError("fit must be a map")
        a, b, n, at, scale = raw.get("a"), raw.get("b"), raw.get("n"), raw.get("at"), raw.get("scale", 1.0)
        ok = (isinstance(a, list) and len(a) == k and all(isinstance(r, list) and len(r) == k for r in a)
              and isinstance(b, list) and len(b) == k and isinstance(n, (int, float)) and n >= 0
              and (at is None or isinstance(at, (int, float))))
        values = [v for row in a for v in row] + list(b) if ok else []
        if not ok or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                             for v in values + [n, scale]) or not 0 < scale <= 2.0:
            raise ValueError("fit must be {a: kxk numbers, b: k numbers, n >= 0, at}")
        if any(a[i][i] < 0 for i in range(k)):
            raise ValueError("fit statistics must have a non-negative diagonal")
        f = cls(k)
        f.a, f.b, f.n, f.at = [[float(v) for v in r] for r in a], [float(v) for v in b], float(n), at
        f.scale = float(scale)
        return f


# ------------------------------------------------------------------ every worker's model


@dataclass
class Sample:
    """What one completion taught about its worker (the router's side filled at routing time)."""

    uncached: float
    cached: float
    ttft: float | None
    tpot: float | None
    wait_s: float = 0.0  # the queue ahead the router predicted when it routed
    batch: float = 0.0  # running sequences on the worker then (this one included)
    batch_kv: float = 0.0  # their KV tokens (this one's included)
    host: float = 0.0  # of ``cached``, the tokens expected from the host tier


class _Worker:
    __slots__ = ("fits", "prior", "source", "cost", "others", "frozen", "group", "pooled")

    def __init__(self, prior: CostModel, source: str) -> None:
        self.fits = {PREFILL: Fit(4), DECODE: Fit(3)}
        self.prior = prior
        self.source = source  # "profile" | "calibration"
        self.cost: CostModel | None = None  # cached solution; None: stale
        self.others: dict[str, dict[str, Fit]] = {}  # replica -> its published fits
        self.frozen = False  # half-open (natsched.router.health): its samples are not learned
        self.group: str | None = None  # (model, deployment) key: pooled with the other members
        self.pooled = False  # ``cost`` is the group's pooled fit (the member does not deviate from it)


class _Group:
    __slots__ = ("members", "theta", "pending")

    def __init__(self) -> None:
        self.members: set[str] = set()
        self.theta: dict[str, list[float]] | None = None  # cached pooled fit; None: stale
        self.pending = 0  # samples since it was solved


class CostBook:
    """Per-worker cost models: learned (:class:`Fit`) when enabled, else the fixed ``base``."""

    def __init__(self, base: CostModel | None = None, settings: LearnSettings | None = None) -> None:
        self.base = base or CostModel()
        self.settings = settings or LearnSettings()
        self._w: dict[str, _Worker] = {}
        self._groups: dict[str, _Group] = {}
        self.refused: Counter[str] = Counter()  # reason -> bad reports refused
        self.accepted = 0
        # what a worker never heard of gets: the prior as the fits see it (see _solve)
        self.prior_cost = replace(self.base, ttft_overhead_s=max(self.base.ttft_overhead_s, self.base.decode_step_s))

    # ------------------------------------------------------------------ queries

    def of(self, w: str) -> CostModel:
        """The cost model routing uses for worker ``w`` now."""
        if not self.settings.enabled:
            return self.base
        st = self._w.get(w)
        if st is None:
            return self.prior_cost
        if st.cost is None:
            st.cost = self._solve(st)
        return st.cost

    def samples(self, w: str) -> float:
        """Decayed samples behind ``w``'s estimate (own and other replicas'); 0: the prior alone."""
        st = self._w.get(w)
        if st is None or not self.settings.enabled:
            return 0.0
        own = st.fits[PREFILL].n
        return own + sum(f[PREFILL].n for f in st.others.values())

    def group_members(self, w: str) -> frozenset[str]:
        """The members of ``w``'s (model, deployment) group, ``w`` included; empty: no group."""
        st = self._w.get(w)
        g = self._groups.get(st.group) if st is not None and st.group is not None else None
        return frozenset(g.members) if g is not None else frozenset()

    def yardstick_samples(self, w: str, min_own: float, min_members: int) -> float:
        """Decayed samples behind the estimate ``w`` is judged by: its group's, all members
        together, while it is routed on the group's pooled fit, has shown it runs like the group
        (at least ``min_own`` samples of its own) and the group has ``min_members`` members or
        more; else its own (:meth:`samples`).

        Why: health judges a worker only against a learned estimate (a prior is no yardstick).
        In a large pool each member completes few requests (12 L4s: ~40 samples each after two
        minutes), so its own count stayed under the threshold and a slowed member went unjudged
        for a minute, while the pooled estimate it was routed on had learned from hundreds. A
        member with fewer than ``min_own`` samples of its own (a new one, or another GPU under the
        same deployment name, which its first samples have not yet moved off the group's) is not
        judged by the group: it has not yet shown that it should run like it. A smaller group
        is not either: its pooled fit is hardly more than the member's own, and there are not
        enough peers to judge the member's heartbeats against (:meth:`ProgressWatch.relative`)."""
        st = self._w.get(w)
        if st is None or not self.settings.enabled:
            return 0.0
        own = self.samples(w)
        # as of the last solve: solving here would re-fit the group at other moments than routing does
        g = self._groups.get(st.group) if st.group is not None else None
        if not st.pooled or own < min_own or g is None or len(g.members) < min_members:
            return own
        return sum(self.samples(m) for m in g.members)

    def describe(self, w: str) -> dict[str, float]:
        """Audit terms: which estimate routing used (learned or fixed, its samples and rates)."""
        c = self.of(w)
        st = self._w.get(w)
        learned = 1.0 if self.settings.enabled and st is not None and self.samples(w) > 0 else 0.0
        return {"cost_learned": learned, "cost_samples": round(self.samples(w), 1),
                "cost_calibrated": 1.0 if st is not None and st.source == "calibration" else 0.0,
                "cost_prefill_tps": round(c.prefill_tokens_per_s, 1), "cost_step_ms": round(c.decode_step_s * 1e3, 3)}

    def workers(self) -> list[str]:
        return list(self._w)

    # ------------------------------------------------------------------ inputs

    def set_prior(self, w: str, prior: CostModel, source: str = "calibration") -> None:
        """Start ``w`` from ``prior`` (a calibration); samples already learned are kept."""
        st = self._state(w)
        st.prior, st.source, st.cost = prior, source, None

    def reconfigure(self, settings: LearnSettings) -> None:
        """New settings from now on (``natsched route set --learn``); the statistics are kept."""
        self.settings = settings
        for g in self._groups.values():
            self._invalidate(g)
        for st in self._w.values():
            st.cost = None

    def set_group(self, w: str, group: str | None) -> None:
        """Pool ``w`` with the other workers of ``group`` (its model and deployment); None: alone."""
        st = self._state(w)
        if st.group == group:
            return
        if st.group is not None:
            self._leave(w, st.group)
        st.group, st.cost = group, None
        if group is not None:
            g = self._groups.setdefault(group, _Group())
            g.members.add(w)
            self._invalidate(g)

    def _leave(self, w: str, group: str) -> None:
        g = self._groups.get(group)
        if g is not None:
            g.members.discard(w)
            if not g.members:
                del self._groups[group]
            else:
                self._invalidate(g)

    def _invalidate(self, g: _Group) -> None:
        g.theta, g.pending = None, 0
        for m in g.members:
            st = self._w.get(m)
            if st is not None:
                st.cost = None

    def freeze(self, w: str, frozen: bool) -> None:
        """While frozen (half-open), ``w``'s samples are counted but not learned."""
        self._state(w).frozen = frozen

    def forget(self, w: str) -> None:
        st = self._w.pop(w, None)
        if st is not None and st.group is not None:
            self._leave(w, st.group)

    def observe(self, w: str, s: Sample, now: float) -> str | None:
        """Learn from one completion; returns None, or why it was refused (also counted)."""
        why = self._check(s)
        if why is not None:
            self.refused[why] += 1
            return why
        self.accepted += 1
        if not self.settings.enabled:
            return None
        st = self._state(w)
        if st.frozen:
            return None
        cfg = self.settings
        cur = self.of(w)
        if s.ttft is not None:
            host = s.host if s.host < s.cached else s.cached
            own = cur.first_token_s(s.uncached, s.cached, host)
            # only samples with (nearly) no queue ahead teach the prefill: under a queue, TTFT minus
            # the *predicted* wait carries the wait's error, and that error grows with the load, so
            # busy workers looked faster, got more work, looked faster still (a feedback loop)
            if s.wait_s <= cfg.max_queue_share * own:
                self._learn(st, PREFILL, prefill_features(s.uncached, s.cached, host), max(s.ttft - s.wait_s, 0.1 * own),
                            own, 1.0, now)
        if s.tpot is not None:
            pred = cur.step_s(s.batch_kv, s.batch)
            self._learn(st, DECODE, decode_features(s.batch, s.batch_kv), s.tpot, pred, 1.0, now)
        st.cost = None
        g = self._groups.get(st.group) if st.group is not None else None
        if g is not None:
            g.pending += 1
            if g.pending >= self.settings.group_refresh:
                self._invalidate(g)
        return None

    def _check(self, s: Sample) -> str | None:
        cfg = self.settings
        for v in (s.uncached, s.cached, s.wait_s, s.batch, s.batch_kv, s.host):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                return "bad_counts"
        if s.ttft is not None:
            if not isinstance(s.ttft, (int, float)) or not math.isfinite(s.ttft) or s.ttft <= 0:
                return "bad_ttft"
            if s.ttft > cfg.max_ttft_s:
                return "absurd_ttft"
            if s.uncached / s.ttft > cfg.max_prefill_tokens_per_s:
                return "absurd_rate"
        if s.tpot is not None:
            if not isinstance(s.tpot, (int, float)) or not math.isfinite(s.tpot) or s.tpot < 0:
                return "bad_tpot"
            if s.tpot > cfg.max_tpot_s or s.tpot < cfg.min_step_s:
                return "absurd_tpot"
        return None

    def _learn(self, st: _Worker, which: str, x: list[float], y: float, pred: float, share: float,
               now: float) -> None:
        cfg = self.settings
        fit = st.fits[which]
        fit.decay_to(now, cfg.tau_s, cfg.min_weight)
        pred = pred if pred > 1e-9 else 1e-9
        r = abs(y - pred) / pred
        cut = cfg.huber_k * fit.scale
        huber = 1.0 if r <= cut else cut / r
        # the scale follows |r| clipped at twice itself: a lone outlier moves it by 10 % at most,
        # a lasting change (the worker slowed down) raises it within tens of samples, and then
        # its samples count fully again: outliers are ignored, a new normal is learned
        fit.scale += 0.1 * ((r if r < 2.0 * fit.scale else 2.0 * fit.scale) - fit.scale)
        fit.scale = min(max(fit.scale, 0.05), 2.0)
        fit.add(x, y, huber * share / (pred * pred), now)

    # ------------------------------------------------------------------ sharing between replicas

    def export(self, w: str) -> dict[str, Any] | None:
        """This replica's own statistics of ``w`` (JSON-ready), None when it has none."""
        st = self._w.get(w)
        if st is None or st.fits[PREFILL].at is None and st.fits[DECODE].at is None:
            return None
        return {"v": 1, PREFILL: st.fits[PREFILL].to_json(), DECODE: st.fits[DECODE].to_json()}

    def record(self, w: str, now: float, health: str = "healthy") -> dict[str, Any] | None:
        """What a replica publishes about ``w`` (bucket ``workers``, ``cost.<worker>.<replica>``):
        its own statistics (which the others merge), and for operators the estimate it routes with
        and its health verdict. None when it has learned nothing of ``w`` itself."""
        stats = self.export(w)
        if stats is None:
            return None
        c = self.of(w)
        return {"v": 1, "at": now, "stats": stats, "health": health, "samples": round(self.samples(w), 1),
                "estimate": {"prefill_tokens_per_s": c.prefill_tokens_per_s, "attention_ctx_tokens": c.attention_ctx_tokens,
                             "ttft_overhead_s": c.ttft_overhead_s, "decode_step_s": c.decode_step_s,
                             "decode_s_per_1k_ctx": c.decode_s_per_1k_ctx, "decode_s_per_seq": c.decode_s_per_seq,
                             "host_tokens_per_s": c.host_tokens_per_s}}

    def last_sample(self, w: str) -> float | None:
        """Time of this replica's newest own sample of ``w`` (what a publish would change)."""
        st = self._w.get(w)
        if st is None:
            return None
        ats = [f.at for f in st.fits.values() if f.at is not None]
        return max(ats) if ats else None

    def merge(self, w: str, replica: str, raw: Any) -> None:
        """Take another replica's published statistics of ``w`` (replacing its previous ones).

        Raises ValueError for a malformed record (the caller logs and counts it); ``None``
        removes that replica's contribution.
        """
        if raw is None:
            st = self._w.get(w)
            if st is not None:
                st.others.pop(replica, None)
                st.cost = None
            return
        if not isinstance(raw, dict):
            raise ValueError("cost statistics must be a map")
        fits = {PREFILL: Fit.from_json(raw.get(PREFILL), 4), DECODE: Fit.from_json(raw.get(DECODE), 3)}
        st = self._state(w)
        st.others[replica] = fits
        st.cost = None

    # ------------------------------------------------------------------ internals

    def _state(self, w: str) -> _Worker:
        st = self._w.get(w)
        if st is None:
            st = self._w[w] = _Worker(self.base, "profile")
        return st

    def _prior(self, st: _Worker) -> dict[str, list[float]]:
        prior = prior_theta(st.prior)
        # a first token comes at the end of an engine step at the least: the fixed model has no
        # such overhead, its learned counterpart starts from one empty-batch step
        prior[PREFILL][0] = max(prior[PREFILL][0], st.prior.decode_step_s)
        return prior

    def _floors(self, prior: dict[str, list[float]]) -> dict[str, list[float]]:
        cfg = self.settings
        out = {}
        for which, p in prior.items():
            floor = [0.0] + [v * cfg.min_slope_share for v in p[1:]]
            if which == PREFILL:
                floor[1] = max(floor[1], 1e3 / cfg.max_prefill_tokens_per_s)
                floor[3] = max(floor[3], 1e3 / cfg.max_prefill_tokens_per_s)
            else:
                floor[0] = max(p[0] * cfg.min_slope_share, cfg.min_step_s)
            out[which] = floor
        return out

    def _group_theta(self, st: _Worker) -> dict[str, list[float]] | None:
        """The pooled fit of ``st``'s group (all members' own and shared statistics), cached."""
        g = self._groups.get(st.group) if st.group is not None else None
        if g is None or len(g.members) < 2:
            return None
        if g.theta is None:
            prior = self._prior(st)
            floors = self._floors(prior)
            members = [self._w[m] for m in sorted(g.members) if m in self._w]
            g.theta = {}
            for which, k in ((PREFILL, 4), (DECODE, 3)):
                fits = [f for m in members for f in (m.fits[which], *(o[which] for _, o in sorted(m.others.items())))]
                g.theta[which] = Fit(k).solve(prior[which], self.settings.prior_weight, floors[which], fits)
        return g.theta

    def _solve(self, st: _Worker) -> CostModel:
        cfg = self.settings
        prior = self._prior(st)
        floors = self._floors(prior)
        pooled = self._group_theta(st)
        theta = {}
        for which in (PREFILL, DECODE):
            extra = [f[which] for _, f in sorted(st.others.items())]
            if pooled is not None:  # shrink towards the group, itself fitted from the prior
                theta[which] = st.fits[which].solve(pooled[which], cfg.group_weight, floors[which], extra, scaled=False)
            else:
                theta[which] = st.fits[which].solve(prior[which], cfg.prior_weight, floors[which], extra)
        own = to_cost(st.prior, theta)
        st.pooled = False
        if pooled is None:
            return own
        group = to_cost(st.prior, pooled)
        off = max(abs(own.first_token_s(t) / group.first_token_s(t) - 1.0) for t in REFERENCE_PROMPTS)
        off = max(off, abs(own.step_s(*REFERENCE_BATCH) / group.step_s(*REFERENCE_BATCH) - 1.0))
        st.pooled = off <= cfg.group_deviation
        return group if st.pooled else own


def calibrated_prior(base: CostModel, ttft_s: float, tpot_s: float, prompt_tokens: int) -> CostModel:
    """A prior from ``natsched worker calibrate``'s lowest level: ``ttft_s`` for a cold prompt of
    ``prompt_tokens`` and ``tpot_s`` with one sequence running. The fixed model's shape is kept and
    scaled to those two points (one measurement cannot separate an overhead from a slope)."""
    if not (ttft_s > 0 and tpot_s > 0 and prompt_tokens > 0) or not (math.isfinite(ttft_s) and math.isfinite(tpot_s)):
        raise ValueError("calibration baselines must be positive and finite")
    q = tpot_s / base.step_s(prompt_tokens, 1)
    step = base.decode_step_s * q  # the first token costs one engine step at least
    prefill = ttft_s - step if ttft_s > 2 * step else ttft_s / 2
    r = prefill / base.prefill_ctx_s(prompt_tokens)
    return replace(base, ttft_overhead_s=ttft_s - prefill, prefill_tokens_per_s=base.prefill_tokens_per_s / r,
                   decode_step_s=step, decode_s_per_seq=base.decode_s_per_seq * q,
                   decode_s_per_1k_ctx=base.decode_s_per_1k_ctx * q)
