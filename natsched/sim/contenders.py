"""Contenders of the scenario suite: (admission, routing) pairs, each as its project documents it.

Every contender meets the same arrivals and cluster events; what differs is what it does at the
door (admission) and where it sends what it lets in (routing). The admission behaviours are
:mod:`natsched.sim.admission` hooks, each reduced to its rule, with the source:

- ``natsched``: :class:`NatschedGate` drives the shipped :class:`natsched.admitter.policy.AdmitterCore`
  as ``admitter/service.py`` does (evaluate + apply per arrival, plan + commit dequeues on every
  completion and tick, release per completion), its total following the workers' capacity
  (:mod:`natsched.admitter.dynamic`); ``degrade`` parks batch/offline work for the offline path,
  which runs it when usage falls below the degrade watermark; a dead worker's requests whose
  client has seen no output yet are rescued (re-routed, reservation kept) after its lease
  expires. A stream that had output is migrated by the producer once the rescue tells it
  (:class:`natsched.client.producer.Migration`: the next try continues after the output so far).
- ``dynamo``: :class:`DynamoGate`, Dynamo's busy-threshold rejection (docs, "Request Rejection"):
  a worker is busy when its active decode blocks exceed ``active_decode_blocks_threshold`` of its
  KV or its active prefill tokens exceed ``active_prefill_tokens_threshold``; when every worker
  of the model is busy the frontend answers 529/503 with no Retry-After. The thresholds are off
  by default; the documented example values (0.85, 10000) are used — off would be no admission.
- ``llm-d``: :class:`LlmdFlowGate`, the Gateway API Inference Extension's flow control: the pool
  is saturated when every endpoint has more than ``queue_depth_threshold`` (5) waiting requests or
  KV utilisation above ``kv_cache_util_threshold`` (0.8) (saturation detector defaults); while
  saturated requests queue in priority bands (online before batch), FCFS within a band, up to
  5000 per band (the hidden default) and a 60 s TTL, then 429; sheddable (offline, negative
  priority) requests are rejected at once.
- ``smg-priority``: :class:`SmgGate`, SGLang model gateway's priority scheduling with tenant
  reservations (the variant the issue names; defaults not found in the searchable corpus, so the
  better reading): concurrency capped at the engines' batch slots, a queue ordered by class then
  arrival, each tenant's floor reserved as a share of the slots, queue 100 / 60 s then 429.
- everyone else (SGLang router, vllm-project/router, production-stack, AIBrix, natsched without
  admission): no admission.

Every routing policy runs inside natsched's :class:`natsched.router.core.RouterCore` (the
simulator runs the service's objects). What every contender shares there is the cluster and what
any router can know of it, not a rule of natsched's: the engines and their heartbeats (load,
queue, KV, the worker's own reported state: ``backoff``, ``quiescing``, ``reregister``); the
registry's exclusion of a worker whose heartbeats stopped (silent for 2 of its periods: it is
gone, for every router); the load accounting of requests routed since the last heartbeat; the
shared prefix index (cache events + routing decisions, distrusted when its claims fail) that
the index-reading peers read; the LoRA adapter filter (:func:`natsched.router.core.prefer_loaded`);
each worker's learned cost model (which ``preble_e2`` reads as Preble's own estimate does).

What is natsched's own, and so only natsched's contenders (``latency_health``) get it: the
latency-tied health rule (:mod:`natsched.router.health`, :mod:`natsched.router.progress`) — a
worker slower than its own learned prediction (completions, overdue requests, heartbeat decode
progress) goes half-open and takes only batch, short and probe requests. No peer documents an
equivalent in its routing policy (read each policy's docstring: SGLang's cache_aware, Dynamo's
KV cost, llm-d's filters and scorers, vllm-project/router's smetric, AIBrix's prefix-cache and
production-stack's round robin route on load and cache only; their slow-worker answers are in
admission, kept as documented: Dynamo's busy threshold, llm-d's saturation detector), so every
peer runs with it off (``HealthSettings(enabled=False)``): with it, a peer was partly natsched —
better than its project at some loads, worse at others (elastic worst-phase p99 at loads 0.9 /
1 / 1.1: sglang 2.20 / 2.53 / 13.7 s with it, 8.83 / 6.47 / 4.65 s as documented; production-stack
2.46 / 2.18 / 15.0 s with it, 2.46 / 2.94 / 6.76 s as documented; docs/scenarios.md).
The same holds for natsched's panic threshold (:meth:`natsched.router.core.RouterCore.candidates`:
when fewer than half of a model's workers may take a request, all may): the peers keep the rule
they ran with, half-open and backoff workers only when none other may (``panic_threshold`` 0).
With it, Dynamo's hetero p99 went from 3.1 to 11.8 s (two draws per load): a peer is not given a
rule of natsched's that makes it worse.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, replace
from typing import Callable

from natsched.admitter.dynamic import CacheShare, DynamicTotal, DynamicTotalSettings, ModelTotals, ModelLoad
from natsched.admitter.engines import EngineQueues
from natsched.admitter.offline import IdleGate, OfflineSettings
from natsched.admitter.policy import ALLOW as A_ALLOW, DEGRADE, QUEUE as A_QUEUE, AdmissionSettings, AdmitterCore
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.router.health import HealthSettings
from natsched.sim.admission import ALLOW, QUEUE, REJECT, AllowAll
from natsched.sim.trace import TraceRequest
from natsched.wire import subjects as S
from natsched.wire.schema import Completion, Request, RequestId, TenantId

RESCUE_S = 3.0  # natsched: a dead worker's lease expires after ~3 missed 1 s heartbeats
#: natsched's producer: a stream with output goes on after it on another worker this many times
#: (natsched.client.producer.MIGRATIONS; not imported: the simulator runs without the bus)
MIGRATIONS = 2


def _request(req: TraceRequest, model: str = "default") -> Request:
    """The wire request a producer would send (4 characters per token, the admitter's estimate);
    ``model`` when the trace names none (the simulator's, so workers and requests agree)."""
    return Request(id=RequestId(req.id), tenant=TenantId(req.tenant or "trace"), cls=req.cls or "online",
                   model=req.model or model, prompt="x" * (4 * max(1, req.input_length)),
                   max_tokens=max(1, req.output_length))


class NatschedGate:
    name = "natsched"
    tick_s = 0.25

    def __init__(self, tenants: dict[str, tuple[float, float]] | None = None,
                 slo_ttft_s: dict[str, float] | None = None) -> None:
        self.tenants = tenants or {}
        self.slo_ttft_s = dict(slo_ttft_s or {})  # the operator's promise, as the admitter is configured
        self.core: AdmitterCore | None = None
        self.dynamic = DynamicTotal(DynamicTotalSettings())
        self.share = CacheShare(self.dynamic.settings.share_half_life_s)  # from completions, as the service
        self.models = ModelTotals(self.dynamic.settings)  # per-model capacity, as the service
        self.engines = EngineQueues()  # saturated models, from heartbeats and completions, as the service
        self.degraded: set[int] = set()
        self._held: dict[str, tuple[TraceRequest, Request, int]] = {}  # allowed: id -> (req, wire, cost)
        self._queued: dict[str, tuple[TraceRequest, Request]] = {}
        self._parked: list[tuple[TraceRequest, Request, int]] = []  # degraded, for the offline path
        self._expired: list[tuple[TraceRequest, float | None]] = []
        self._next_dynamic = 0.0
        self._next_offline = 0.0

    def bind(self, sim) -> None:
        self.sim = sim
        cap = self._capacity()
        settings = AdmissionSettings(default_total=cap, max_prompt_tokens=1 << 20, max_output_tokens=1 << 20,
                                     slo_ttft_s=self.slo_ttft_s)
        quotas = Quotas(total=cap, tenants={n: TenantQuota(f, w) for n, (f, w) in self.tenants.items()})
        self.core = AdmitterCore(settings, quotas)
        self.core.set_model_totals(self.models.current(self._loads(), self.core.total))
        self.offline = IdleGate(OfflineSettings(admission=settings))

    def _capacity(self) -> int:
        return sum(w.core.kv_blocks * w.core.block_size for w in self.sim.live_workers())

    def _loads(self) -> list[ModelLoad]:
        """Each live worker's model, capacity and use, as its heartbeat names them."""
        return [ModelLoad(frozenset({w.model}), w.core.kv_blocks * w.core.block_size, w.engine.stats().runtime_tokens)
                for w in self.sim.live_workers()]

    def on_heartbeat(self, hb, now: float) -> None:
        """A worker's heartbeat, as the admitter service reads it (its engine's waiting requests)."""
        self.engines.heartbeat(hb.worker, frozenset({hb.model}), hb.waiting)
        if self.core is not None:
            self.core.set_saturated(self.engines.saturated())

    def on_cluster_change(self, now: float) -> None:
        live = {w.id for w in self.sim.live_workers()}
        for wid in [w for w in self.engines.engines if w not in live]:
            self.engines.gone(wid)  # as the service on a lease expiry
        self.core.set_saturated(self.engines.saturated())
        cap = self._capacity()
        self.core.quotas.total = cap
        self.core.set_total(int(cap * self.dynamic.factor))
        self.core.set_model_totals(self.models.current(self._loads(), self.core.total))

    def _dynamic_total(self, now: float) -> None:
        if now < self._next_dynamic:
            return
        self._next_dynamic = now + self.dynamic.settings.interval_s
        loads = self._loads()  # what heartbeats say
        cap, used = sum(w.capacity for w in loads), sum(w.used for w in loads)
        # no operator total of its own: the factor bound is the only ceiling (admitter/dynamic.py)
        ceiling = int(cap * self.dynamic.settings.factor_bound)
        self.core.set_total(self.dynamic.next_total(ceiling, None, cap, used, reserved=self.core.used,
                                                  cache_share=self.share.share()))
        self.core.set_model_totals(self.models.next_totals(loads, self.core.usage.models, self.core.total,
                                                           self.share.share()))

    def admit(self, req: TraceRequest, now: float):
        wire = _request(req, self.sim.settings.model)
        d = self.core.evaluate(wire, now)
        self.core.apply(wire, d, now)
        if d.decision == A_ALLOW:
            self._held[req.id] = (req, wire, d.runtime_tokens)
            return ALLOW
        if d.decision == A_QUEUE:
            self._queued[req.id] = (req, wire)
            return QUEUE
        if d.decision == DEGRADE:
            self.degraded.add(req.index)
            self._parked.append((req, wire, d.runtime_tokens))
            return QUEUE
        return REJECT, d.retry_after

    def release(self, now: float) -> list[TraceRequest]:
        self._dynamic_total(now)
        picks = self.core.plan_dequeue(now)
        self.core.commit_dequeue(picks, now)
        out = []
        for wire, d in picks:
            req, _ = self._queued.pop(wire.id)
            if d.decision == A_ALLOW:
                self._held[req.id] = (req, wire, d.runtime_tokens)
                out.append(req)
            elif d.decision == DEGRADE:  # past its SLO: the offline path runs it later
                self.degraded.add(req.index)
                self._parked.append((req, wire, d.runtime_tokens))
            else:
                self._expired.append((req, d.retry_after))
        out += self._offline(now)
        return out

    def _offline(self, now: float) -> list[TraceRequest]:
        """The offline runner's rule (the shipped :class:`natsched.admitter.offline.IdleGate`): parked
        work runs, oldest first, while the usage stays under its low watermark of the total."""
        if not self._parked or now < self._next_offline:
            return []
        self._next_offline = now + self.offline.settings.poll_s
        core = self.core
        plan = self.offline.plan(core.usage, core.quotas, core.total, [w for _, w, _ in self._parked[:256]])
        out = []
        for i, cost in plan.takes:
            req, wire, _ = self._parked[i]
            self._held[req.id] = (req, replace(wire, cls=S.OFFLINE), cost)  # the offline path's class
            out.append(req)
        if plan.usage is not None:
            core.usage = plan.usage
        taken = {i for i, _ in plan.takes}
        self._parked = [p for i, p in enumerate(self._parked) if i not in taken]
        return out

    def expired(self, now: float) -> list[tuple[TraceRequest, float | None]]:
        out, self._expired = self._expired, []
        return out

    def on_finish(self, req: TraceRequest, ok: bool, now: float) -> None:
        held = self._held.pop(req.id, None)
        if held is None:
            return
        _, wire, cost = held
        self.engines.completed(self.sim.records[req.index].worker)
        self.core.set_saturated(self.engines.saturated())
        if ok:  # what the completion reports (the simulator set it just before)
            self.share.observe(req.input_length, self.sim.records[req.index].cached_tokens, now)
        self.core.release(Completion(request_id=wire.id, tenant=wire.tenant, cls=wire.cls, model=wire.model,
                                     status="ok" if ok else "error", runtime_tokens=cost,
                                     output_tokens=req.output_length if ok else 0, ts=now), now)


@dataclass
class DynamoGate:
    active_decode_blocks_threshold: float = 0.85
    active_prefill_tokens_threshold: int = 10_000
    name: str = "dynamo"
    tick_s: float | None = None

    def bind(self, sim) -> None:
        self.sim = sim

    def busy(self, v) -> bool:
        kv = v.kv_used_blocks / v.kv_total_blocks if v.kv_total_blocks else 0.0
        return (kv > self.active_decode_blocks_threshold
                or v.queued_prefill_tokens + v.pending_prefill_tokens > self.active_prefill_tokens_threshold)

    def admit(self, req: TraceRequest, now: float):
        views = [v for v in self.sim.router.workers.values() if v.model == (req.model or "default")
                 and now - v.last_heartbeat <= self.sim.router.registry.silence_limit(v)]
        if views and all(self.busy(v) for v in views):
            return REJECT, None  # 529 "all workers busy", no Retry-After
        return ALLOW

    def release(self, now: float) -> list[TraceRequest]:
        return []

    def on_finish(self, req: TraceRequest, ok: bool, now: float) -> None:
        pass


class _Bands:
    """Priority bands, FCFS within each (lower rank first)."""

    def __init__(self) -> None:
        self._heap: list = []
        self._seq = itertools.count()
        self._gone: set[str] = set()
        self.size: dict[int, int] = {}

    def push(self, rank: int, at: float, req: TraceRequest) -> None:
        heapq.heappush(self._heap, (rank, next(self._seq), at, req))
        self.size[rank] = self.size.get(rank, 0) + 1

    def pop(self):
        rank, _, at, req = heapq.heappop(self._heap)
        self.size[rank] -= 1
        return at, req

    def __len__(self) -> int:
        return len(self._heap)

    def expire(self, now: float, ttl: float) -> list[TraceRequest]:
        old = [e for e in self._heap if now - e[2] > ttl]
        if not old:
            return []
        self._heap = [e for e in self._heap if now - e[2] <= ttl]
        heapq.heapify(self._heap)
        for e in old:
            self.size[e[0]] -= 1
        return [e[3] for e in old]


CLASS_RANK = {"online": 0, "batch": 1, "offline": 2}


@dataclass
class LlmdFlowGate:
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    band_max_requests: int = 5000
    request_ttl_s: float = 60.0
    name: str = "llm-d"
    tick_s: float | None = 0.1

    def bind(self, sim) -> None:
        self.sim = sim
        self.bands: dict[str, _Bands] = {}
        self._expired: list[tuple[TraceRequest, float | None]] = []

    def _room(self, model: str, now: float) -> int:
        """Requests the pool takes before every endpoint is saturated (0: saturated)."""
        room = 0
        for v in self.sim.router.workers.values():
            if v.model != model or now - v.last_heartbeat > self.sim.router.registry.silence_limit(v):
                continue
            kv = v.kv_used_blocks / v.kv_total_blocks if v.kv_total_blocks else 0.0
            if kv <= self.kv_cache_util_threshold:
                room += max(0, self.queue_depth_threshold - (v.waiting + v.pending))
        return room

    def admit(self, req: TraceRequest, now: float):
        model = req.model or "default"
        bands = self.bands.setdefault(model, _Bands())
        if not len(bands) and self._room(model, now) > 0:
            return ALLOW
        rank = CLASS_RANK.get(req.cls or "online", 0)
        if rank == CLASS_RANK["offline"] or bands.size.get(rank, 0) >= self.band_max_requests:
            return REJECT, None  # sheddable while saturated, or the band is full: 429
        bands.push(rank, now, req)
        return QUEUE

    def release(self, now: float) -> list[TraceRequest]:
        out = []
        for model, bands in self.bands.items():
            for req in bands.expire(now, self.request_ttl_s):
                self._expired.append((req, None))
            room = self._room(model, now)
            while len(bands) and room > 0:
                out.append(bands.pop()[1])
                room -= 1
        return out

    def expired(self, now: float) -> list[tuple[TraceRequest, float | None]]:
        out, self._expired = self._expired, []
        return out

    def on_finish(self, req: TraceRequest, ok: bool, now: float) -> None:
        pass


class SmgGate:
    name = "smg-priority"
    tick_s = 0.1
    queue_size = 100
    queue_timeout_s = 60.0

    def __init__(self, tenants: dict[str, tuple[float, float]] | None = None) -> None:
        self.floors = {n: f for n, (f, _) in (tenants or {}).items()}

    def bind(self, sim) -> None:
        self.sim = sim
        self.running: dict[str, int] = {}
        self.queue = _Bands()
        self._expired: list[tuple[TraceRequest, float | None]] = []

    def _cap(self) -> int:
        return sum(w.core.max_num_seqs for w in self.sim.live_workers())

    def _fits(self, tenant: str) -> bool:
        """A free slot that no other tenant's unused reservation holds."""
        cap = self._cap()
        used = sum(self.running.values())
        if used >= cap:
            return False
        reserved = sum(max(0.0, f * cap - self.running.get(t, 0)) for t, f in self.floors.items() if t != tenant)
        return used + 1 <= cap - reserved or self.running.get(tenant, 0) < self.floors.get(tenant, 0.0) * cap

    def _take(self, req: TraceRequest) -> None:
        t = req.tenant or ""
        self.running[t] = self.running.get(t, 0) + 1

    def admit(self, req: TraceRequest, now: float):
        if not len(self.queue) and self._fits(req.tenant or ""):
            self._take(req)
            return ALLOW
        if len(self.queue) >= self.queue_size:
            return REJECT, None
        self.queue.push(CLASS_RANK.get(req.cls or "online", 0), now, req)
        return QUEUE

    def release(self, now: float) -> list[TraceRequest]:
        self._expired += [(r, None) for r in self.queue.expire(now, self.queue_timeout_s)]
        out, skipped = [], []
        while len(self.queue):
            at, req = self.queue.pop()
            if self._fits(req.tenant or ""):
                self._take(req)
                out.append(req)
            else:
                skipped.append((at, req))
                if sum(self.running.values()) >= self._cap():
                    break
        for at, req in skipped:
            self.queue.push(CLASS_RANK.get(req.cls or "online", 0), at, req)
        return out

    def expired(self, now: float) -> list[tuple[TraceRequest, float | None]]:
        out, self._expired = self._expired, []
        return out

    def on_finish(self, req: TraceRequest, ok: bool, now: float) -> None:
        t = req.tenant or ""
        if self.running.get(t, 0) > 0:
            self.running[t] -= 1


@dataclass(frozen=True)
class Contender:
    name: str
    policy: str  # routing policy (natsched.router.policies.POLICIES)
    gate: Callable[[dict, dict], object] | None  # (tenants, SLOs) -> admission hook; None: no admission
    rescue: bool = False  # re-routes a dead worker's requests with no output yet itself
    doc: str = ""
    latency_health: bool = False  # natsched's half-open rule (natsched.router.health): natsched's own

    def router_settings(self) -> dict:
        """The :class:`natsched.router.core.RouterSettings` fields this contender sets: without
        ``latency_health``, a health rule that never opens and no panic threshold (see the module
        docstring)."""
        return {} if self.latency_health else {"health": HealthSettings(enabled=False), "panic_threshold": 0.0}


CONTENDERS: dict[str, Contender] = {c.name: c for c in (
    Contender("natsched", "natsched", lambda t, slo: NatschedGate(t, slo), True, "AdmitterCore + natsched routing",
              latency_health=True),
    Contender("natsched-noadmit", "natsched", None, False, "natsched routing, no admission", latency_health=True),
    Contender("sglang", "sglang_cache_aware", None, False, "SGLang router cache_aware, no admission (default)"),
    Contender("smg-priority", "sglang_cache_aware", lambda t, slo: SmgGate(t), False,
              "SGLang model gateway priority scheduler with tenant reservations"),
    Contender("dynamo", "dynamo_kv", lambda t, slo: DynamoGate(), False, "Dynamo KV router + busy-threshold rejection"),
    Contender("llm-d", "llmd_affinity", lambda t, slo: LlmdFlowGate(), False,
              "llm-d default profile + flow control"),
    Contender("vllm-router", "vllm_smetric", None, False, "vllm-project/router smetric, no admission"),
    Contender("production-stack", "round_robin", None, False, "vLLM production-stack router default, no admission"),
    Contender("aibrix", "aibrix_prefix", None, False, "AIBrix prefix-cache routing, no admission"),
)}


def make_gate(c: Contender, tenants: dict[str, tuple[float, float]], slo_ttft_s: dict[str, float] | None = None):
    return c.gate(tenants, slo_ttft_s or {}) if c.gate is not None else AllowAll()
