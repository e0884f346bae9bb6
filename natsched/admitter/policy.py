"""The admission decision: pure and synchronous (state in, decision out).

The unit is the *runtime token* (ARCHITECTURE.md): a request costs the prompt tokens it will
prefill plus the KV it will hold (prompt + expected output), so a 10-token chat and a
50k-token document are not the same load. This module decides; ``natsched.admitter.service`` does I/O.

The shared in-flight state (:class:`~natsched.admitter.usage.Usage`) lives in JetStream KV and is changed
by compare-and-swap by the service, so the core separates *evaluating* from *applying*:
``evaluate`` and ``plan_dequeue`` have no side effects and may be re-run after a lost race;
``apply`` and ``commit_dequeue`` change the local queue (and the local copy of the usage, which
the service overwrites with the shared value before each decision anyway).

Decision flow of :meth:`AdmitterCore.evaluate` (first match wins):

==========================================  =========  ======================================
condition                                   decision   reason
==========================================  =========  ======================================
malformed (class, subject, max_tokens ...)  reject     invalid_class, subject_mismatch,
                                                       invalid_max_tokens, prompt_too_long,
                                                       invalid
already queued (redelivered message)        queue      -
model served by no live worker (once any    reject     unknown_model (the served ones named)
worker reported: see set_served_models)
model no router pool routes (a pool map is  reject     no_pool (the pools named)
configured: see set_pools)
tenant unknown and quotas say reject        reject     unknown_tenant
cost > total / tenant cap / model limit     reject     too_large / tenant_cap / model_limit /
/ class limit (+ what it may borrow)                   class_limit
deadline already passed                     reject     deadline_exceeded
class offline                               degrade    offline
batch or degradable, usage+cost over the    degrade    watermark
degrade watermark
tenant's usage + cost over its cap          reject     tenant_cap (with retry_after)
fits now and nothing queued outranks it     allow      - (with the loan its class borrows,
(its class limit too, borrowing included,              if any: natsched.admitter.classes)
and its model's capacity: set_model_totals)
class has no queue (limit 0)                reject     quota_exhausted (with retry_after)
its (model, class) queue stands and the     reject     overloaded (with retry_after)
model's own estimated wait is past the
target (natsched.admitter.standing)
class queue full (for this tenant: see      reject     queue_full (with retry_after)
_queue_full)
estimated wait beyond queue_timeout_s or    reject     quota_exhausted (with retry_after)
the deadline (once the release rate is
measured)
class has a TTFT SLO and the estimated      degrade    slo
wait is beyond its share of it
otherwise                                   queue      - (with est_wait)
==========================================  =========  ======================================

**TTFT SLOs** (``slo_ttft_s``, per class; off unless configured). A request's time to first token
is its wait here plus its wait and prefill on a worker. Under overload a first-come queue makes
*every* request late: each waits behind the backlog, and capacity is spent on answers that miss
the SLO anyway, so goodput (answers within the SLO per second) collapses and stays down while the
backlog drains. With an SLO, a request that has waited (or is estimated to wait) more than
``slo_wait_share`` of its SLO — the rest is left for the worker's queue and prefill — is not
admitted late but degraded: it goes to the offline path, which runs it when the cluster has room
(nothing is lost; it is completed later), and the capacity goes to requests that can still make
their SLO. In the queue this is checked before anything is admitted, oldest first.

:meth:`AdmitterCore.plan_dequeue` first rejects queued requests older than ``queue_timeout_s``
(``queue_timeout``), older than the target while their lane's queue stands (``overloaded``:
:mod:`natsched.admitter.standing`), past their deadline (``deadline_exceeded``) or that a quota change made
impossible (``unknown_tenant`` / ``too_large`` / ``tenant_cap`` / ``model_limit``), then allows
queued requests in order until the best one left does not fit. The order among queued requests
(and between them and an arrival) is :mod:`natsched.admitter.planner`'s: tenant first, but class
first once used + queued passes the degrade watermark (online of any tenant before batch).

**Per-model capacity** (:meth:`AdmitterCore.set_model_totals`, fed by
:class:`natsched.admitter.dynamic.ModelTotals`): a model's admitted runtime tokens stay within
what the workers serving *that* model can hold (times its measured factor), besides the cluster
total and any configured ``model.<m>`` limit. It is a wait, never a rejection (a measured bound
moves): a request past it queues, and while its model holds nothing it may pass a bound smaller
than itself (the engines queue it; the bound must not starve a model). The queue keeps a lane
per model, so queued requests of a full model do not hide other models' requests behind them.

**Class limits and loans** (:mod:`natsched.admitter.classes`): ``class.<c>.limit`` caps what a
class holds cluster-wide; a class in ``lend_to`` borrows the lower classes' room (idle room any
time, up to ``lend_share`` of their limit in a surge) and every release of it repays its loans
first. Each decision's ``budget`` names its class, the class limit, what the class holds and has
borrowed or lent, and ``loan`` — what this admission borrowed (the audit shows it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from natsched.admitter.classes import ClassBook, Loan
from natsched.admitter.errors import SettingsError
from natsched.admitter.estimator import OutputEstimator, ReleaseRate
from natsched.admitter.planner import Planner, never_fits
from natsched.admitter.queue import AdmissionQueue
from natsched.admitter.quotas import Quotas
from natsched.admitter.standing import StandingQueues
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.wire.blocks import estimate_prompt_tokens
from natsched.wire.pools import PoolMap
from natsched.wire.schema import Completion, CompletionStatus, Request, RequestId

log = logging.getLogger(__name__)

ALLOW, QUEUE, REJECT, DEGRADE = "allow", "queue", "reject", "degrade"


def _default_class_rank() -> dict[str, int]:
    return {S.ONLINE: 0, S.BATCH: 1}


@dataclass
class AdmissionSettings:
    max_prompt_tokens: int = 131_072  # longer prompts are rejected as invalid before any quota
    max_output_tokens: int = 32_768
    default_total: int = 400_000  # cluster runtime-token total until the quotas bucket says otherwise
    retry_after_s: float = 1.0  # the least retry_after given with quota rejections
    classes: tuple[str, ...] = S.CLASSES
    long_threshold_tokens: int = 8192  # a request costing at least this is "long"
    reserve_long_share: float = 0.2  # top slice of the total kept for long requests while any waits
    aging_s: float = 10.0  # queued longer than this: outranks arrivals of any class or size
    degrade_watermark: float = 0.8  # batch/degradable work degrades when usage+cost would pass this share
    degrade_classes: tuple[str, ...] = (S.BATCH,)  # besides requests flagged degradable
    calibrated_output: bool = False  # reserve the learned output length instead of max_tokens
    ewma_alpha: float = 0.2  # weight of the newest completion in the output-length EWMA
    ewma_min_samples: int = 3  # completions per (tenant, model) before the estimate is used
    calibrated_margin: float = 0.1  # reserve estimate × (1 + margin) (never above max_tokens)
    queue_timeout_s: float = 30.0  # a queued request older than this is rejected (queue_timeout)
    early_reject: bool = True  # reject at once (quota_exhausted) when the estimated wait is beyond the timeout
    rate_window_s: float = 10.0  # window of the release-rate estimate behind est_wait
    fallback_hold_s: float = 10.0  # until a rate is measured: the total turns over once per this
    scan_limit: int = 16  # entries a plan looks past (capped tenant, limited model) in one lane
    slo_ttft_s: dict[str, float] = field(default_factory=dict)  # per class: the promised TTFT (empty: off)
    slo_wait_share: float = 0.5  # of the SLO a request may wait here; the rest is the worker's
    class_rank: dict[str, int] = field(default_factory=_default_class_rank)  # lower is served first
    lend_to: tuple[str, ...] = (S.ONLINE,)  # classes that may borrow lower classes' limit room (classes.py)
    lend_share: float = 0.5  # in a surge, at most this share of a lender's limit on loan while it has demand
    standing_shed: bool = True  # shed a (model, class) queue that stands (natsched.admitter.standing)
    standing_target_s: float = 1.0  # ... a queue whose oldest waited longer than this ...
    standing_interval_s: float = 5.0  # ... for this long stands
    adaptive_lifo: bool = True  # a shed class's forming (model, class) queue goes newest first (standing.py)
    hold_saturated: bool = True  # hold a model's requests while all its engines have some waiting (engines.py)

    def __post_init__(self) -> None:
        for cls, slo in self.slo_ttft_s.items():
            if not isinstance(slo, (int, float)) or not slo > 0:
                raise SettingsError(f"slo_ttft_s[{cls!r}] must be seconds > 0, got {slo!r}")
        for name in ("reserve_long_share", "degrade_watermark", "ewma_alpha", "slo_wait_share", "lend_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise SettingsError(f"{name} must be between 0 and 1, got {value}")
        if self.reserve_long_share >= 1.0:
            raise SettingsError("reserve_long_share must be below 1 (short requests need some budget)")
        for name in ("aging_s", "queue_timeout_s", "calibrated_margin", "retry_after_s", "standing_target_s"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("long_threshold_tokens", "rate_window_s", "fallback_hold_s", "scan_limit", "max_prompt_tokens",
                     "standing_interval_s",
                     "max_output_tokens", "default_total", "ewma_min_samples"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("degrade_classes", "lend_to"):
            unknown = sorted(set(getattr(self, name)) - set(self.classes))
            if unknown:
                raise SettingsError(f"{name} names unknown classes {unknown}; known: {', '.join(self.classes)}")


@dataclass
class AdmissionDecision:
    decision: str
    runtime_tokens: int
    reason: str | None = None
    message: str | None = None
    retry_after: float | None = None
    budget: dict = field(default_factory=dict)
    est_wait: float | None = None  # queue: seconds the producer should expect to wait
    loan: Loan = field(default_factory=dict)  # allow: runtime tokens borrowed per lender class


def runtime_tokens(request: Request) -> int:
    """Prefill still owed (the whole prompt: the admitter cannot know the cache) + KV held for
    ``max_tokens`` of output: what a request costs to a pricer with no estimate of its own (the
    offline runner). A producer's ``expected_output_tokens`` cannot lower it (it once did: a
    declared 1 with ``max_tokens`` 8000 put 10 requests under a cap that fits 2); see
    :meth:`AdmitterCore.cost`."""
    prompt = estimate_prompt_tokens(request)
    return prompt + prompt + max(0, request.max_tokens)


def validate(request: Request, settings: AdmissionSettings, subject_class: str | None = None,
             subject_tenant: str | None = None) -> tuple[str, str] | None:
    """(reason, message) when the request is unusable, before any quota is taken."""
    if request.cls not in settings.classes:
        return "invalid_class", f"unknown class {request.cls!r}; known: {', '.join(settings.classes)}"
    if subject_class is not None and (subject_class, subject_tenant) != (request.cls, request.tenant):
        return "subject_mismatch", (f"published on class {subject_class!r} tenant {subject_tenant!r} but the body "
                                    f"says {request.cls!r} / {request.tenant!r}")
    if request.max_tokens <= 0:
        return "invalid_max_tokens", f"max_tokens must be > 0, got {request.max_tokens}"
    if request.max_tokens > settings.max_output_tokens:
        return "invalid_max_tokens", f"max_tokens {request.max_tokens} exceeds the limit {settings.max_output_tokens}"
    if request.expected_output_tokens is not None and request.expected_output_tokens < 0:
        return "invalid", "expected_output_tokens must be >= 0"
    prompt = estimate_prompt_tokens(request)
    if prompt > settings.max_prompt_tokens:
        return "prompt_too_long", f"prompt of ~{prompt} tokens exceeds the limit {settings.max_prompt_tokens}"
    if request.prompt_token_ids is not None and any(t < 0 for t in request.prompt_token_ids):
        return "invalid", "prompt_token_ids must be non-negative"
    if request.deadline is not None and not math.isfinite(request.deadline):
        return "invalid", "deadline must be a finite time"
    return None


class AdmitterCore:
    """Quota accounting, the queue and the four decisions; see the module docstring."""

    def __init__(self, settings: AdmissionSettings | None = None, quotas: Quotas | None = None) -> None:
        self.settings = s = settings or AdmissionSettings()
        quotas = quotas if quotas is not None else Quotas(total=s.default_total)
        quotas.validate()
        self.quotas = quotas
        self.total = quotas.ceiling()
        self.usage = Usage()
        self.queue = AdmissionQueue()
        self.outputs = OutputEstimator(s.ewma_alpha, s.ewma_min_samples)
        self.releases = ReleaseRate(s.rate_window_s)
        self.model_releases: dict[str, ReleaseRate] = {}  # per model: its own wait (standing queues)
        self.standing = StandingQueues(s.standing_target_s, s.standing_interval_s)
        self._clock = 0.0  # latest time seen: est_wait() has no `now` of its own
        self.served_models: frozenset[str] | None = None  # None: not known yet (no worker heard)
        self.pools = PoolMap()  # router pools (natsched.wire.pools); empty: one pool routes every model
        self.model_totals: dict[str, int | None] | None = None  # per-model capacity (set_model_totals)
        self.saturated: frozenset[str] = frozenset()  # models whose every engine has requests waiting

    # ------------------------------------------------------------------ configuration
    def set_quotas(self, quotas: Quotas) -> None:
        """Use new quotas (the total resets to their ceiling); invalid ones raise QuotaError and
        change nothing."""
        quotas.validate()
        self.quotas = quotas
        self.total = quotas.ceiling()

    def set_settings(self, settings: AdmissionSettings) -> None:
        """New settings live (``natsched.admitter.knobs``); the learned estimates are kept."""
        self.settings = settings
        self.outputs.alpha, self.outputs.min_samples = settings.ewma_alpha, settings.ewma_min_samples
        self.releases.window_s = settings.rate_window_s
        for rate in self.model_releases.values():
            rate.window_s = settings.rate_window_s
        self.standing.target_s, self.standing.interval_s = settings.standing_target_s, settings.standing_interval_s

    def set_total(self, total: int) -> None:
        """The dynamic total, never above the hard cap nor below zero."""
        total = max(0, int(total))
        cap = self.quotas.hard_cap
        self.total = total if cap is None else min(total, cap)

    def set_model_totals(self, totals: dict[str, int | None] | None) -> None:
        """Per-model capacity (:class:`natsched.admitter.dynamic.ModelTotals`): model -> the runtime
        tokens its own workers can take (None: no bound of its own). A model absent from a set map
        has no live worker: its requests wait at the door (``model_capacity``). None: no per-model
        bound at all (no worker heard yet, or the capacity-following total is off)."""
        self.model_totals = None if totals is None else dict(totals)

    def set_saturated(self, models: frozenset[str]) -> None:
        """The models every live worker of which has requests waiting in its engine
        (:class:`natsched.admitter.engines.EngineQueues`): their requests wait at the door, as at a
        full bound, until one of their engines may take one (``hold_saturated``)."""
        self.saturated = frozenset(models)

    def set_served_models(self, models: frozenset[str] | None) -> None:
        """The models live workers serve (from their heartbeats); None while none reported, so a
        replica that just started does not refuse what it simply has not heard of yet."""
        self.served_models = models or None

    def set_pools(self, pools: PoolMap) -> None:
        """The router pool map in force: a model none of its pools routes is refused (``no_pool``),
        not stored on a subject no router consumes."""
        self.pools = pools

    @property
    def used(self) -> int:
        return self.usage.used

    # ------------------------------------------------------------------ cost
    def own_output_estimate(self, request: Request) -> int:
        """What the admitter itself expects the request to generate: the output length learned
        from this (tenant, model)'s completions, with its margin (when calibrated and enough
        were seen), else ``max_tokens``."""
        if self.settings.calibrated_output:
            est = self.outputs.expected_output(request.tenant, request.model, request.max_tokens,
                                               self.settings.calibrated_margin)
            if est is not None:
                return est
        return request.max_tokens

    def expected_output(self, request: Request) -> int:
        """The output tokens a request is priced at: the admitter's own estimate, raised (never
        lowered) by the producer's ``expected_output_tokens``, and never above ``max_tokens``.

        The producer's number is a claim from the party that pays: it may ask for more room
        (a tenant that knows its request is long), never for less than the admitter would
        give it anyway. A request that generates past its price grows its reservation
        (the workers report progress: :meth:`natsched.admitter.service.AdmitterService.grow`)."""
        own = self.own_output_estimate(request)
        declared = request.expected_output_tokens or 0
        return max(own, min(declared, request.max_tokens))

    def cost(self, request: Request) -> int:
        prompt = estimate_prompt_tokens(request)
        return prompt + prompt + max(0, self.expected_output(request))

    def is_long(self, cost: int) -> bool:
        return cost >= self.settings.long_threshold_tokens

    # ------------------------------------------------------------------ arrivals
    def evaluate(self, request: Request, now: float, subject: str | None = None) -> AdmissionDecision:
        """Decide one arriving (or redelivered) request. No side effects."""
        self._clock = max(self._clock, now)
        parsed = S.parse_request_subject(subject) if subject else None
        problem = validate(request, self.settings, *(parsed or (None, None)))
        if problem:
            return self._reject(0, *problem, request=request)
        queued = self.queue.get(request.id)
        if queued is not None:  # redelivered while we hold it: same place, no second entry
            return self._decision(QUEUE, queued.cost, request, est_wait=self.est_wait(request))
        if self.served_models is not None and request.model not in self.served_models:
            return self._reject(0, "unknown_model", f"model {request.model!r} is not served; served: "
                                f"{', '.join(sorted(self.served_models))}", request=request)
        if self.pools.pool_of(request.model) is None:
            return self._reject(0, "no_pool", f"model {request.model!r} is routed by no router pool; pools: "
                                f"{self.pools.describe()}", request=request)
        cost = self.cost(request)
        never = never_fits(self.quotas, self.total, request.tenant, request.model, cost, request.cls,
                           self._class_book())
        if never:
            return self._reject(cost, *never, request=request)
        if request.deadline is not None and request.deadline <= now:
            return self._reject(cost, "deadline_exceeded", f"deadline {request.deadline:.3f} already passed",
                                request=request)
        degrade = self._degrade(request, cost)
        if degrade:
            return self._decision(DEGRADE, cost, request, reason=degrade)
        quota = self.quotas.tenant_quota(request.tenant)
        held = self.usage.tenant(request.tenant)
        if quota.cap is not None and held + cost > quota.cap:
            return self._reject(cost, "tenant_cap", f"tenant {request.tenant!r} holds {held} runtime tokens; "
                                f"+{cost} would pass its cap {quota.cap}", retry=True, request=request)
        loan = self._allow_loan(request, cost, quota, now)
        if loan is not None:
            return self._decision(ALLOW, cost, request, loan=loan)
        return self._queue_or_reject(request, cost, now)

    def _degrade(self, request: Request, cost: int) -> str | None:
        if request.cls == S.OFFLINE:
            return "offline"
        if request.cls in self.settings.degrade_classes or request.degradable:
            if self.usage.used + cost > self.settings.degrade_watermark * self.total:
                return "watermark"
        return None

    def _allow_loan(self, request: Request, cost: int, quota, now: float) -> Loan | None:
        """The loan an allow would borrow ({}: none), or None when the request may not go now."""
        plan = self._planner(now)
        if not plan.fits_total(cost):
            return None
        if plan.blocked(request.tenant, request.model, cost, self.is_long(cost), quota, request.cls):
            return None
        if not plan.headroom_ok(request.tenant, quota, cost):
            return None
        if not plan.arrival_outranks(request, plan.top()):
            return None
        if plan.contended(request.model):
            return None  # its model's queue goes first, by age (planner.py 7.; newest first: 8.)
        return plan.loan(request.cls, cost)

    def _queue_or_reject(self, request: Request, cost: int, now: float) -> AdmissionDecision:
        limit = self.quotas.queue_limit(request.cls)
        if limit <= 0:
            return self._reject(cost, "quota_exhausted", f"no runtime tokens free for class {request.cls!r} and it "
                                f"does not queue", retry=True, request=request)
        if self._overloaded(request, cost, now):
            return self._reject(cost, "overloaded", f"model {request.model!r} is overloaded: its {request.cls} queue has "
                                f"stood past {self.standing.target_s:g}s for {self.standing.interval_s:g}s and this "
                                f"request would wait longer", retry=True, request=request)
        wait = self.est_wait(request)
        retry = max(self.settings.retry_after_s, wait - self.settings.queue_timeout_s)
        if self._queue_full(request, limit):
            return self._reject(cost, "queue_full", f"the {request.cls} queue holds its limit of {limit} requests",
                                retry=True, retry_after=retry, request=request)
        if self.settings.early_reject and self.releases.rate(now) is not None:
            if wait > self.settings.queue_timeout_s:
                return self._reject(cost, "quota_exhausted", f"estimated wait {wait:.1f}s is beyond the queue timeout"
                                    f" {self.settings.queue_timeout_s:g}s", retry=True, retry_after=retry,
                                    request=request)
            if request.deadline is not None and now + wait > request.deadline:
                return self._reject(cost, "quota_exhausted", f"estimated wait {wait:.1f}s would pass the deadline",
                                    retry=True, request=request)
            if wait > self._slo_wait(request.cls):
                return self._decision(DEGRADE, cost, request, reason="slo")
        return self._decision(QUEUE, cost, request, est_wait=wait)

    def _sheds(self, cls: str) -> bool:
        """Whether ``cls``'s queue is shed when it stands: classes waiting for an answer with no TTFT
        SLO of their own (an SLO class degrades late work instead; batch and degradable work, and
        the offline path, are meant to wait)."""
        s = self.settings
        return (s.standing_shed and cls != S.OFFLINE and cls not in s.degrade_classes
                and cls not in s.slo_ttft_s)

    def _overloaded(self, request: Request, cost: int, now: float) -> bool:
        """An arrival that its lane's standing queue refuses: it would wait past the target."""
        if request.degradable or not self._sheds(request.cls):
            return False
        if not self.standing.standing((request.model, request.cls), now):
            return False
        return self.model_wait(request.model, cost, now) > self.standing.target_s

    def model_wait(self, model: str, cost: int, now: float) -> float:
        """Seconds until ``cost`` more tokens of ``model`` could start: what is queued for the model,
        beyond its free room (its own bound, within the total), over its own release rate (0 until
        one is measured)."""
        rate = self.model_releases.get(model)
        r = rate.rate(now) if rate is not None else None
        if not r:
            return 0.0
        free = self.total - self.usage.used
        bound = (self.model_totals or {}).get(model)
        if bound is not None:
            free = min(free, bound - self.usage.model(model))
        if model in self._held_models():
            free = 0
        need = self.queue.model_tokens(model) + cost - max(0, free)
        return need / r if need > 0 else 0.0

    def _slo_wait(self, cls: str) -> float:
        """Seconds a request of ``cls`` may wait here before its SLO is out of reach (inf: no SLO)."""
        slo = self.settings.slo_ttft_s.get(cls)
        return math.inf if slo is None else slo * self.settings.slo_wait_share

    def _queue_full(self, request: Request, limit: int) -> bool:
        """The class queue is full for this tenant. A full queue still takes a tenant holding less
        than its fair slice of it (limit × its share), so tenants that flood the shared queue
        cannot lock out one that is owed its floor; the queue stays under twice the limit."""
        depth = self.queue.depth(request.cls)
        if depth < limit:
            return False
        if depth >= 2 * limit:
            return True
        return self.queue.tenant_class_count(request.tenant, request.cls) >= limit * self._share(request.tenant)

    def apply(self, request: Request, decision: AdmissionDecision, now: float) -> None:
        """Make a decision real locally: ALLOW reserves, QUEUE enqueues (once), others do nothing."""
        self._clock = max(self._clock, now)
        if decision.decision == ALLOW:
            self.queue.remove(request.id)
            self.usage = self.usage.plus(request.tenant, request.model, decision.runtime_tokens,
                                         self.is_long(decision.runtime_tokens), request.cls, decision.loan)
        elif decision.decision == QUEUE:
            self.queue.add(request, decision.runtime_tokens, self.is_long(decision.runtime_tokens), now)
        elif decision.reason == "overloaded":
            self.standing.shed((request.model, request.cls), now)
        self._observe_standing(now)

    def _observe_standing(self, now: float) -> None:
        """Tell the standing-queue state each shed lane's oldest age (natsched.admitter.standing)."""
        if self.settings.standing_shed:
            self.standing.observe({lane: now - e.enqueued_at for lane, e in self.queue.oldest_per_lane().items()
                                   if self._sheds(lane[1]) and self._serving(lane[0], now)}, now)

    def _serving(self, model: str, now: float) -> bool:
        """The model's release rate is measured: it serves, so a queue that still stands is arrivals
        beyond what it serves (nothing completing is no measure: the queue timeout still holds)."""
        rate = self.model_releases.get(model)
        return rate is not None and bool(rate.rate(now))

    # ------------------------------------------------------------------ the queue
    def plan_dequeue(self, now: float) -> list[tuple[Request, AdmissionDecision]]:
        """Expired requests (REJECT) and those that should run now (ALLOW), in order. No side effects."""
        self._clock = max(self._clock, now)
        plan = self._planner(now)
        out = self._expired(plan, now)
        excluded: set[str] = set()
        while True:
            top = plan.top(excluded)
            if top is None:
                break
            entry = top[0]
            never = never_fits(self.quotas, self.total, entry.tenant, entry.model, entry.cost, entry.cls, plan.book)
            if never:
                plan.take(entry, admit=False)
                out.append((entry.request, self._reject(entry.cost, *never)))
                continue
            if not plan.fits_total(entry.cost):
                break  # no backfill past the top: the free budget accumulates for it
            if not plan.headroom_ok(entry.tenant, self.quotas.tenant_quota(entry.tenant), entry.cost):
                excluded.add(entry.tenant)  # other tenants' floors come first
                continue
            loan = plan.loan(entry.cls, entry.cost) or {}  # (eligible: it fits its class)
            plan.take(entry, admit=True, loan=loan)
            out.append((entry.request, AdmissionDecision(ALLOW, entry.cost, loan=loan)))
        for req, dec in out:
            dec.budget = self.budget(req.tenant, req.cls, dec.loan)  # before commit: what the plan saw
        return out

    def _expired(self, plan: Planner, now: float) -> list[tuple[Request, AdmissionDecision]]:
        out = self._past_slo(plan, now) + self._standing_sheds(plan, now)
        timeout = self.settings.queue_timeout_s
        for entry in self.queue.oldest():
            if now - entry.enqueued_at <= timeout:
                break
            if entry.id in plan.taken:
                continue
            plan.take(entry, admit=False)
            out.append((entry.request, self._reject(entry.cost, "queue_timeout",
                                                    f"queued {now - entry.enqueued_at:.1f}s, longer than {timeout:g}s",
                                                    retry=True)))
        for entry in self.queue.deadlines_due(now):
            if entry.id not in plan.taken:
                plan.take(entry, admit=False)
                out.append((entry.request, self._reject(entry.cost, "deadline_exceeded",
                                                        "deadline passed while queued")))
        return out

    def _standing_sheds(self, plan: Planner, now: float) -> list[tuple[Request, AdmissionDecision]]:
        """Queued requests of a standing lane that waited past the target: REJECT ``overloaded``."""
        out = []
        target = self.standing.target_s
        for model, cls in self.standing.lanes(now):
            for entry in self.queue.oldest_of(model, cls):
                if now - entry.enqueued_at <= target:
                    break
                if entry.id in plan.taken or entry.request.degradable:
                    continue
                plan.take(entry, admit=False)
                out.append((entry.request, self._reject(
                    entry.cost, "overloaded", f"queued {now - entry.enqueued_at:.1f}s while model {model!r}'s {cls} "
                    f"queue stands (past {target:g}s for {self.standing.interval_s:g}s)", retry=True)))
        return out

    def _past_slo(self, plan: Planner, now: float) -> list[tuple[Request, AdmissionDecision]]:
        """Queued requests that waited past their class's share of its SLO: DEGRADE (module docstring)."""
        if not self.settings.slo_ttft_s:
            return []
        shortest = min(self._slo_wait(c) for c in self.settings.slo_ttft_s)
        out = []
        for entry in self.queue.oldest():
            age = now - entry.enqueued_at
            if age <= shortest:
                break
            if age > self._slo_wait(entry.cls):
                plan.take(entry, admit=False)
                out.append((entry.request, AdmissionDecision(DEGRADE, entry.cost, "slo")))
        return out

    def commit_dequeue(self, picks: list[tuple[Request, AdmissionDecision]], now: float) -> None:
        """Remove the picked requests from the queue; ALLOWs add to the usage."""
        self._clock = max(self._clock, now)
        for request, decision in picks:
            if self.queue.remove(request.id) is None:
                continue  # forgotten meanwhile
            if decision.decision == ALLOW:
                self.usage = self.usage.plus(request.tenant, request.model, decision.runtime_tokens,
                                             self.is_long(decision.runtime_tokens), request.cls, decision.loan)
            elif decision.reason == "overloaded":
                self.standing.shed((request.model, request.cls), now)
        self._observe_standing(now)

    def forget(self, request_id: RequestId) -> bool:
        """Drop a queued request (the service lost its message); True when it was queued."""
        gone = self.queue.remove(request_id) is not None
        self._observe_standing(self._clock)
        return gone

    # ------------------------------------------------------------------ completions
    def release(self, completion: Completion, now: float) -> int:
        """Free the completion's reservation (in its class: a release repays the class's loans
        first) and learn its output length; returns tokens freed."""
        self._clock = max(self._clock, now)
        tokens = max(0, completion.runtime_tokens)
        self.usage = self.usage.minus(completion.tenant, completion.model, tokens, self.is_long(tokens),
                                      completion.cls or None)
        self.releases.add(now, tokens)
        rate = self.model_releases.get(completion.model)
        if rate is None:
            rate = self.model_releases[completion.model] = ReleaseRate(self.settings.rate_window_s)
        rate.add(now, tokens)
        if completion.status == CompletionStatus.OK:
            self.outputs.observe(completion.tenant, completion.model, completion.output_tokens)
        return tokens

    # ------------------------------------------------------------------ views
    def queued(self) -> int:
        return len(self.queue)

    def queue_depths(self) -> dict[str, int]:
        return self.queue.depths()

    def budget(self, tenant: str | None = None, cls: str | None = None, loan: Loan | None = None) -> dict:
        """What a decision saw, for its audit record: the cluster, the tenant and (when any class
        has a limit) the request's class — its limit, what it holds, borrowed and lent, and the
        ``loan`` this admission takes."""
        out = {"used": self.usage.used, "total": self.total, "queued": len(self.queue)}
        if tenant is not None:
            quota = self.quotas.tenant_quota(tenant)
            out["tenant_used"] = self.usage.tenant(tenant)
            if quota is not None:
                out["tenant_floor"] = int(quota.floor * self.total)
        book = self._class_book() if cls is not None else None
        if book is not None:
            out.update(book.view(cls))
        if loan:
            out["loan"] = dict(loan)
        return out

    def pressure(self, usage: Usage | None = None) -> bool:
        """Used plus queued runtime tokens past the degrade watermark: class outranks tenant
        (:mod:`natsched.admitter.planner`) and lenders lend their surge share."""
        used = (self.usage if usage is None else usage).used
        return bool(self.queue.tokens) and used + self.queue.tokens >= self.settings.degrade_watermark * self.total

    def _class_book(self, usage: Usage | None = None, pressure: bool = False) -> ClassBook | None:
        """The class limits and the usage's class counts and loans (None: no class has a limit)."""
        if not self.quotas.class_limits:
            return None
        u = self.usage if usage is None else usage
        s = self.settings
        return ClassBook(self.quotas.class_limits, dict(u.classes), dict(u.loans), self.queue.class_tokens(),
                         s.lend_to, s.lend_share, s.class_rank, pressure)

    def est_wait(self, request: Request) -> float:
        """Seconds until the request can expect to start: the tokens ahead of it in its tenant's
        queue, beyond what is free now, over the tenant's share of the measured release rate."""
        entry = self.queue.get(request.id)
        cost = entry.cost if entry is not None else self.cost(request)
        ahead = self.queue.tenant_tokens(request.tenant) - (entry.cost if entry is not None else 0) + cost
        need = ahead - max(0, self.total - self.usage.used)
        if need <= 0:
            return 0.0
        rate = self.releases.rate(self._clock)
        if rate is None or rate <= 0:
            rate = max(1.0, self.total / self.settings.fallback_hold_s)
        return need / (rate * self._share(request.tenant))

    def _share(self, tenant: str) -> float:
        """The tenant's expected share of freed tokens among the backlogged tenants (and itself)."""
        names = set(self.queue.tenants()) | {tenant}
        quotas = {n: self.quotas.tenant_quota(n) for n in names}
        mine = quotas.get(tenant)
        if mine is None:
            return 1.0
        floors = sum(q.floor for q in quotas.values() if q is not None)
        weights = sum(q.weight for q in quotas.values() if q is not None)
        share = mine.floor + (max(0.0, 1.0 - floors) * mine.weight / weights if weights > 0 else 0.0)
        return min(1.0, max(share, 0.01))

    # ------------------------------------------------------------------ helpers
    def grantable(self, usage: Usage, tenant: str, model: str, tokens: int, now: float) -> bool:
        """Whether ``usage`` leaves room for a credit block of ``tokens`` for (tenant, model)
        (``natsched.admitter.credit``): as for a short request of that size — the tenant known, within
        the total, its cap and the model's limit, not into the long reserve while a long request
        waits, not into other backlogged tenants' floors. No side effects."""
        quota = self.quotas.tenant_quota(tenant)
        if quota is None or never_fits(self.quotas, self.total, tenant, model, tokens):
            return False
        if self.quotas.class_limits:  # blocks are in no class: every allow must be counted in its own
            return False
        plan = self._planner(now, usage)
        return (plan.fits_total(tokens) and plan.blocked(tenant, model, tokens, False, quota) is None
                and plan.headroom_ok(tenant, quota, tokens))

    def _planner(self, now: float, usage: Usage | None = None) -> Planner:
        s = self.settings
        usage = self.usage if usage is None else usage
        pressure = self.pressure(usage)
        return Planner(self.queue, self.quotas, self.total, usage, now,
                       aging_s=s.aging_s, reserve_long_share=s.reserve_long_share, class_rank=s.class_rank,
                       scan_limit=s.scan_limit, book=self._class_book(usage, pressure), pressure=pressure,
                       model_totals=self.model_totals, saturated=self._held_models(),
                       lifo=self._lifo_lanes(now))

    def _lifo_lanes(self, now: float) -> frozenset[tuple[str, str]]:
        """The (model, class) lanes the planner serves newest first (natsched.admitter.standing):
        forming queues of the classes a standing queue sheds."""
        s = self.settings
        if not (s.adaptive_lifo and s.standing_shed):
            return frozenset()
        return frozenset(lane for lane in self.standing.forming(now) if self._sheds(lane[1]))

    def _held_models(self) -> frozenset[str]:
        return self.saturated if self.settings.hold_saturated else frozenset()

    def _decision(self, kind: str, cost: int, request: Request, reason: str | None = None,
                  est_wait: float | None = None, loan: Loan | None = None) -> AdmissionDecision:
        return AdmissionDecision(kind, cost, reason, budget=self.budget(request.tenant, request.cls, loan),
                                 est_wait=est_wait, loan=dict(loan or {}))

    def _reject(self, cost: int, reason: str, message: str, retry: bool = False, retry_after: float | None = None,
                request: Request | None = None) -> AdmissionDecision:
        if retry and retry_after is None:
            retry_after = self.settings.retry_after_s
        budget = self.budget(request.tenant, request.cls) if request is not None else {}
        return AdmissionDecision(REJECT, cost, reason, message, retry_after if retry else None, budget)
