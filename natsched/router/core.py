"""RouterCore: the router's whole state and decision, without I/O.

The service feeds it heartbeats, cache events and completions and asks it to route; the
simulator does the same in virtual time. It owns the shared pieces and wires them together:

- :class:`~natsched.router.registry.WorkerRegistry` — worker state machine and load view (+ the ledger of
  our assignments);
- :class:`~natsched.router.index.PrefixIndex` — which worker holds which prefix (events + our decisions);
- :class:`~natsched.router.feedback.ClaimTracker` — are a worker's cache claims coming true;
- the live policy and an optional canary policy, both built on the same :class:`PolicyDeps`.

Time (``now``) is the caller's clock in seconds (wall time in the service, virtual time in the
simulator) and must be >= 0 and non-decreasing.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from natsched.wire.schema import CacheEvent, Completion, CompletionStatus, Heartbeat, RequestId, WorkerId
from natsched.router.costmodel import CostModel
from natsched.router.deps import PolicyDeps, cached_tokens
from natsched.router.errors import ConfigError
from natsched.router.feedback import ClaimTracker, FeedbackSettings
from natsched.router.index import IndexSettings, PrefixIndex
from natsched.router.policies import make_policy
from natsched.router.policy import RouteDecision, RouteRequest, RoutingPolicy, WorkerView
from natsched.router.registry import Assignment, RegistrySettings, WorkerRegistry, WorkerState

log = logging.getLogger(__name__)


@dataclass
class RouterSettings:
    policy: str = "natsched"
    block_size: int = 32  # tokens per block of RouteRequest.hashes (the "block_tokens")
    heartbeat_timeout_s: float = 15.0  # a worker silent for longer is excluded
    backoff_max_prompt_tokens: int = 1024  # a BACKOFF worker takes only prompts up to this
    pending_grace_s: float = 2.0  # see natsched.router.registry
    forget_after_s: float = 600.0
    ledger_ttl_s: float = 3600.0
    policy_weights: dict[str, dict[str, Any]] = field(default_factory=dict)  # per policy name
    canary_policy: str | None = None
    canary_share: float = 0.0  # share of requests (by request-id hash) the canary decides
    index: IndexSettings = field(default_factory=IndexSettings)
    feedback: FeedbackSettings = field(default_factory=FeedbackSettings)
    cost: CostModel = field(default_factory=CostModel)

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
        self.registry = WorkerRegistry(s.registry_settings(), s.cost)
        self.claims = ClaimTracker(s.feedback)
        self.deps = PolicyDeps(self.index, s.cost, s.block_size)
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
        if self.registry.on_heartbeat(hb, now):
            self.index.reset_worker(w, now)
            self.claims.reset(w)
        if joined and hb.kv_seq and not self.index.has_seen(w):
            # this router started after the worker's cache events did: ask for what it holds now,
            # before the first delta after the load began shows the gap. Trust is left as it was:
            # a gap still distrusts and asks at once, and whichever snapshot comes settles it
            self._snapshot_requests[w] = None
        self._check_fresh(w)

    def on_cache_event(self, ev: CacheEvent, now: float) -> bool:
        """Apply a cache delta; False when a sequence gap means a snapshot is needed."""
        ok = self.index.apply(ev, now)
        if ev.kind == "snapshot":
            self.claims.reset(ev.worker)
            self._snapshot_requests.pop(ev.worker, None)
        if ev.worker in self.registry.views:
            self._check_fresh(ev.worker)
        return ok

    def on_completion(self, c: Completion, now: float) -> None:
        """Release the request's load and score the cache claim it confirms or refutes."""
        a = self.registry.on_completion(c.request_id, c.worker, c.runtime_tokens)
        if a is None or c.status != CompletionStatus.OK or (c.worker is not None and c.worker != a.worker):
            return  # not routed by us (another replica judges it), failed, or re-routed
        if self._claim_failed(a, c.cached_tokens):
            w = a.worker
            reason = f"claims failing: accuracy {self.claims.accuracy(w):.2f}"
            if self.index.distrust(w, reason) and self.index.needs_snapshot(w, now):
                self._snapshot_requests[w] = None

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
        them, for a LoRA adapter's request, those with the adapter loaded (:func:`prefer_loaded`)."""
        eligible = self.registry.eligible
        return prefer_loaded([w for w in self.workers.values() if eligible(w, req, now)], req.model)

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
        self.index.record_route(req.hashes, w, now)
        kv = req.runtime_tokens or prompt + req.expected_output
        uncached = prompt - expected
        self.registry.on_assigned(req.id, Assignment(
            w, kv, uncached, expected, now, claimed_cached=claimed, hashes=req.hashes, mark=self.index.mark(),
            prompt_tokens=prompt, prefill_s=self.deps.cost.prefill_ctx_s(uncached, expected)))
        return decision

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
        self.index.expire(now)
        for w in self.index.untrusted():
            if w in self.registry.views and self.index.needs_snapshot(w, now):
                self._snapshot_requests[w] = None

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
        }
