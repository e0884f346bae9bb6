"""RouterCore: the router's whole state and decision, without I/O.

The service feeds it heartbeats, cache events and completions and asks it to route; the
simulator does the same in virtual time. It owns the shared pieces and wires them together:

- :class:`~natsched.router.registry.WorkerRegistry` — worker state machine and load view (+ the ledger of
  our assignments);
- :class:`~natsched.router.index.PrefixIndex` — which worker holds which prefix (events + our decisions);
- :class:`~natsched.router.feedback.ClaimTracker` — are a worker's cache claims coming true;
- :class:`~natsched.router.learned.CostBook` — each worker's cost model, learned from its completions
  against what was predicted when it was routed;
- :class:`~natsched.router.health.LatencyHealth` — a worker much slower than its own prediction
  goes half-open;
- the live policy and an optional canary policy, both built on the same :class:`PolicyDeps`.

Time (``now``) is the caller's clock in seconds (wall time in the service, virtual time in the
simulator) and must be >= 0 and non-decreasing.
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from natsched.wire.schema import CacheEvent, Completion, CompletionStatus, Heartbeat, RequestId, WorkerId
from natsched.router.costmodel import CostModel
from natsched.router.deps import PolicyDeps, build_params, cached_tokens
from natsched.router.errors import ConfigError
from natsched.router.feedback import ClaimTracker, FeedbackSettings
from natsched.router.health import HealthSettings, LatencyHealth, completion_ratio
from natsched.router.index import IndexSettings, PrefixIndex
from natsched.router.learned import CostBook, LearnSettings, Sample
from natsched.router.policies import make_policy
from natsched.router.policy import RouteDecision, RouteRequest, RoutingPolicy, WorkerView
from natsched.router.progress import ProgressWatch
from natsched.router.registry import Assignment, RegistrySettings, WorkerRegistry, WorkerState

log = logging.getLogger(__name__)


@dataclass
class RouterSettings:
    policy: str = "natsched"
    block_size: int = 32  # tokens per block of RouteRequest.hashes (the "block_tokens")
    heartbeat_timeout_s: float = 15.0  # a worker silent for longer is excluded
    backoff_max_prompt_tokens: int = 1024  # a BACKOFF worker takes only prompts up to this
    # when fewer than this share of the workers that could take a request may (the others
    # half-open or in backoff), all of them may: Envoy's panic threshold and its default (50 %);
    # 0: only when none may (what the simulated peers keep: natsched.sim.contenders)
    panic_threshold: float = 0.5
    pending_grace_s: float = 2.0  # see natsched.router.registry
    forget_after_s: float = 600.0
    ledger_ttl_s: float = 3600.0
    policy_weights: dict[str, dict[str, Any]] = field(default_factory=dict)  # per policy name
    canary_policy: str | None = None
    canary_share: float = 0.0  # share of requests (by request-id hash) the canary decides
    index: IndexSettings = field(default_factory=IndexSettings)
    feedback: FeedbackSettings = field(default_factory=FeedbackSettings)
    cost: CostModel = field(default_factory=CostModel)  # the fixed model: priors, capacities
    learn: LearnSettings = field(default_factory=LearnSettings)  # per-worker learned cost models
    health: HealthSettings = field(default_factory=HealthSettings)  # latency-tied half-open state
    keep_predictions: int = 0  # per worker, (observed, predicted, fixed-model) TTFTs kept (benchmarks)

    def __post_init__(self) -> None:
        t = self.panic_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ConfigError(f"router: panic_threshold must be a share in [0, 1], got {t!r}")

    def registry_settings(self) -> RegistrySettings:
        return RegistrySettings(
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            backoff_max_prompt_tokens=self.backoff_max_prompt_tokens,
            pending_grace_s=self.pending_grace_s,
            forget_after_s=self.forget_after_s,
            ledger_ttl_s=self.ledger_ttl_s,
        )


def prefer_loaded(candidates: list[WorkerView], model: str) -> list[WorkerView]:
    """For an adapter's request: the healthy candidates that have it in their batch now and room
    left (load below capacity), when there are any; else every candidate.

    A vLLM server holds ``--max-loras`` adapters on the device at once; one that is not there
    is loaded first (from CPU memory or disk), which delays the request and evicts another
    adapter. The Gateway API inference extension (the scheduler llm-d builds on) filters for
    LoRA affinity from the same ``vllm:lora_requests_info`` gauge. Restricting the policy's choice, rather than scoring
    it, keeps every policy's own logic as documented; the capacity test keeps a busy
    worker from taking all of an adapter's traffic.
    """
    loaded = [w for w in candidates if model in w.active and w.state == "healthy"
              and (not w.capacity_tokens or w.load_tokens < w.capacity_tokens)]
    return loaded or candidates


def in_canary(request_id: str, share: float) -> bool:
    """Deterministic: the same request id always lands on the same side (retries, replicas)."""
    return zlib.crc32(request_id.encode()) % 10_000 < share * 10_000


class RouterCore:
    def __init__(self, settings: RouterSettings | None = None, policy: RoutingPolicy | None = None) -> None:
        s = self.settings = settings or RouterSettings()
        self.index = PrefixIndex(s.index)
        self.costs = CostBook(s.cost, s.learn)
        self.health = LatencyHealth(s.health)
        self.progress = ProgressWatch()
        self.registry = WorkerRegistry(s.registry_settings(), s.cost, self.costs, self.health)
        self.claims = ClaimTracker(s.feedback)
        self.deps = PolicyDeps(self.index, s.cost, s.block_size, self.costs)
        # worker -> (its completion count, observed TTFT, predicted, fixed model's), see keep_predictions
        self.predictions: dict[WorkerId, deque] = {}
        self._completed: dict[WorkerId, int] = {}
        self.workers: dict[WorkerId, WorkerView] = self.registry.views
        self.policy: RoutingPolicy = policy or make_policy(s.policy, self.deps, s.policy_weights.get(s.policy))
        self.canary: RoutingPolicy | None = None
        self.canary_share = 0.0
        if s.canary_policy:
            self.set_canary(s.canary_policy, s.canary_share, s.policy_weights.get(s.canary_policy))
        self._snapshot_requests: dict[WorkerId, None] = {}

    # ------------------------------------------------------------------ inputs

    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        w = hb.worker
        joined = w not in self.registry.views
        if joined:  # pooled with the workers of the same model and deployment (natsched.router.learned)
            self.costs.set_group(w, f"{hb.model}/{hb.deployment or ''}")
        if self.registry.on_heartbeat(hb, now):
            self.index.reset_worker(w, now)
            self.claims.reset(w)
        if joined and hb.kv_seq and not self.index.has_seen(w):
            # this router started after the worker's cache events did: ask for what it holds now,
            # before the first delta after the load began shows the gap. Trust is left as it was:
            # a gap still distrusts and asks at once, and whichever snapshot comes settles it
            self._snapshot_requests[w] = None
        self._check_fresh(w)
        self._judge_progress(hb, now)

    def _learned(self, w: WorkerId) -> bool:
        """Whether ``w``'s estimate has learned from ``min_learned`` samples: its own, or its group's
        pooled fit once it has shown it runs like the group
        (:meth:`natsched.router.learned.CostBook.yardstick_samples`). Its own count is checked
        first: it is one sum, and the group's a sum over every member, on the routing path."""
        hs = self.health.settings
        if self.costs.samples(w) >= hs.min_learned:
            return True
        return self.costs.yardstick_samples(w, hs.min_own, hs.min_group) >= hs.min_learned

    def _judge_progress(self, hb: Heartbeat, now: float) -> None:
        """The heartbeat's decode progress against the worker's learned model
        (:mod:`natsched.router.progress`): evidence of a slowdown seconds after it begins."""
        w = hb.worker
        ratio = self.progress.on_heartbeat(self.costs.of(w), w, hb.ts, hb.decode_tokens, hb.decode_s, hb.running,
                                           hb.kv_used_blocks * hb.block_size, hb.queued_prefill_tokens,
                                           self.registry.prefill_routed(w))
        if ratio is None or not self.costs.settings.enabled or not self._learned(w):
            return  # a prior that has not met the worker is no yardstick (as for completions)
        ratio = self.progress.relative(w, ratio, now, self.costs.group_members(w))
        self.health.observe_progress(w, ratio, now)
        self.costs.freeze(w, self.health.learning_frozen(w, now))

    def on_cache_event(self, ev: CacheEvent, now: float) -> bool:
        """Apply a cache delta; False when a sequence gap means a snapshot is needed."""
        ok = self.index.apply(ev, now)
        if ev.kind == "snapshot" and ev.tier != "host":
            self.claims.reset(ev.worker)
            self._snapshot_requests.pop(ev.worker, None)
        if ev.worker in self.registry.views:
            self._check_fresh(ev.worker)
        return ok

    def on_completion(self, c: Completion, now: float) -> bool:
        """Release the request's load and score the cache claim it confirms or refutes; True when
        the worker's claims failed (it is demoted: counted as a claim failure)."""
        a = self.registry.on_completion(c.request_id, c.worker, c.runtime_tokens)
        if a is None or c.status != CompletionStatus.OK or (c.worker is not None and c.worker != a.worker):
            return False  # not routed by us (another replica judges it), failed, or re-routed
        self._learn(a, c, now)
        if not self._claim_failed(a, c.cached_tokens):
            return False
        w = a.worker
        reason = f"claims failing: accuracy {self.claims.accuracy(w):.2f}"
        if self.index.distrust(w, reason) and self.index.needs_snapshot(w, now):
            self._snapshot_requests[w] = None
        return True

    def _learn(self, a: Assignment, c: Completion, now: float) -> None:
        """Teach the worker's cost model what this completion took, then judge its health.

        A report the model refuses (negative or non-finite times, cached > prompt, impossible
        rates) is counted in ``costs.refused`` and judged by nobody.
        """
        w = a.worker
        prompt = c.prompt_tokens or a.prompt_tokens
        cached = c.cached_tokens
        if cached > prompt:
            self.costs.refused["bad_counts"] += 1
            return
        self.costs.freeze(w, self.health.learning_frozen(w, now))
        sample = Sample(prompt - cached, cached, c.ttft, c.tpot, a.pred_wait_s, a.batch, a.batch_kv,
                        min(a.host_tokens, cached))
        if self.costs.observe(w, sample, now) is not None:
            return
        n = self._completed[w] = self._completed.get(w, 0) + 1
        keep = self.settings.keep_predictions
        if keep and c.ttft is not None:
            log_ = self.predictions.get(w)
            if log_ is None:
                log_ = self.predictions[w] = deque(maxlen=keep)
            log_.append((n, c.ttft, a.pred_ttft_s, a.fixed_ttft_s))
        ratio = completion_ratio(c.ttft, a.pred_ttft_s, c.tpot, a.pred_tpot_s, c.output_tokens,
                                 self.registry.prefill_since(w, a.prefill_mark), a.kv_queued)
        # judged against a *learned* prediction only: the fixed model is no yardstick for a worker
        # of another GPU or model, nor is a prior that has not met the worker yet — and that at
        # routing time: a long request routed on the prior and completed after the model learned
        # was judged against the prior (an L4 decoding at 14x the H100 constants' step: half-open)
        if ratio is not None and a.pred_learned and self.costs.settings.enabled and self._learned(w):
            self.health.observe(w, ratio, now)
            self.costs.freeze(w, self.health.learning_frozen(w, now))

    def _claim_failed(self, a: Assignment, actual: int) -> bool:
        """Score one completion against the worker's own claim; True when it must be demoted.

        Only ``claimed_cached`` is judged: what the worker's cache events said it held when we
        routed. Our own approximate claims are not the worker's word — a request sent while an
        earlier one with the same prefix is still queued or prefilling finds less cached than
        predicted through no fault of the worker, and demoting it for that (then ignoring its
        exact reports) made every busy worker untrusted. A shortfall the worker *reported* — it
        said it evicted the first missing block after we routed — is cache churn, honestly
        reported: not judged either.
        """
        claimed = a.claimed_cached
        if claimed <= 0:
            return False
        if actual < claimed:
            missed = actual // self.deps.block_tokens
            if missed < len(a.hashes) and self.index.removed_since(a.worker, a.hashes[missed], a.mark):
                return False
        return self.claims.observe(a.worker, claimed, actual)

    def _check_fresh(self, w: WorkerId) -> None:
        if self.registry.awaiting_fresh(w) and self.index.is_fresh(w, self.registry.views[w].kv_seq):
            self.registry.mark_fresh(w)

    # ------------------------------------------------------------------ routing

    def candidates(self, req: RouteRequest, now: float) -> list[WorkerView]:
        """Workers that may take ``req`` now (state, heartbeat age, model, size for BACKOFF), and of
        them, for a LoRA adapter's request, those with the adapter loaded (:func:`prefer_loaded`).

        Panic (Envoy's panic threshold, "used to avoid a situation in which host failures cascade
        throughout the cluster as load increases", default 50 %): a half-open worker is slow and a
        backoff worker full, not gone. When none, or fewer than ``panic_threshold``, of the workers
        that could take the request (its model, heartbeat fresh, not avoided) may, all of them may
        and the policy's costs choose. Excluding them concentrated the load on the few left until
        those were full too: elastic (draw s12) after its kill, four of seven L4s in backoff (KV >= 95 %)
        and one half-open, every long prompt went to the other two, which queued 10-14 s (phase TTFT
        p99 12.4 s). Holding a request back when none may take it only moves the queue from the
        engine (first come, first served, started the moment KV frees) to the router's retry loop:
        hetero's second model on 2 L4s, both in backoff, waited 10 s, was refused and retried."""
        eligible = self.registry.eligible
        could = [w for w in self.workers.values() if eligible(w, req, now, panic=True)]
        may = [w for w in could if eligible(w, req, now)]
        if not may or len(may) < self.settings.panic_threshold * len(could):
            may = could
        return prefer_loaded(may, req.model)

    def route(self, req: RouteRequest, now: float) -> RouteDecision:
        """Ask the live (or canary) policy, then book the assignment: pending load, ledger entry
        (with the index's cache prediction, for feedback) and an approximate index claim.

        A policy's ``cache_belief`` says where its ``expected_cached_tokens`` comes from:
        ``"index"`` (the shared index, reused as is), ``"own"`` (its private model; the index is
        asked separately for feedback) or absent (cache-blind: filled from the index).
        """
        policy = self.canary if self.canary is not None and in_canary(req.id, self.canary_share) else self.policy
        decision = policy.route(req, self.candidates(req, now), now)
        w = decision.worker
        if w is None:
            return decision
        prompt = req.prompt_tokens
        belief = getattr(policy, "cache_belief", None)
        if belief == "index":  # the policy already looked it up in the index
            expected = decision.expected_cached_tokens
        else:
            expected = cached_tokens(self.index.match_one(req.hashes, w, now), self.deps.block_tokens, prompt)
            if belief is None:  # cache-blind policy: still audit what the index predicted
                decision.expected_cached_tokens = expected
        claimed = self._claimed(req, w, now) if expected > 0 else 0  # precise <= any claim
        host = self._host_tokens(req, w, now)  # before our own claim covers the chain
        self.index.record_route(req.hashes, w, now)
        kv = req.runtime_tokens or prompt + req.expected_output
        uncached = prompt - expected
        a = Assignment(w, kv, uncached, expected, now, claimed_cached=claimed, hashes=req.hashes,
                       mark=self.index.mark(), prompt_tokens=prompt, host_tokens=host)
        self._predict(a, self.workers[w], now, req.expected_output)
        self.registry.on_assigned(req.id, a)
        self._audit(decision, w, now)
        return decision

    def _host_tokens(self, req: RouteRequest, w: WorkerId, now: float) -> int:
        """Prompt tokens ``w``'s host tier holds right after its GPU match (loaded, not recomputed)."""
        if not self.index.has_host:
            return 0
        bt, prompt = self.deps.block_tokens, req.prompt_tokens
        start = self.index.match_one(req.hashes, w, now)
        more = self.index.match_host(req.hashes, w, start)
        return cached_tokens(start + more, bt, prompt) - cached_tokens(start, bt, prompt) if more else 0

    def _predict(self, a: Assignment, view: WorkerView, now: float, output: int = 0) -> None:
        """What the worker's own model expects of this request (judged at its completion)."""
        wc = self.costs.of(a.worker)
        base = self.settings.cost
        uncached, cached = a.prefill_tokens, a.expected_cached
        a.prefill_s = wc.prefill_ctx_s(uncached, cached)
        a.pred_wait_s = wc.wait_s(view, now)
        host = a.host_tokens if a.host_tokens < cached else cached
        a.pred_ttft_s = a.pred_wait_s + wc.first_token_s(uncached, cached, host)
        a.batch = view.inflight + 1
        a.batch_kv = wc.batch_kv_tokens(view) + a.kv_tokens
        a.pred_tpot_s = wc.step_s(a.batch_kv, a.batch)
        a.pred_e2e_s = a.pred_ttft_s + max(0, output - 1) * a.pred_tpot_s
        a.fixed_ttft_s = base.backlog_s(view) + base.prefill_ctx_s(uncached, cached)
        cap = view.capacity_tokens
        a.kv_queued = view.waiting > 0 or (cap > 0 and view.load_tokens + a.kv_tokens > cap)
        a.pred_learned = self._learned(a.worker)

    def _audit(self, decision: RouteDecision, w: WorkerId, now: float) -> None:
        """Every policy's audit terms name the cost estimate behind the pick, and a half-open pick."""
        terms = decision.terms.setdefault(w, {})
        for k, v in self.costs.describe(w).items():
            terms.setdefault(k, v)
        if self.health.is_half_open(w):
            terms["half_open"] = 1.0
            decision.reason = (decision.reason or "") + "+half_open"

    def _claimed(self, req: RouteRequest, w: WorkerId, now: float) -> int:
        """Prompt tokens ``w``'s own cache reports say it can serve, as an engine counts them: whole
        blocks, and never the last prompt token (it must be computed to produce the first output)."""
        blocks = self.index.match_one(req.hashes, w, now, precise=True)
        if blocks <= 0:
            return 0
        bt = self.deps.block_tokens
        most = (req.prompt_tokens - 1) // bt
        return (blocks if blocks < most else most) * bt

    # ------------------------------------------------------------------ run-time control

    def set_policy(self, name: str, weights: Mapping[str, Any] | None = None) -> None:
        """Switch the live policy (fresh state); raises ConfigError and keeps the old one on error."""
        policy = make_policy(name, self.deps, weights)
        log.info("routing policy %s -> %s (weights %s)", self.policy.name, name, dict(weights or {}))
        self.policy = policy

    def set_learning(self, learn: Mapping[str, Any] | None = None, health: Mapping[str, Any] | None = None) -> None:
        """Replace the learned cost model's and the health rule's settings (fields not named keep
        their defaults); raises ConfigError and keeps the old ones on error. What was learned stays."""
        new_learn = build_params(LearnSettings, learn, "learn") if learn is not None else None
        new_health = build_params(HealthSettings, health, "health") if health is not None else None
        if new_learn is not None:
            self.costs.reconfigure(new_learn)
            log.info("learned cost settings %s", dict(learn))
        if new_health is not None:
            self.health.settings = new_health
            log.info("health settings %s", dict(health))

    def set_canary(self, name: str | None, share: float = 0.0, weights: Mapping[str, Any] | None = None) -> None:
        """Let policy ``name`` decide ``share`` (0..1) of requests; ``None`` or 0 removes it."""
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"canary_share must be within [0, 1], got {share}")
        if name is None or share == 0.0:
            self.canary, self.canary_share = None, 0.0
            log.info("routing canary off")
            return
        self.canary, self.canary_share = make_policy(name, self.deps, weights), share
        log.info("routing canary %s on %.1f%% of requests", name, share * 100)

    # ------------------------------------------------------------------ housekeeping

    def tick(self, now: float) -> None:
        """Periodic upkeep (the service: every second or so; the simulator: on its clock)."""
        for w in self.registry.tick(now):
            self.index.forget_worker(w, now)
            self.claims.reset(w)
            self._snapshot_requests.pop(w, None)
            self.costs.forget(w)
            self.health.forget(w)
            self.progress.forget(w)
            self._completed.pop(w, None)
            self.predictions.pop(w, None)
        self.index.expire(now)
        self._judge_overdue(now)
        for w in self.index.untrusted():
            if w in self.registry.views and self.index.needs_snapshot(w, now):
                self._snapshot_requests[w] = None

    def _judge_overdue(self, now: float) -> None:
        """An outstanding request past ``slow_factor`` x its predicted end is evidence of slowness
        *before* it completes (a slowed worker's completions come late by the very slowdown).

        The prefill the worker's heartbeats say is still queued there now (which the prediction at
        routing time may not have known: another router's burst) is added to the allowance: a
        request waiting in a queue the router can see is late, not evidence of a slow worker."""
        hs = self.health.settings
        if not hs.enabled or not self.costs.settings.enabled:
            return
        factor = hs.slow_factor
        views = self.workers
        for a in self.registry.ledger.values():
            if a.overdue or a.pred_e2e_s <= 0.0:
                continue
            age = now - a.routed_at
            if age <= factor * a.pred_e2e_s:
                continue
            view = views.get(a.worker)
            if view is None or not a.pred_learned or not self._learned(a.worker):
                continue
            # and the prefill routed behind it, which its decode steps share (see completion_ratio)
            allowance = self.costs.of(a.worker).wait_s(view, now) + self.registry.prefill_since(a.worker, a.prefill_mark)
            if age > factor * a.pred_e2e_s + allowance:
                a.overdue = True
                self.health.observe(a.worker, age / a.pred_e2e_s, now, completed=False)
                self.costs.freeze(a.worker, self.health.learning_frozen(a.worker, now))

    def pop_snapshot_requests(self) -> list[WorkerId]:
        """Workers the service should send a ``snapshot`` control message to (drained)."""
        out = list(self._snapshot_requests)
        self._snapshot_requests.clear()
        return out

    def assignment(self, request_id: RequestId) -> Assignment | None:
        """Our outstanding assignment of ``request_id``, if any (for re-routing and audits)."""
        return self.registry.ledger.get(request_id)

    def stats(self, now: float) -> dict[str, Any]:
        """Gauges for metrics: workers per state, index size, untrusted workers, ledger size."""
        states: dict[str, int] = {}
        for w in self.workers:
            st = self.registry.state(w, now)
            key = st.value if isinstance(st, WorkerState) else st
            states[key] = states.get(key, 0) + 1
        return {
            "workers": states,
            "index": self.index.stats(),
            "outstanding": len(self.registry.ledger),
            "policy": self.policy.name,
            "canary": self.canary.name if self.canary is not None else None,
            "canary_share": self.canary_share,
            "cost_refused": dict(self.costs.refused),
            "half_open": sorted(w for w in self.workers if self.health.is_half_open(w)),
        }
