"""The discrete-event simulator: a virtual clock driving the objects the services ship.

One :class:`natsched.router.core.RouterCore` decides where requests go, fed exactly as ``router/service.py``
feeds it (``on_heartbeat`` / ``on_cache_event`` / ``on_completion`` with the :mod:`natsched.wire.schema`
messages, ``route`` with a :class:`natsched.router.policy.RouteRequest`); one
:class:`natsched.workers.simcore.SimCore` per worker plays the engine, stepped in virtual time the way
``workers/simengine.py`` steps it in real time (``step(now)``, then the step's duration later its
cache deltas and finished sequences are published). Heartbeats are built the way
``workers/agent.py`` builds them, from ``SimEngine.stats()`` of an engine wrapping that SimCore and
the agent's own ``backoff`` rule (:mod:`natsched.workers.backoff`), every ``hb_interval`` virtual seconds
(staggered per worker); cache events are sequenced per worker, ``removed`` before ``stored`` of the
same step. As in the router service, a ``False`` from ``on_cache_event`` is answered with a snapshot
at once, and ``RouterCore.tick`` runs every ``router_tick_s`` followed by the snapshots it asks for.

Before routing, an :class:`~natsched.sim.admission.AdmissionHook` decides allow / queue / reject.
A request with no routable worker is retried every ``route_retry_s`` for up to ``no_worker_wait_s``
(the router service's nak/redeliver loop), then rejected. Messages travel instantly unless
``net_delay_s`` is set. Everything is deterministic: same trace and settings, same result.

The scenario suite (:mod:`natsched.sim.scenarios`) adds what a changing cluster needs:

- ``worker_specs``: one :class:`WorkerSpec` (engine profile, model, KV) per worker, for clusters of
  unequal machines serving several models;
- ``events``: :class:`WorkerEvent` s at fixed virtual times — ``add`` a cold worker, ``kill`` one
  (its unfinished requests are lost on it), ``slow`` one to a share of its speed for a while (a
  noisy neighbour: ``SimCore.set_speed``, every step takes 1 / factor as long);
- what happens to a killed worker's requests: with ``rescue_s`` set, the scheduler re-routes those
  whose client has seen no output yet itself, that long after the death (natsched's admitter
  rescue: the reservation stays held, the dead worker is avoided). A stream that had output
  cannot be taken back: when the rescue tells natsched's producer (``rerouted``, ``rescue_s``
  after the death) it cancels the re-run and, with ``migrate``, sends the next try continuing
  after the output so far (:class:`natsched.client.producer.Migration`: prompt + those tokens,
  the rest to generate), else fails it with ``worker_lost`` and the client retries (every
  simulated client streams);
- ``client_retry``: refused requests (admission rejects, no worker, a lost worker without rescue)
  come back after the client's backoff — ``retry_after`` when the refusal carries one, else the
  OpenAI SDK's exponential backoff (:class:`ClientRetry`) — until its retries run out. So a retry
  storm can happen: every refusal returns as more load a second or two later.

Clusters need not be uniform: ``worker_profiles`` gives each worker its engine profile (in turn),
``host_blocks`` / ``host_bandwidth`` give every engine a host KV tier (its changes are published
as cache events with ``tier = "host"``), and ``speed_events`` change a worker's speed while the
run goes on (``(seconds after the first arrival, worker index, speed)``; 1.0 nominal).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from natsched.wire.schema import CacheEvent, Completion, CompletionStatus, Heartbeat, RequestId, TenantId, WorkerId
from natsched.router.core import RouterCore, RouterSettings
from natsched.router.policy import RouteRequest
from natsched.sim.admission import ALLOW, QUEUE, REJECT, AdmissionHook, AllowAll, runtime_tokens
from natsched.sim.errors import SimConfigError, SimError
from natsched.sim.metrics import RequestRecord, summarize
from natsched.sim.trace import Trace, TraceRequest
from natsched.workers.profiles import DEFAULT_PROFILE, EngineProfile, get_profile
from natsched.workers.simcore import SimCore, StepResult
from natsched.workers.simengine import SimEngine

try:  # the agent's own overload detector (workers/backoff.py); absent in older trees
    from natsched.workers.backoff import BackoffMonitor
except ImportError:  # pragma: no cover
    BackoffMonitor = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

# event kinds; the periodic ones (heartbeats, ticks) come last
_ARRIVE, _STEP_END, _RETRY, _DELIVER, _WORKER_EVENT, _SPEED, _HEARTBEAT, _ADMIT_TICK, _ROUTER_TICK = range(9)
EVENT_KINDS = ("add", "kill", "slow")
_PERIODIC = _HEARTBEAT  # kinds >= this recur forever; the others are "activity"

ProgressFn = Callable[[int, int], None]  # (requests done, total)


@dataclass(frozen=True)
class WorkerSpec:
    """One simulated worker: its engine profile (a name or an :class:`EngineProfile`), the model it
    serves and, optionally, its KV blocks and batch slots (default: the profile's)."""

    profile: EngineProfile | str = DEFAULT_PROFILE
    model: str = "default"
    kv_blocks: int | None = None
    max_num_seqs: int | None = None

    def engine_profile(self) -> EngineProfile:
        return self.profile if isinstance(self.profile, EngineProfile) else get_profile(self.profile)


@dataclass(frozen=True)
class WorkerEvent:
    """A change of the cluster at ``at`` virtual seconds after the first arrival: ``add`` a cold
    worker (``spec``), ``kill`` worker ``worker``, or ``slow`` it to ``factor`` of its speed for
    ``duration_s`` seconds (None: for good)."""

    at: float
    kind: str
    worker: str | None = None
    spec: WorkerSpec | None = None
    factor: float = 1.0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise SimConfigError(f"worker event kind must be one of {', '.join(EVENT_KINDS)}, got {self.kind!r}")
        if self.kind in ("kill", "slow") and not self.worker:
            raise SimConfigError(f"a {self.kind} event names its worker")
        if self.kind == "slow" and not 0.0 < self.factor <= 1.0:
            raise SimConfigError(f"a slow event's factor is a share of the speed in (0, 1], got {self.factor}")


@dataclass(frozen=True)
class ClientRetry:
    """How a refused client retries: the OpenAI Python SDK's defaults (``openai/_constants.py``:
    ``DEFAULT_MAX_RETRIES = 2``, ``INITIAL_RETRY_DELAY = 0.5``, ``MAX_RETRY_DELAY = 8.0``,
    ``MAX_RETRY_AFTER_DELAY = 120``; ``_base_client.py`` ``_calculate_retry_timeout``): a
    ``retry_after`` in (0, 120] s is honoured as is, a longer one is not retried at all, otherwise
    ``min(0.5 x 2^n, 8)`` seconds for the n-th retry (n from 0), less a random 0-25 % (jitter)."""

    max_retries: int = 2
    initial_s: float = 0.5
    max_s: float = 8.0
    jitter: float = 0.25
    max_retry_after_s: float = 120.0

    def delay(self, retries_done: int, retry_after: float | None, rng: random.Random) -> float | None:
        """Seconds until the next attempt, or None: the client gives up."""
        if retries_done >= self.max_retries:
            return None
        if retry_after is not None and retry_after > 0:
            return retry_after if retry_after <= self.max_retry_after_s else None
        sleep = min(self.initial_s * 2.0 ** retries_done, self.max_s)
        return sleep * (1.0 - self.jitter * rng.random())


@dataclass
class SimSettings:
    workers: int = 8
    policy: str = "least_loaded"
    profile: str = DEFAULT_PROFILE
    hb_interval: float = 1.0  # virtual seconds between a worker's heartbeats (agent default)
    warmup_s: float = 1.0  # workers start (snapshot + heartbeat) this long before the first arrival
    net_delay_s: float = 0.0  # one-way bus latency of every message (assignments, reports)
    router_tick_s: float = 1.0  # RouterCore.tick() period (the service's housekeeping loop)
    route_retry_s: float = 1.0  # router service: retry_delay_s
    no_worker_wait_s: float = 10.0  # router service: give up on a request after this long
    stall_s: float = 3600.0  # nothing but periodic events for this long with requests unfinished: error
    kv_blocks: int | None = None  # per engine; default: the profile's KV capacity / block size
    max_num_seqs: int | None = None  # per engine; default: the profile's
    max_model_len: int | None = None  # reject prompt+output longer than this (None: only KV limits)
    worker_backoff: bool = True  # workers announce "backoff" by the agent's rule (natsched.workers.backoff)
    model: str = "default"
    tenant: str = "trace"
    cls: str = "online"
    router: dict = field(default_factory=dict)  # extra RouterSettings fields (by name)
    worker_specs: tuple[WorkerSpec, ...] | None = None  # one per worker (then `workers` is their count)
    events: tuple[WorkerEvent, ...] = ()
    client_retry: ClientRetry | None = None  # None: a refusal is final
    rescue_s: float | None = None  # re-route a dead worker's requests after this long (None: the client's error)
    migrate: int = 0  # with rescue_s: a stream with output goes on after it this many times (the producer's migrations)
    seed: int = 0  # the clients' retry jitter
    worker_profiles: list[str] | None = None  # per worker, in turn (a mixed cluster); None: ``profile``
    host_blocks: int = 0  # host-tier KV blocks per engine (0: no host tier)
    host_bandwidth: float = 0.0  # bytes/s from the host tier into GPU memory
    speed_events: list[tuple[float, int, float]] = field(default_factory=list)  # (t after first arrival, worker, speed)

    def __post_init__(self) -> None:
        if self.worker_specs is not None:
            if not self.worker_specs:
                raise SimConfigError("worker_specs needs at least one worker")
            self.workers = len(self.worker_specs)
        if self.rescue_s is not None and self.rescue_s < 0:
            raise SimConfigError(f"rescue_s must be >= 0, got {self.rescue_s}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise SimConfigError(f"workers must be >= 1, got {self.workers!r}")
        if self.warmup_s < 0:
            raise SimConfigError(f"warmup_s must be >= 0, got {self.warmup_s}")
        if self.hb_interval <= 0:
            raise SimConfigError(f"hb_interval must be > 0, got {self.hb_interval}")
        if self.stall_s <= 0:
            raise SimConfigError(f"stall_s must be > 0, got {self.stall_s}")
        if self.net_delay_s < 0 or self.route_retry_s <= 0 or self.no_worker_wait_s < 0 or self.router_tick_s <= 0:
            raise SimConfigError("net_delay_s and no_worker_wait_s must be >= 0, route_retry_s and router_tick_s > 0")
        try:
            for name in [self.profile, *(self.worker_profiles or [])]:
                get_profile(name)
        except ValueError as exc:
            raise SimConfigError(str(exc)) from None
        if self.worker_profiles is not None and not self.worker_profiles:
            raise SimConfigError("worker_profiles must name at least one profile (or be left out)")
        if self.host_blocks < 0 or (self.host_blocks and self.host_bandwidth <= 0):
            raise SimConfigError("host_blocks must be >= 0, and host_bandwidth > 0 with a host tier")
        for ev in self.speed_events:
            if len(ev) != 3 or not 0 <= int(ev[1]) < self.workers or not ev[2] > 0 or ev[0] < 0:
                raise SimConfigError(f"speed event {ev!r}: (t >= 0, worker index < workers, speed > 0)")

    def profile_of(self, i: int) -> str:
        """The engine profile of worker ``i``."""
        return self.worker_profiles[i % len(self.worker_profiles)] if self.worker_profiles else self.profile


def make_router(settings: SimSettings, block_size: int) -> RouterCore:
    """The router the services would build, with the trace's block size."""
    names = {f.name for f in dataclasses.fields(RouterSettings)}
    unknown = sorted(set(settings.router) - names)
    if unknown:
        raise SimConfigError(f"unknown router setting(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    rs = RouterSettings(**{**settings.router, "policy": settings.policy, "block_size": block_size})
    try:
        return RouterCore(rs)
    except (ValueError, KeyError) as exc:  # unknown policy (natsched.router.errors.ConfigError is a ValueError)
        raise SimConfigError(str(exc.args[0] if exc.args else exc)) from None


class _Worker:
    __slots__ = ("id", "engine", "core", "backoff", "state", "stepping", "hb_seq", "kv_seq", "busy_window",
                 "model", "alive", "joined", "deployment", "decode_tokens", "decode_s", "in_step")

    def __init__(self, wid: WorkerId, engine: SimEngine, backoff, model: str = "default", joined: float = 0.0,
                 deployment: str | None = None) -> None:
        self.id = wid
        self.model = model
        self.alive = True
        self.joined = joined
        self.deployment = deployment  # its engine profile: what a real worker's calibration key names
        self.engine = engine  # stats() only: the heartbeat reports what a live SimEngine would
        self.core: SimCore = engine.core  # stepped by the simulator's clock
        self.backoff = backoff
        self.state = "healthy"
        self.stepping = False  # a step is in flight (its end event is queued)
        self.hb_seq = 0
        self.kv_seq = 0
        self.busy_window = 0.0  # busy seconds inside the arrival window
        self.decode_tokens = 0  # decode progress since the last heartbeat (WorkerAgent's DecodeProgress)
        self.decode_s = 0.0
        # the sequences the step in flight finishes: the engine core has already let them go, and
        # a kill before the step ends must still find the first tokens they streamed
        self.in_step: dict[str, object] = {}


@dataclass
class SimResult:
    policy: str
    trace: str
    workers: int
    speedup: float
    records: list[RequestRecord]
    busy_time: list[float]  # per worker, whole run
    busy_window: list[float]  # per worker, inside [first arrival, last arrival]
    window: float  # seconds from first to last arrival
    end_time: float  # virtual time of the last event that mattered
    steps: int
    preemptions: int
    wall_s: float
    backoff_changes: int = 0
    predictions: dict = field(default_factory=dict)  # RouterCore.predictions (keep_predictions > 0)
    health_changes: list = field(default_factory=list)  # (t, worker, state) of the router's health
    profiles: dict = field(default_factory=dict)  # worker -> its EngineProfile (added ones included)

    def metrics(self) -> dict:
        return summarize(self.records, self.busy_time, self.busy_window, self.window)


class Simulator:
    """Replays one trace through one router and ``settings.workers`` simulated engines."""

    def __init__(
        self,
        trace: Trace,
        settings: SimSettings | None = None,
        admission: AdmissionHook | None = None,
        router: RouterCore | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.trace = trace
        self.settings = s = settings or SimSettings()
        self.profile: EngineProfile = get_profile(s.profile)
        self.block_size = trace.block_size
        self.router = router or make_router(s, self.block_size)
        self.admission = admission or AllowAll()
        self.progress = progress
        specs = s.worker_specs or tuple(WorkerSpec(s.profile_of(i), s.model, s.kv_blocks, s.max_num_seqs)
                                        for i in range(s.workers))
        added = sum(1 for e in s.events if e.kind == "add")
        self._width = len(str(len(specs) + added - 1))
        self.workers: dict[WorkerId, _Worker] = {}
        for spec in specs:
            self._new_worker(spec, 0.0)
        self.t0 = s.warmup_s  # virtual time of the trace's first arrival
        self.records = [
            RequestRecord(index=r.index, arrival=self.t0 + r.arrival, prompt_tokens=max(1, r.input_length),
                          output_tokens=max(1, r.output_length), first_block=r.hashes[0] if r.hashes else None,
                          tenant=r.tenant or s.tenant, cls=r.cls or s.cls)
            for r in trace.requests
        ]
        self._route_reqs: dict[int, RouteRequest] = {}
        self._admitted_at: dict[int, float] = {}
        self._resumed: dict[int, int] = {}  # request index -> output tokens its migrated stream had
        self._by_seq_id: dict[str, TraceRequest] = {}
        self._heap: list = []
        self._seq = 0
        self._done = 0
        self._window_start = self.t0
        self._window_end = self.t0 + trace.duration
        self._steps = 0
        self._end = 0.0
        self.backoff_changes = 0  # healthy <-> backoff transitions announced by workers
        self._active = 0  # queued events that are not periodic (arrivals, steps, retries, messages)
        self._last_active = 0.0

    def _new_worker(self, spec: WorkerSpec, now: float) -> _Worker:
        s = self.settings
        wid = WorkerId(f"w{len(self.workers):0{self._width}d}")
        engine = SimEngine(spec.engine_profile(), self.block_size,
                           kv_blocks=spec.kv_blocks if spec.kv_blocks is not None else s.kv_blocks,
                           max_num_seqs=spec.max_num_seqs if spec.max_num_seqs is not None else s.max_num_seqs,
                           max_model_len=1 << 62,  # max_model_len is checked here (SimSettings)
                           host_blocks=s.host_blocks, host_bandwidth=s.host_bandwidth)
        backoff = BackoffMonitor() if s.worker_backoff and BackoffMonitor is not None else None
        w = self.workers[wid] = _Worker(wid, engine, backoff, spec.model, now, spec.engine_profile().name)
        return w

    def live_workers(self) -> list[_Worker]:
        return [w for w in self.workers.values() if w.alive]

    # ------------------------------------------------------------------ event queue
    def _push(self, t: float, kind: int, a=None, b=None) -> None:
        self._seq += 1
        if kind < _PERIODIC:
            self._active += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _send(self, now: float, fn, *args) -> None:
        """Deliver a message: ``fn(*args, arrival_time)`` now, or after the bus latency."""
        if self.settings.net_delay_s > 0:
            self._push(now + self.settings.net_delay_s, _DELIVER, fn, args)
        else:
            fn(*args, now)

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        started = time.perf_counter()
        s = self.settings
        n_workers = len(self.workers)
        for i, w in enumerate(self.workers.values()):
            # WorkerAgent.start(): a cache snapshot, then a heartbeat; then one every interval (staggered)
            self._snapshot(w, 0.0)
            self._heartbeat(w, 0.0)
            self._push(s.hb_interval * (1.0 + i / n_workers), _HEARTBEAT, w)
        for r in self.trace.requests:
            self._push(self.t0 + r.arrival, _ARRIVE, r)
        for ev in s.events:
            self._push(self.t0 + ev.at, _WORKER_EVENT, ev)
        bind = getattr(self.admission, "bind", None)
        if bind is not None:
            bind(self)
        ids = list(self.workers)
        for t, i, speed in s.speed_events:
            self._push(self.t0 + t, _SPEED, self.workers[ids[int(i)]], float(speed))
        tick = self.admission.tick_s
        if tick:
            self._push(tick, _ADMIT_TICK)
        router_tick = getattr(self.router, "tick", None)
        if router_tick is not None:
            self._push(s.router_tick_s, _ROUTER_TICK)
        total = len(self.records)
        heap = self._heap
        pop = heapq.heappop
        every = max(1, total // 200)
        last_report = -1
        while heap and self._done < total:
            now, _, kind, a, b = pop(heap)
            if kind < _PERIODIC:
                self._active -= 1
                self._last_active = now
            elif self._active == 0 and now - self._last_active > s.stall_s:
                self._stalled(now)
            if kind == _STEP_END:
                self._step_end(a, b, now)
            elif kind == _ARRIVE:
                self._arrive(a, now)
            elif kind == _HEARTBEAT:
                if a.alive:
                    self._heartbeat(a, now)
                    self._push(now + s.hb_interval, _HEARTBEAT, a)
            elif kind == _WORKER_EVENT:
                self._worker_event(a, now)
            elif kind == _DELIVER:
                a(*b, now)
            elif kind == _SPEED:
                a.core.set_speed(b)
            elif kind == _RETRY:
                self._route(a, now)
            elif kind == _ROUTER_TICK:
                router_tick(now)
                self._snapshots(now)
                self._push(now + s.router_tick_s, _ROUTER_TICK)
            elif kind == _ADMIT_TICK:
                self._release(now)
                self._push(now + tick, _ADMIT_TICK)
            if self.progress is not None and self._done // every != last_report:
                last_report = self._done // every
                self.progress(self._done, total)
        if self._done < total:  # cannot happen: every request ends ok or rejected
            raise SimError(f"simulation ended with {total - self._done} request(s) unfinished")
        if self.progress is not None:
            self.progress(total, total)
        for i in getattr(self.admission, "degraded", ()):
            self.records[i].degraded = True
        return SimResult(
            policy=getattr(self.router.policy, "name", s.policy), trace=self.trace.source, workers=n_workers,
            speedup=self.trace.speedup, records=self.records,
            busy_time=[w.core.busy_time for w in self.workers.values()],
            busy_window=[w.busy_window for w in self.workers.values()],
            window=self._window_end - self._window_start,
            end_time=self._end, steps=self._steps,
            preemptions=sum(w.core.preemptions for w in self.workers.values()),
            backoff_changes=self.backoff_changes,
            wall_s=time.perf_counter() - started,
            predictions={w: list(v) for w, v in getattr(self.router, "predictions", {}).items()},
            health_changes=list(getattr(getattr(self.router, "health", None), "transitions", ())),
            profiles={w.id: w.core.profile for w in self.workers.values()},
        )

    def _stalled(self, now: float) -> None:
        stuck = [r for r in self.records if r.status not in ("ok", "rejected", "failed")]
        by_status: dict[str, int] = {}
        for r in stuck:
            by_status[r.status] = by_status.get(r.status, 0) + 1
        raise SimError(f"simulation stalled at t={now:.1f}s: nothing happened for {self.settings.stall_s:g}s "
                       f"while {len(stuck)} request(s) were unfinished ({by_status}); an admission hook that "
                       f"queues must release its requests")

    # ------------------------------------------------------------------ requests
    def _arrive(self, req: TraceRequest, now: float) -> None:
        verdict = self.admission.admit(req, now)
        retry_after = None
        if isinstance(verdict, tuple):  # (reject, retry_after)
            verdict, retry_after = verdict
        rec = self.records[req.index]
        if verdict == ALLOW:
            self._admit(req, now)
        elif verdict == QUEUE:
            rec.status = "queued"
        elif verdict == REJECT:
            self._refuse(req, retry_after, "admission", now)
        else:
            raise SimConfigError(f"admission hook {self.admission.name!r} returned {verdict!r}; "
                                 f"expected allow, queue or reject")

    def _release(self, now: float) -> None:
        for req in self.admission.release(now):
            self._admit(req, now)
        expired = getattr(self.admission, "expired", None)
        if expired is not None:  # queued requests the hook gave up on (queue timeouts)
            for req, retry_after in expired(now):
                self._refuse(req, retry_after, "admission", now)

    def _refuse(self, req: TraceRequest, retry_after: float | None, reason: str, now: float,
                status: str = "rejected") -> None:
        """A refusal the client sees: it retries (``client_retry``) or it is final."""
        rec = self.records[req.index]
        rec.refused += 1
        if retry_after is not None:
            rec.refused_retry_after += 1
        retry = self.settings.client_retry
        if retry is not None:
            rng = random.Random(f"{self.settings.seed}:{req.index}:{rec.attempts}")
            delay = retry.delay(rec.attempts - 1, retry_after, rng)
            if delay is not None:
                rec.attempts += 1
                rec.status = "retrying"
                self._push(now + delay, _ARRIVE, req)
                return
        self._reject(rec, reason, now, status)

    def _admit(self, req: TraceRequest, now: float) -> None:
        s = self.settings
        self._admitted_at[req.index] = now
        resumed = self._resumed.get(req.index, 0)  # a migrated stream: prompt + its output so far
        prompt = max(1, req.input_length) + resumed
        output = max(1, req.output_length) - resumed
        too_long = s.max_model_len is not None and prompt + output > s.max_model_len
        if too_long or not self._fits(prompt, output, req.model or s.model):
            # the engine refuses it (SimEngine.generate); nothing to route
            self.admission.on_finish(req, False, now)
            self._reject(self.records[req.index], "too_large", now)
            return
        self._route_reqs[req.index] = RouteRequest(
            id=RequestId(req.id), tenant=TenantId(req.tenant or s.tenant), prompt_tokens=prompt, hashes=req.hashes,
            expected_output=output, runtime_tokens=runtime_tokens(req), cls=req.cls or s.cls,
            model=req.model or s.model, route_key=req.hashes[0] if req.hashes else None,
        )
        self._route(req, now)

    def _fits(self, prompt: int, output: int, model: str | None = None) -> bool:
        """Whether the engines of the model can run it alone (vLLM and SimEngine refuse it up front); in a
        mixed cluster it must fit on every one of them (the router may pick any)."""
        cores = [w.core for w in self.workers.values() if model is None or w.model == model] or [
            w.core for w in self.workers.values()]
        for core in cores:
            fits = getattr(core, "fits", None)
            ok = fits(prompt, output) if fits is not None else -(-(prompt + output) // self.block_size) <= core.kv_blocks
            if not ok:
                return False
        return True

    def _route(self, req: TraceRequest, now: float) -> None:
        rr = self._route_reqs[req.index]
        decision = self.router.route(rr, now)
        rec = self.records[req.index]
        if decision.worker is None:
            if now - self._admitted_at[req.index] < self.settings.no_worker_wait_s:
                self._push(now + self.settings.route_retry_s, _RETRY, req)
            else:
                del self._route_reqs[req.index]
                self.admission.on_finish(req, False, now)
                self._send(now, self._deliver_completion, Completion(
                    request_id=rr.id, tenant=rr.tenant, cls=rr.cls, model=rr.model, status=CompletionStatus.ERROR,
                    runtime_tokens=rr.runtime_tokens, reason="no_worker", ts=now))
                self._refuse(req, None, "no_worker", now)
            return
        rec.worker = decision.worker
        rec.routed = now
        if rec.first_routed is None:
            rec.first_routed = now
        rec.status = "running"
        rec.expected_cached_tokens = decision.expected_cached_tokens
        w = self.workers.get(decision.worker)
        if w is None:
            raise SimError(f"policy {decision.policy!r} chose unknown worker {decision.worker!r}")
        self._send(now, self._start_on_worker, w, req, rr)

    def _start_on_worker(self, w: _Worker, req: TraceRequest, rr: RouteRequest, now: float) -> None:
        if not w.alive:  # routed to a worker that died: nobody takes it
            self._lost(req, w, now)
            return
        w.core.add(rr.id, rr.prompt_tokens, rr.hashes, rr.expected_output, now)
        self._by_seq_id[rr.id] = req
        if not w.stepping:
            self._step(w, now)

    def _reject(self, rec: RequestRecord, reason: str, now: float, status: str = "rejected") -> None:
        rec.status = status
        rec.reason = reason
        self._done += 1
        self._end = max(self._end, now)

    # ------------------------------------------------------------------ engines
    def _step(self, w: _Worker, now: float) -> None:
        res = w.core.step(now)
        self._steps += 1
        d = res.duration
        if d <= 0.0:
            if w.core.has_work():
                raise SimError(f"engine {w.id} stalled at t={now:.3f}: {len(w.core.waiting)} waiting, "
                               f"{len(w.core.running)} running, {w.core.free} free blocks")
            w.stepping = False
            return
        w.stepping = True
        w.in_step = {seq.id: seq for seq in res.finished}
        if now < self._window_end and now + d > self._window_start:
            w.busy_window += min(now + d, self._window_end) - max(now, self._window_start)
        self._push(now + d, _STEP_END, w, res)

    def _step_end(self, w: _Worker, res: StepResult, now: float) -> None:
        if not w.alive:  # it died during the step: nothing it computed is reported
            w.stepping = False
            return
        # ``stepping`` stays set until its results are handled: a completion below can release
        # queued requests at the door (admission on_finish), routed to this very worker at once;
        # they join its *next* step. Cleared first, each of them started a second step beside the
        # one below, and an engine behind a queueing admission ran two steps at a time (TPOTs
        # under one step's time for half the requests of burst under natsched and llm-d)

        # the tokens after each sequence's first, each one step after its previous: what the
        # agent's DecodeProgress adds up from the engine's output stream
        later = sum(1 for _, index in res.tokens if index > 0)
        w.decode_tokens += later
        w.decode_s += later * res.duration
        if res.removed:
            self._publish_cache(w, "removed", res.removed, now)
        if res.stored:
            self._publish_cache(w, "stored", res.stored, now)
        if res.host_removed:
            self._publish_cache(w, "removed", res.host_removed, now, "host")
        if res.host_stored:
            self._publish_cache(w, "stored", res.host_stored, now, "host")
        for seq in res.finished:
            self._finish(w, seq, now)
        w.stepping = False
        if w.core.has_work():
            self._step(w, now)

    def _finish(self, w: _Worker, seq, now: float) -> None:
        req = self._by_seq_id.pop(seq.id)
        rr = self._route_reqs.pop(req.index)
        rec = self.records[req.index]
        rec.status = "ok"
        first = seq.first_token_at
        # a request re-run after its worker died (rescued, or retried by its client) streamed its
        # first token on the attempt that died: that is when the client saw it
        rec.first_token = first if rec.first_token is None or first is None else min(rec.first_token, first)
        rec.finish = now
        rec.cached_tokens = seq.cached_tokens
        self._done += 1
        self._end = now
        started = rec.routed + self.settings.net_delay_s
        ttft = first - started if first is not None else None
        tpot = (now - first) / (seq.generated - 1) if first is not None and seq.generated > 1 else None
        self._send(now, self._deliver_completion, Completion(
            request_id=rr.id, tenant=rr.tenant, cls=rr.cls, model=rr.model, status=CompletionStatus.OK,
            runtime_tokens=rr.runtime_tokens, worker=w.id, finish_reason="length", prompt_tokens=seq.prompt_tokens,
            cached_tokens=seq.cached_tokens, output_tokens=seq.generated, ttft=ttft, tpot=tpot, e2e=now - rec.arrival,
            expected_cached_tokens=rec.expected_cached_tokens, ts=now))
        self.admission.on_finish(req, True, now)
        self._release(now)

    # ------------------------------------------------------------------ cluster changes
    def _worker_event(self, ev: WorkerEvent, now: float) -> None:
        if ev.kind == "add":
            w = self._new_worker(ev.spec or WorkerSpec(self.profile, self.settings.model), now)
            self._publish_cache(w, "snapshot", [], now)
            self._heartbeat(w, now)
            self._push(now + self.settings.hb_interval, _HEARTBEAT, w)
            log.info("worker %s added at t=%.1f", w.id, now)
        else:
            w = self.workers.get(WorkerId(ev.worker))
            if w is not None and not w.alive and ev.kind == "slow" and ev.factor == 1.0:
                return  # a slowdown's end after its worker died: nothing left to speed up
            if w is None or not w.alive:
                raise SimConfigError(f"{ev.kind} event at {ev.at:g}s: no live worker {ev.worker!r}; "
                                     f"workers: {', '.join(self.workers)}")
            if ev.kind == "kill":
                self._kill(w, now)
            elif ev.factor == 1.0:  # the end of a slowdown
                w.core.set_speed(1.0)
            else:
                w.core.set_speed(ev.factor)  # the engines' own speed factor (SimCore.set_speed)
                log.info("worker %s slowed to %.0f%% at t=%.1f", w.id, 100 * ev.factor, now)
                if ev.duration_s is not None:
                    back = dataclasses.replace(ev, at=ev.at + ev.duration_s, factor=1.0, duration_s=None)
                    self._push(now + ev.duration_s, _WORKER_EVENT, back)
        hook = getattr(self.admission, "on_cluster_change", None)
        if hook is not None:
            hook(now)

    def _kill(self, w: _Worker, now: float) -> None:
        """The worker stops: no more steps, heartbeats or reports; what it held is lost on it."""
        w.alive = False
        # everything it held, including sequences that finished inside the step it was running
        # (their completions were never published)
        mine = [sid for sid, req in self._by_seq_id.items() if self.records[req.index].worker == w.id]
        lost = [self._by_seq_id.pop(sid) for sid in mine]
        streamed: list[bool] = []  # whether its client has seen output of this attempt
        generated: list[int] = []  # ... and how many tokens of it
        for sid, req in zip(mine, lost):  # first tokens it streamed before it died were seen
            seq = w.core.seqs.get(sid) or w.in_step.get(sid)
            first = seq.first_token_at if seq is not None else None
            rec = self.records[req.index]
            streamed.append(first is not None and first <= now)
            generated.append(seq.generated if seq is not None and streamed[-1] else 0)
            if streamed[-1] and rec.first_token is None:
                rec.first_token = first
        w.core.waiting.clear()
        w.core.running.clear()
        w.core.seqs.clear()
        log.info("worker %s killed at t=%.1f with %d request(s) on it", w.id, now, len(lost))
        for req, had_output, n in zip(lost, streamed, generated):
            self._lost(req, w, now, had_output, n)

    def _lost(self, req: TraceRequest, w: _Worker, now: float, streamed: bool = False, generated: int = 0) -> None:
        """A request that died with ``w``: rescued by the scheduler (``rescue_s``; only while its
        client has seen no output of this attempt, ``streamed``: else :meth:`_stream_broken`
        once the rescue tells the producer) or failed to the client."""
        rr = self._route_reqs[req.index]
        rec = self.records[req.index]
        self._send(now, self._deliver_completion, Completion(
            request_id=rr.id, tenant=rr.tenant, cls=rr.cls, model=rr.model, status="error", worker=w.id,
            runtime_tokens=rr.runtime_tokens, reason="worker_lost", ts=now))
        rescue = self.settings.rescue_s
        if rescue is not None and not streamed:
            rec.rescued += 1
            rec.status = "queued"
            rr.avoid = rr.avoid | {w.id}
            self._admitted_at[req.index] = now + rescue
            self._push(now + rescue, _RETRY, req)
            return
        del self._route_reqs[req.index]
        if rescue is not None:  # the producer hears of it from the rescue: rerouted, at lease expiry
            self._push(now + rescue, _DELIVER, self._stream_broken, (req, generated))
            return
        self.admission.on_finish(req, False, now)
        self._refuse(req, None, "worker_lost", now, status="failed")

    def _stream_broken(self, req: TraceRequest, generated: int, now: float) -> None:
        """natsched's producer is told ``rerouted`` for a stream with ``generated`` tokens out: it
        cancels the re-run (the reservation is released) and migrates the stream (``migrate``: a
        new try through admission, prompt + the output so far, the rest to generate) or fails it."""
        self.admission.on_finish(req, False, now)
        rec = self.records[req.index]
        done = self._resumed.get(req.index, 0) + generated
        if rec.migrated < self.settings.migrate and done < max(1, req.output_length):
            self._resumed[req.index] = done
            rec.migrated += 1
            rec.attempts += 1
            self._arrive(req, now)
            return
        self._resumed.pop(req.index, None)  # a retry starts over
        self._refuse(req, None, "worker_lost", now, status="failed")

    # ------------------------------------------------------------------ reports
    def _publish_cache(self, w: _Worker, kind: str, hashes: list[int], now: float, tier: str | None = None) -> None:
        w.kv_seq += 1
        ev = CacheEvent(worker=w.id, seq=w.kv_seq, kind=kind, ts=now, hashes=list(hashes), block_size=self.block_size,
                        tier=tier)
        self._send(now, self._deliver_cache_event, w, ev)

    def _snapshot(self, w: _Worker, now: float) -> None:
        """A GPU snapshot, then (with a host tier) the host tier's: what the agent publishes."""
        self._publish_cache(w, "snapshot", w.core.cached_hashes(), now)
        if w.core.host_blocks:
            self._publish_cache(w, "snapshot", list(w.core.host), now, "host")

    def _deliver_cache_event(self, w: _Worker, ev: CacheEvent, now: float) -> None:
        if not self.router.on_cache_event(ev, now):
            # the router service answers a gap with Control(snapshot); the agent then publishes one
            self._snapshot(w, now)

    def _deliver_completion(self, c: Completion, now: float) -> None:
        self.router.on_completion(c, now)

    def _snapshots(self, now: float) -> None:
        """After each router tick (as the service does): workers it wants a snapshot from publish one."""
        pop = getattr(self.router, "pop_snapshot_requests", None)
        if pop is None:
            return
        for wid in pop():
            w = self.workers.get(wid)
            if w is not None:
                self._send(now, self._control_snapshot, w)

    def _control_snapshot(self, w: _Worker, now: float) -> None:
        self._publish_cache(w, "snapshot", w.core.cached_hashes(), now)

    def _heartbeat(self, w: _Worker, now: float) -> None:
        """WorkerAgent._heartbeat: engine stats, the backoff rule, then the message."""
        st = w.engine.stats()
        if w.backoff is not None:
            active = w.backoff.update(st, now)
            if active != (w.state == "backoff"):
                w.state = "backoff" if active else "healthy"
                self.backoff_changes += 1
        w.hb_seq += 1
        hb = Heartbeat(
            worker=w.id, seq=w.hb_seq, ts=now, state=w.state, model=w.model,
            running=st.running, waiting=st.waiting, kv_used_blocks=st.kv_used_blocks,
            kv_total_blocks=st.kv_total_blocks, runtime_tokens=st.runtime_tokens,
            capacity_tokens=st.capacity_tokens, queued_prefill_tokens=st.queued_prefill_tokens,
            block_size=self.block_size, started_at=w.joined, interval=self.settings.hb_interval, kv_seq=w.kv_seq,
            inflight=list(w.core.seqs), deployment=w.deployment,
            decode_tokens=w.decode_tokens, decode_s=w.decode_s,
        )
        w.decode_tokens, w.decode_s = 0, 0.0
        self._send(now, self.router.on_heartbeat, hb)
        hook = getattr(self.admission, "on_heartbeat", None)  # the admitter reads heartbeats too
        if hook is not None:
            self._send(now, hook, hb)


def simulate(trace: Trace, settings: SimSettings | None = None, admission: AdmissionHook | None = None,
             progress: ProgressFn | None = None) -> SimResult:
    """Run one policy over ``trace`` (see :class:`Simulator`)."""
    return Simulator(trace, settings, admission=admission, progress=progress).run()
