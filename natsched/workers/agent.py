"""The worker agent: the bus side of one engine.

It takes assignments from its own subject ``work.<id>`` through a durable JetStream consumer
(max ack pending = its concurrency, so a restarted worker loses nothing), runs them on the
engine, streams tokens to each producer, publishes one completion per request, and reports
load (heartbeats) and cache contents (sequenced cache events) for the admitter and router.

Its own state, announced in every heartbeat (only ``healthy`` workers get new work):

- ``backoff`` — set by the agent itself while the engine is overloaded (KV nearly full, a
  preemption storm; :mod:`natsched.workers.backoff` has the thresholds and the hysteresis); it keeps
  running what it has and returns to ``healthy`` when the pressure is gone;
- ``backoff`` / ``quiescing`` while an engine behind a network hop (``vllm serve``:
  :mod:`natsched.workers.vllm_server`) does not answer: backoff at once, quiescing once it has
  been silent ``unreachable_leave_s`` (it takes nothing; what it ran ended with
  ``server_unavailable``), and ``healthy`` again by itself when the server answers;
- ``quiescing`` — after ``drain`` (``natsched worker drain ID``) or when the engine died
  (``failure`` says why): it takes nothing new, finishes (or fails, reported) what it runs,
  then :meth:`WorkerAgent.wait_drained` returns and the process leaves; :meth:`WorkerAgent.stop`
  sends a last heartbeat with no in-flight requests and a ``cleared`` cache event.

Capacity (``capacity_tokens`` in heartbeats): the operator's setting, else a calibration stored
for (model, deployment) in bucket ``workers`` (:mod:`natsched.workers.calibrate`), else the engine's KV size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from natsched.wire import subjects as S
from natsched.wire import msgids as M
from natsched.wire.blocks import estimate_prefill_tokens, request_block_hashes
from natsched.bus.aio import RECANCEL_S
from natsched.bus.connection import Bus, ConsumerSpec, Delivery, transport_failure
from natsched.bus.metrics import watch as watch_bus
from natsched.wire.errors import MessageError
from natsched.wire.schema import (Assignment, CacheEvent, Completion, CompletionStatus, Control, Heartbeat, Reply,
                                  ReplyKind, ReplyStatus, ServedModel, WorkerId)
from natsched.workers.backoff import BackoffMonitor, BackoffSettings
from natsched.workers.calibrate import load_calibration
from natsched.workers.engine import UNREACHABLE_LEAVE_S, Engine, EngineOutput, EngineRequest, EngineStats
from natsched.workers.errors import RunTimeout
from natsched.workers.limits import DEADLINE_EXCEEDED, limited
from natsched import tracing
from natsched.workers.metrics import WorkerMetrics
from natsched.workers.progress import DecodeProgress
from natsched.workers.recent import CANCEL_MEMORY_MAX, CANCEL_MEMORY_S, RecentIds

log = logging.getLogger(__name__)

#: a copy of a finished request's message comes back when its ack was lost (e.g. during a NATS
#: leader election): after ack_wait (30 s), up to max_deliver (3) times, so within about 90 s.
#: Three minutes covers that; at 250 requests/s a worker holds ~45k ids (~7 MiB), then no more.
FINISHED_MEMORY_S = 180.0
FINISHED_MEMORY_MAX = 100_000
#: handed-over attempts remembered (Control ``handover``): a predecessor leaves at most its
#: max_ack_pending (the concurrency) un-acked, so this is many restarts' worth
HANDOVER_MEMORY = 10_000


@dataclass
class WorkerSettings:
    id: str
    model: str = "default"
    concurrency: int = 64  # max un-acked assignments = requests running or queued in the engine
    heartbeat_interval_s: float = 1.0
    ack_wait_s: float = 30.0  # kept alive with in_progress while a request runs
    capacity_tokens: int | None = None  # runtime-token capacity; default: calibration, else the engine's KV size
    deployment: str | None = None  # calibration lookup key part; default: the engine's ``deployment``
    use_calibration: bool = True
    calibration_timeout_s: float = 3.0
    backoff: BackoffSettings = field(default_factory=BackoffSettings)
    metrics_port: int | None = None  # serve Prometheus metrics here (natsched.workers.metrics)
    unreachable_leave_s: float = UNREACHABLE_LEAVE_S  # a silent engine server: the worker leaves until it is back


class WorkerAgent:
    def __init__(self, bus: Bus, engine: Engine, settings: WorkerSettings) -> None:
        self.bus = bus
        self.engine = engine
        self.settings = settings
        self.id = WorkerId(settings.id)
        self.state = "healthy"
        self.started_at = time.time()
        self.inflight: dict[str, asyncio.Task] = {}
        self._hb_seq = 0
        self._kv_seq = 0
        self._stopped = asyncio.Event()
        self.capacity_tokens: int | None = settings.capacity_tokens
        self.capacity_source = "settings" if settings.capacity_tokens else "engine"
        self.failure: str | None = None  # why the engine can no longer serve
        self.drained_by: str | None = None  # who asked for the drain (a supervisor does not restart it)
        self.backoff = BackoffMonitor(settings.backoff)
        self.metrics = WorkerMetrics(settings.id, settings.model)
        watch_bus(self.metrics.registry, self.bus)  # its records lost, reconnects (natsched.bus.metrics)
        self.cancelled = RecentIds(CANCEL_MEMORY_S, CANCEL_MEMORY_MAX)  # its producer gave up on it
        self.finished = RecentIds(FINISHED_MEMORY_S, FINISHED_MEMORY_MAX)  # completed here: never run again
        self._redelivered: set[str] = set()  # running from a WORK message delivered before (to us or our predecessor)
        self._progress: dict[str, tuple[Delivery, float]] = {}  # running: its message, when the server last heard
        self.predecessor_seq = 0  # set at start: see _predecessor_seq
        self._reported: set[str] = set()  # running, and its completion is stored already
        self.completion_retries = 0  # completions that outlived a publish budget, waiting for the bus
        self._over: dict[str, int] = {}  # running past its reservation: runtime tokens held now (heartbeats)
        self._decode = DecodeProgress()  # token gaps since the last heartbeat (the router's early slowness signal)
        self._away = False  # quiescing because the engine server does not answer (not a drain: it comes back)
        self._epoch = 0.0  # the engine's cache epoch last announced (engines that have one)
        self._tenant_of: dict[str, str] = {}  # running: whose request it is (a cancel must name that tenant)
        self._produced: dict[str, tuple[int, int]] = {}  # running: (prompt, output) tokens so far
        self._stopped_runs: set[str] = set()  # running, cancelled, and the cancel has reached its task
        #: running and cancelled: (seconds the cancel travelled, tokens produced when it arrived)
        self._cancel_seen: dict[str, tuple[float | None, int]] = {}
        self._stoppers: set[asyncio.Task] = set()
        #: request -> the newest attempt an admitter took over from this id (Control ``handover``)
        self._handed_over: dict[str, int] = {}
        self._attempt_of: dict[str, int] = {}  # running: the attempt its assignment carries
        self._traces: dict[str, _RunTrace] = {}  # running, traced: its span and token times
        self._tail = tracing.TailTracker()  # the p99 above which a run's token timing is kept

    async def start(self) -> None:
        await self.engine.start()
        self.engine.set_cache_listener(self._on_cache_change)
        await self._load_calibration()
        await self.bus.subscribe(S.control(self.id), self._on_control)
        self.predecessor_seq = await self._predecessor_seq()
        await self.bus.subscribe(S.CANCELS_ALL, self._on_tenant_cancel)
        spec = ConsumerSpec(
            stream=S.STREAM_WORK,
            durable=S.worker_consumer(self.id),
            filter_subject=S.work(self.id),
            ack_wait_s=self.settings.ack_wait_s,
            max_deliver=3,
            max_ack_pending=self.settings.concurrency,
            batch=self.settings.concurrency,
        )
        await self.bus.consume(spec, self._on_assignment, source="worker")
        self.bus.spawn(self._heartbeat_loop(), "heartbeat")
        self.bus.spawn(self._keep_alive_loop(), "keep-alive")
        await self._snapshot()
        await self._heartbeat()
        if self.settings.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.settings.metrics_port, registry=self.metrics.registry)
        log.info("worker %s ready (model %s, concurrency %d)", self.id, self.settings.model, self.settings.concurrency)

    async def _predecessor_seq(self) -> int:
        """Where this id's durable consumer stands before this instance pulls anything: what it
        delivered up to and has not acked is a predecessor's unfinished work (work-queue retention
        deletes what is acked). A restart inside the lease renews the lease, so nothing else would
        rescue that work before its ack wait; the heartbeats say so, and the admitters rescue it."""
        try:
            acked, delivered = await self.bus.consumer_progress(S.STREAM_WORK, S.worker_consumer(self.id))
        except Exception as exc:  # no consumer yet (a first start), or the server is slow: nothing to hand over
            log.debug("worker %s: no predecessor consumer state (%s)", self.id, exc)
            return 0
        if delivered <= acked:
            return 0
        log.warning("worker %s restarted: its predecessor left work delivered up to WORK sequence %d un-acked "
                    "(acked up to %d); the admitters rescue it", self.id, delivered, acked)
        return delivered

    async def stop(self) -> None:
        """Leave: cancel what still runs, say so (last heartbeat, cache cleared), stop the engine."""
        for task in list(self.inflight.values()):
            task.cancel()
        await asyncio.gather(*self.inflight.values(), return_exceptions=True)
        self.state = "quiescing"
        try:
            await self._heartbeat()
            await self._publish_cache("cleared", [])
            await self.bus.flush(timeout=2)
        except Exception as exc:  # the bus may already be gone; leaving anyway
            log.warning("worker %s could not announce its exit: %s", self.id, exc)
        await self.engine.stop()
        log.info("worker %s stopped%s", self.id, f" (engine failure: {self.failure})" if self.failure else "")

    async def wait_drained(self) -> None:
        await self._stopped.wait()

    # --- assignments ------------------------------------------------------------------
    async def _on_assignment(self, d: Delivery) -> None:
        received = time.time()  # the moment the scheduler's hand-off ends (Reply.received_at)
        assignment = Assignment.decode(d.data)  # MessageError -> dead letter (by the Bus)
        rid = assignment.request.id
        if assignment.worker != self.id:  # its fence names another worker: its completion could not count
            self.metrics.misrouted.inc()
            log.error("request %s: assignment names worker %s, not %s; refused, not run", rid, assignment.worker,
                      self.id)
            await self.bus.dead_letter_raw(d.subject, d.data, "worker", "misrouted",
                                           f"assignment for {assignment.worker} delivered to {self.id}")
            await d.ack()
            return
        if rid in self.inflight:
            return  # a redelivery of something we are running: its task acks it
        if rid in self.finished:  # finished here, its ack was lost: ack the copy, run nothing
            await d.ack()
            log.info("request %s redelivered to %s after it finished; acked, not run again", rid, self.id)
            return
        if self.state == "quiescing":
            await d.nak(delay=1.0)  # not ours to run any more; redelivered to us or re-routed later
            return
        if self._is_cancelled(assignment.request):  # its producer gave up before it reached us: run nothing
            self.metrics.cancelled.inc()
            await self._finish(assignment, _CANCELLED, time.time(), None, received=received)
            await d.ack()
            return
        if assignment.attempt <= self._handed_over.get(rid, -1):  # an admitter rescued it elsewhere
            await d.ack()
            log.info("request %s attempt %d handed over to the admitters; acked, not run", rid, assignment.attempt)
            return
        self._tenant_of[rid] = assignment.request.tenant
        self._attempt_of[rid] = assignment.attempt
        self.inflight[rid] = asyncio.create_task(self._run(assignment, d, received), name=f"run:{rid}")

    async def _run(self, a: Assignment, d: Delivery, received: float) -> None:
        req = a.request
        started = time.time()
        self._progress[req.id] = (d, time.monotonic())
        if d.num_delivered > 1:
            self._redelivered.add(req.id)
        self.metrics.dispatch_wait.observe(max(0.0, started - a.routed_at))
        log.info("request %s running on %s", req.id, self.id)
        span = tracing.start("natsched.worker", d.headers, req.id, {"natsched.worker": self.id,
                             "natsched.model": req.model, "natsched.attempt": a.attempt})
        if span is not None:
            self._traces[req.id] = _RunTrace(span, started)
        try:
            if req.deadline is not None and started > req.deadline:  # expired on its way here: not run
                self.metrics.timeouts.labels(DEADLINE_EXCEEDED).inc()
                final = EngineOutput(0, finished=True, finish_reason="error", error=DEADLINE_EXCEEDED)
                await self._finish(a, final, started, None, received=received)
            else:
                await self._generate(a, started, received=received)
            await d.ack()
        except asyncio.CancelledError:
            if not self._is_cancelled(req):
                raise  # the agent is stopping: left un-acked, redelivered elsewhere
            self._stopped_runs.add(req.id)  # (before any await) _stop_run stops cancelling
            task = asyncio.current_task()
            while task.cancelling():  # our own cancel, perhaps sent more than once: the request ends, reported
                task.uncancel()
            await self._finish(a, self._cancelled_output(req.id), started, None, received=received)
            await d.ack()
        except RunTimeout as exc:  # past its TTFT, idle or total limit: stopped, reported with what it produced
            log.info("request %s stopped on %s: %s", req.id, self.id, exc.reason)
            self.metrics.timeouts.labels(exc.reason).inc()
            await self._finish(a, self._cancelled_output(req.id, exc.reason), started, None, received=received)
            await d.ack()
        except Exception as exc:  # engine or bus failure: recorded as an outcome, never dropped
            if req.id in self._reported:  # its outcome is out; only the ack failed: a copy finds it finished
                log.warning("request %s: ack failed after its outcome was stored (%s)", req.id, exc)
                return
            # the bus failing (a server restarting) is not the engine's fault, and says so
            reason = "bus_unavailable" if transport_failure(exc) else "engine_error"
            log.exception("request %s failed on %s (%s)", req.id, self.id, reason)
            await self._finish(a, EngineOutput(0, finished=True, finish_reason="error", error=f"{reason}: {exc}"),
                               started, None, received=received)
            await d.ack()
        finally:
            self._progress.pop(req.id, None)
            self._over.pop(req.id, None)
            self._decode.close(req.id)
            self._end_trace(req.id, None)  # still open: it ended without _finish (the agent stopping)
            self._produced.pop(req.id, None)
            self._stopped_runs.discard(req.id)
            self._tenant_of.pop(req.id, None)
            self._attempt_of.pop(req.id, None)
            self._cancel_seen.pop(req.id, None)
            self._redelivered.discard(req.id)
            self._reported.discard(req.id)
            if d.settled:  # its outcome is published and it was acked: a copy must not run it again
                self.finished.add(req.id)
            self.inflight.pop(req.id, None)
            self._check_engine()
            if self.state == "quiescing" and not self.inflight and not self._away:
                self._stopped.set()

    async def _generate(self, a: Assignment, started: float, *, received: float) -> None:
        req = a.request
        resumed = len(req.resume_token_ids or ())  # a migrated stream: continue after its output
        engine_req = EngineRequest(
            id=req.id,
            prompt_tokens=estimate_prefill_tokens(req),
            hashes=request_block_hashes(req, self.engine.block_size),
            max_tokens=req.max_tokens - resumed,
            prompt=((req.system_prompt or "") + (req.prompt or "")) if req.prompt is not None else None,
            prompt_token_ids=req.prompt_token_ids,
            resume_token_ids=req.resume_token_ids,
            output_tokens_hint=None if req.expected_output_tokens is None else max(1, req.expected_output_tokens - resumed),
            model=req.model,
            expected_cached_tokens=a.expected_cached_tokens,
        )
        first_at = None
        texts: list[str] = []
        produced = 0
        async for out in limited(self.engine.generate(engine_req), req, _is_token):
            if first_at is None and not out.error:
                first_at = time.time()
            # runtime tokens as the admitter counts them (prefill + KV held), generated ones included:
            # past the reservation, the next heartbeat asks the admitters to grow it
            # (engines give totals on the last output only: before it, the index counts the steps)
            held = 2 * (out.prompt_tokens or engine_req.prompt_tokens) + max(out.output_tokens, out.index + 1)
            if held > a.runtime_tokens:
                self._over[req.id] = held
            n = (len(out.token_ids) if out.token_ids else int(bool(out.text))) if not out.error else 0
            self._decode.output(req.id, n, time.monotonic())
            if not out.finished:  # what a cancel reports as really produced (the final output has the totals)
                produced += n
                self._produced[req.id] = (engine_req.prompt_tokens, produced)
            trace = self._traces.get(req.id)
            if trace is not None and _is_token(out):
                trace.token_at(time.time())
            texts.append(out.text)
            if req.stream and req.reply and (out.text or out.token_ids) and not out.error:
                await self.bus.publish(S.worker_reply(req.reply, self.id),
                                       Reply(request_id=req.id, kind=ReplyKind.TOKEN, text=out.text,
                                             token_ids=out.token_ids, index=out.index, worker=self.id,
                                             fence=a.reply_fence or None, attempt=a.attempt))
            if out.finished:
                await self._finish(a, out, started, first_at, "".join(texts), received=received)
                return
        raise RuntimeError("engine stream ended without a final output")

    async def _finish(
        self, a: Assignment, out: EngineOutput, started: float, first_at: float | None, text: str = "",
        *, received: float | None = None,
    ) -> None:
        req, now = a.request, time.time()
        ok = out.error is None
        ttft = (first_at - started) if first_at else None
        tpot = ((now - first_at) / (out.output_tokens - 1)) if first_at and out.output_tokens > 1 else None
        completion = Completion(
            request_id=req.id, tenant=req.tenant, cls=req.cls, model=req.model,
            status=CompletionStatus.OK if ok else CompletionStatus.ERROR,
            runtime_tokens=a.runtime_tokens, worker=self.id, finish_reason=out.finish_reason,
            reason=None if ok else out.error.split(":")[0], prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens, output_tokens=out.output_tokens, ttft=ttft, tpot=tpot,
            e2e=now - (req.created or started), expected_cached_tokens=a.expected_cached_tokens, ts=now,
            attempt=a.attempt, fence=a.fence,  # the assignment's proof: the admitter checks it
        )
        seen = self._cancel_seen.get(req.id)
        if seen is not None:  # what the cancel path cost: its transit, and the run after it arrived
            completion.cancel_transit_s = seen[0]
            completion.tokens_after_cancel = max(0, out.output_tokens - seen[1])
        ack = await self._publish_completion(completion)
        self._reported.add(req.id)
        answered = False
        if ack.duplicate:
            # another run's completion is stored: that one is counted. Its worker answered too. If
            # that was this worker id before a restart (this copy is a redelivery: its ack was lost),
            # the producer took that answer, and a second one is not sent. After a rescue (another
            # worker, a first delivery here) the reply goes out: a producer told "rerouted" ignores
            # the other run's, and would otherwise wait in vain
            answered = req.id in self._redelivered
            log.warning("request %s ran twice; its completion from another run is the one kept%s", req.id,
                        " (answered then)" if answered else "")
            self.metrics.duplicate_runs.inc()
        self._observe(completion)
        if req.reply and not answered:
            # where the time before the engine went: the scheduler's stamps and this worker's receipt
            stamps = dict(admitted_at=a.admitted_at, routed_at=a.routed_at, received_at=received)
            if ok:
                reply = Reply(request_id=req.id, kind=ReplyKind.RESULT, text=None if req.stream else text,
                              worker=self.id, finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                              cached_tokens=out.cached_tokens, output_tokens=out.output_tokens, ttft=ttft, tpot=tpot,
                              **stamps)
            else:
                reason, _, message = (out.error or "").partition(": ")
                reply = Reply(request_id=req.id, kind=ReplyKind.ERROR, status=ReplyStatus.FAILED,
                              reason=reason or "engine_error", message=message or out.error, worker=self.id, **stamps)
            reply.fence, reply.attempt = a.reply_fence or None, a.attempt  # the producer checks them
            await self.bus.publish(S.worker_reply(req.reply, self.id), reply)
        log.info("request %s %s on %s: %d prompt (%d cached), %d out", req.id, completion.status, self.id,
                 out.prompt_tokens, out.cached_tokens, out.output_tokens)
        self._end_trace(req.id, completion)

    def _end_trace(self, rid: str, c: Completion | None) -> None:
        """The run's spans: first token, done, and token timing when it is kept (sampled, p99, error)."""
        trace = self._traces.pop(rid, None)
        if trace is None:
            return
        now = time.time()
        failed = c is None or c.status != CompletionStatus.OK
        attrs: dict = {}
        if c is not None:
            attrs = {"natsched.status": str(c.status), "natsched.reason": c.reason,
                     "natsched.finish_reason": c.finish_reason, "natsched.prompt_tokens": c.prompt_tokens,
                     "natsched.cached_tokens": c.cached_tokens, "natsched.output_tokens": c.output_tokens}
        why = tracing.keep_token_timing(self._tail, now - trace.started, failed)
        if why is not None:
            attrs["natsched.tokens.kept"] = why
            attrs["natsched.tokens.offsets_ms"] = tracing.token_offsets_ms(trace.started, trace.times)
        trace.close(rid, now)
        tracing.end(trace.span, attrs, error=(c.reason or "error") if c is not None and failed else
                    ("stopped" if c is None else None))

    async def _publish_completion(self, c: Completion):
        """Publish a completion until it is stored: a server away (restarting) for longer than the
        publish budget must not turn a request that ran into an error, nor leave its reservation
        held. The request stays in flight meanwhile (heartbeats list it; a copy redelivered after
        the ack wait finds it running here)."""
        delay = 0.2
        while True:
            try:
                # on its own subject, the assignment's fence in its msg id (natsched.wire.fence)
                return await self.bus.jpublish(S.completion(c.tenant, c.worker or self.id), c,
                                               msg_id=M.completion(c.request_id, c.fence))
            except Exception as exc:
                if not transport_failure(exc) or self.bus.closing:
                    raise
                self.completion_retries += 1
                log.warning("completion of %s not stored yet (%s: %s); retrying", c.request_id,
                            type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    def _observe(self, c: Completion) -> None:
        m = self.metrics
        m.requests.labels(c.status, c.reason or "").inc()
        if c.status != CompletionStatus.OK:
            return
        m.prompt_tokens.inc(c.prompt_tokens)
        m.cached_tokens.inc(c.cached_tokens)
        m.output_tokens.inc(c.output_tokens)
        for hist, value in ((m.ttft, c.ttft), (m.tpot, c.tpot), (m.e2e, c.e2e)):
            if value is not None:
                hist.observe(value)

    async def _keep_alive_loop(self) -> None:
        """One loop for every running request (not a task and a timer each, at hundreds a second):
        a message running longer than a third of the ack wait is marked in progress, so the server
        hears about it at least every half ack wait and never redelivers a request that runs."""
        every = self.settings.ack_wait_s / 3
        while True:
            await asyncio.sleep(every / 2)
            now = time.monotonic()
            for rid, (d, last) in list(self._progress.items()):
                if now - last >= every and not d.settled:
                    self._progress[rid] = (d, now)
                    try:
                        await d.in_progress()
                    except Exception as exc:  # the connection is reconnecting: the next round tries again
                        log.warning("could not mark %s in progress: %s", rid, exc)

    # --- reports --------------------------------------------------------------------------
    def _on_cache_change(self, kind: str, hashes: list, tier: str | None = None) -> None:
        self.bus.spawn(self._publish_cache(kind, hashes, None if tier == "gpu" else tier), "cache-event")

    async def _snapshot(self) -> None:
        """Everything cached: the GPU tier's blocks, then the host tier's when the engine has one."""
        await self._publish_cache("snapshot", self.engine.cached_hashes())
        host = getattr(self.engine, "host_hashes", None)
        if host is not None:
            hashes = host()
            if hashes:
                await self._publish_cache("snapshot", hashes, "host")

    async def _publish_cache(self, kind: str, hashes: list, tier: str | None = None) -> None:
        self._kv_seq += 1
        ev = CacheEvent(worker=self.id, seq=self._kv_seq, kind=kind, ts=time.time(), hashes=list(hashes),
                        block_size=self.engine.block_size, tier=tier)
        await self.bus.publish(S.cache_events(self.id), ev)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await self._heartbeat()
            except Exception:
                log.exception("heartbeat failed")

    def _started_at(self) -> float:
        """This worker's start, or the start of the engine's cache it reports, if later: a server
        that restarted (or whose events were lost) makes the router drop the old claims."""
        epoch = getattr(self.engine, "epoch", None) or 0.0
        return max(self.started_at, epoch)

    async def _heartbeat(self) -> None:
        st = self.engine.stats()
        self._update_state(st)
        started_at = self._started_at()
        new_epoch = started_at != self._epoch and self._epoch != 0.0
        self._epoch = started_at
        served = getattr(self.engine, "served_models", None)
        self._hb_seq += 1
        decode_tokens, decode_s = self._decode.take()
        hb = Heartbeat(
            worker=self.id, seq=self._hb_seq, ts=time.time(), state=self.state, model=self.settings.model,
            running=st.running, waiting=st.waiting, kv_used_blocks=st.kv_used_blocks,
            kv_total_blocks=st.kv_total_blocks, runtime_tokens=st.runtime_tokens,
            capacity_tokens=self.capacity_tokens or st.capacity_tokens,
            queued_prefill_tokens=st.queued_prefill_tokens, block_size=self.engine.block_size,
            started_at=started_at, interval=self.settings.heartbeat_interval_s, kv_seq=self._kv_seq,
            inflight=list(self.inflight), served=served() if served is not None else self._own_card(),
            deployment=self.deployment,
            predecessor_seq=self.predecessor_seq, over=dict(self._over),
            decode_tokens=decode_tokens, decode_s=decode_s,
        )
        await self.bus.publish(S.heartbeat(self.id), hb)
        if new_epoch:  # after the heartbeat that resets the router's view: what the engine holds now
            log.warning("worker %s: its engine's cache began anew; snapshot sent", self.id)
            await self._publish_cache("snapshot", self.engine.cached_hashes())
        m = self.metrics
        m.running.set(st.running)
        m.waiting.set(st.waiting)
        m.kv_used.set(st.kv_used_blocks)
        m.kv_total.set(st.kv_total_blocks)
        m.runtime_tokens.set(st.runtime_tokens)
        m.capacity_tokens.set(hb.capacity_tokens)
        m.set_engine_counters(st.preemptions, st.prefix_cache_queries, st.prefix_cache_hits)
        m.set_state(self.state)

    # --- state ----------------------------------------------------------------------------
    def _check_engine(self) -> None:
        """An engine that died makes the worker leave: quiescing now, gone once in-flight work ended."""
        failure = getattr(self.engine, "failure", None)
        if not failure or self.failure:
            return
        self.failure = str(failure)
        log.error("worker %s leaving: engine failed: %s", self.id, self.failure)
        self.state = "quiescing"
        if not self.inflight:
            self._stopped.set()

    def _own_card(self) -> list[ServedModel]:
        """An in-process engine's model as ``vllm serve`` would list it in ``/v1/models``: its
        ``max_model_len`` (once the engine knows it) and its ``root`` (the weights it loaded),
        so the gateway answers third-party clients with real numbers, not nulls. An engine
        server lists its own models (``served_models``)."""
        limit = getattr(self.engine, "max_model_len", 0)
        weights = getattr(getattr(self.engine, "settings", None), "model_path", None)  # a vLLM engine's
        return [ServedModel(id=self.settings.model, owned_by="vllm" if weights else "natsched",
                            root=weights or self.settings.model,
                            max_model_len=limit if isinstance(limit, int) and limit > 0 else None)]

    def _update_state(self, st: EngineStats) -> None:
        self._check_engine()
        if self._reachability(st):
            return
        if self.state not in ("healthy", "backoff"):
            return
        active = self.backoff.update(st, time.monotonic())
        new = "backoff" if active else "healthy"
        if new != self.state:
            if active:
                log.warning("worker %s backing off: %s", self.id, self.backoff.reason)
            else:
                log.info("worker %s healthy again", self.id)
            self.state = new

    def _reachability(self, st: EngineStats) -> bool:
        """An engine server that does not answer: backoff, then away (quiescing, no new work), and
        healthy again when it answers. True while that decides the state."""
        if st.unreachable_s <= 0:
            if self._away:
                self._away = False
                self.state = "healthy"
                log.info("worker %s back: its engine server answers again", self.id)
            return False
        if self.state not in ("healthy", "backoff") and not self._away:
            return True  # drained or failed: stays so
        # backoff is announced before leaving, even when a stalled heartbeat finds the server
        # silent past the leave time already: the router (and the operator) see it back off first
        if self._away or (st.unreachable_s >= self.settings.unreachable_leave_s and self.state == "backoff"):
            if not self._away:
                log.warning("worker %s leaving until its engine server is back (silent %.1fs: %s)", self.id,
                            st.unreachable_s, st.unreachable_reason)
            self._away, self.state = True, "quiescing"
        elif self.state != "backoff":
            log.warning("worker %s backing off: engine server does not answer (%s)", self.id, st.unreachable_reason)
            self.state = "backoff"
        return True

    @property
    def deployment(self) -> str | None:
        """The calibration key part (routers read the measured speed under it as a prior)."""
        return self.settings.deployment or getattr(self.engine, "deployment", None)

    async def _load_calibration(self) -> None:
        """Use a stored calibration as capacity, unless the operator gave one (never fatal)."""
        if self.capacity_tokens or not self.settings.use_calibration:
            return
        deployment = self.settings.deployment or getattr(self.engine, "deployment", None)
        if not deployment:
            return
        try:
            cal = await asyncio.wait_for(load_calibration(self.bus, self.settings.model, deployment),
                                         self.settings.calibration_timeout_s)
        except Exception as exc:  # no bucket yet, server slow: run on the engine's own figure
            log.warning("worker %s: no calibration read for %s/%s: %s", self.id, self.settings.model, deployment,
                        exc or type(exc).__name__)
            return
        if cal is not None and cal.capacity_tokens > 0:
            self.capacity_tokens, self.capacity_source = cal.capacity_tokens, f"calibration {deployment}"
            log.info("worker %s capacity %d runtime tokens from calibration %s/%s (%s)", self.id,
                     cal.capacity_tokens, self.settings.model, deployment, cal.knee_reason)

    async def _on_control(self, subject: str, data: bytes, headers: dict) -> None:
        try:
            ctl = Control.decode(data)
        except MessageError as exc:
            log.warning("ignoring bad control message on %s: %s", subject, exc)
            return
        if ctl.kind == "snapshot":
            await self._snapshot()
        elif ctl.kind == "drain":
            log.info("worker %s quiescing (drain requested by %s)", self.id, ctl.by or "?")
            self.state, self._away = "quiescing", False
            self.drained_by = ctl.by or "?"
            await self._heartbeat()
            if not self.inflight:
                self._stopped.set()
        elif ctl.kind == "cancel":
            self._cancel(ctl.request_id, ctl.by)
        elif ctl.kind == "handover":
            self._hand_over(ctl)
        elif ctl.kind == "resume":
            if self.failure:
                log.warning("worker %s cannot resume: its engine failed (%s)", self.id, self.failure)
                return
            self.state = "healthy"
            self.drained_by = None
            await self._heartbeat()
        else:
            log.warning("unknown control kind %r on %s", ctl.kind, subject)

    def _hand_over(self, ctl: Control) -> None:
        """An admitter rescues ``ctl.attempt`` of ``ctl.request_id`` (Control's docstring): never
        run it, or an older attempt, here; stop it if it already started."""
        if not ctl.request_id or ctl.attempt is None or ctl.attempt < 0:
            log.warning("worker %s: handover without a request id or attempt (from %s)", self.id, ctl.by or "?")
            return
        rid = ctl.request_id
        if len(self._handed_over) >= HANDOVER_MEMORY and rid not in self._handed_over:
            self._handed_over.pop(next(iter(self._handed_over)))  # bounded: the oldest is long rescued
        self._handed_over[rid] = max(ctl.attempt, self._handed_over.get(rid, -1))
        task = self.inflight.get(rid)
        if task is not None and self._attempt_of.get(rid, 0) <= ctl.attempt:
            log.warning("request %s attempt %d rescued by %s while it started here; stopped", rid, ctl.attempt,
                        ctl.by or "?")
            self._spawn_stop(rid, task)

    def _is_cancelled(self, req) -> bool:
        """Cancelled by its own tenant (``cancel.<tenant>.<id>``) or by an operator (control)."""
        return req.id in self.cancelled or S.cancel(req.tenant, req.id) in self.cancelled

    def _cancelled_output(self, rid: str, reason: str = "cancelled") -> EngineOutput:
        """How a cancelled (or timed-out: ``reason``) request ends: an error completion (its
        reservation is released) with that reason and the tokens it really produced (the audit and
        the usage count them)."""
        prompt, output = self._produced.get(rid, (0, 0))
        return EngineOutput(0, finished=True, finish_reason=reason, error=reason if reason != "cancelled"
                            else _CANCELLED.error, prompt_tokens=prompt, output_tokens=output)

    async def _on_tenant_cancel(self, subject: str, data: bytes, headers: dict) -> None:
        """A producer gave up on its request (``cancel.<tenant>.<id>``, every worker hears it).

        Only for a request of that tenant: the server lets a producer publish its own tenant's
        cancels only, so a cancel naming another tenant's running request is refused here. One
        for a request not here (yet) is remembered under (tenant, id), like a control cancel.
        """
        parsed = S.parse_cancel_subject(subject)
        if parsed is None:
            log.warning("worker %s: ignoring a cancel on %s", self.id, subject)
            return
        tenant, rid = parsed
        owner = self._tenant_of.get(rid)
        if owner is not None and owner != tenant:
            log.warning("worker %s: cancel of request %s by tenant %s refused: it is %s's", self.id, rid, tenant,
                        owner)
            self.metrics.cancels_refused.inc()
            return
        self.cancelled.add(subject)  # == S.cancel(tenant, rid)
        task = self.inflight.get(rid)
        if task is not None:
            self._cancel_seen.setdefault(rid, (_transit(data), self._produced.get(rid, (0, 0))[1]))
            self.metrics.cancelled.inc()
            log.info("request %s cancelled by tenant %s", rid, tenant)
            self._spawn_stop(rid, task)

    def _cancel(self, rid: str | None, by: str | None) -> None:
        """End a request whose producer went away: its task stops the engine and reports ``cancelled``.

        A cancel for a request not here yet is remembered for a while (``CANCEL_MEMORY_S``): it
        may still be in the WORK stream, and running it would spend the engine on nobody.
        """
        if not rid:
            log.warning("worker %s: cancel without a request id (from %s)", self.id, by or "?")
            return
        self.cancelled.add(rid)
        self.metrics.cancelled.inc()
        task = self.inflight.get(rid)
        log.info("request %s cancelled by %s%s", rid, by or "?", "" if task else " (not running here yet)")
        if task is not None:
            self._spawn_stop(rid, task)

    def _spawn_stop(self, rid: str, task: asyncio.Task) -> None:
        task.cancel()  # now, not a loop turn later: each turn may be an engine step for nobody
        stopper = asyncio.create_task(self._stop_run(rid, task), name=f"cancel:{rid}")
        self._stoppers.add(stopper)  # held until done (the loop keeps only weak references)
        stopper.add_done_callback(self._stoppers.discard)

    async def _stop_run(self, rid: str, task: asyncio.Task) -> None:
        """Cancel a running request's task until the cancel has reached it: on Python 3.11 a
        cancel that meets a just-finished ``wait_for`` inside the engine or the bus client is
        swallowed, and the request would run to its end for nobody (natsched.bus.aio). Once the
        task's handler has it, no more: the handler publishes the outcome, which must not be cut."""
        while True:
            await asyncio.wait({task}, timeout=RECANCEL_S)
            if task.done() or rid in self._stopped_runs:
                return
            task.cancel()


#: how a cancelled request ends: an error completion (its reservation is released) with reason ``cancelled``
_CANCELLED = EngineOutput(0, finished=True, finish_reason="cancelled", error="cancelled: the producer went away")


def _transit(data: bytes) -> float | None:
    """Seconds since a cancel's producer stamped it (one clock on one machine; else a guess), or
    None when its body does not say."""
    try:
        return max(0.0, time.time() - Control.decode(data).ts)
    except MessageError:
        return None


def _is_token(out: EngineOutput) -> bool:
    """An engine output that is a token (the first one ends the run's TTFT wait)."""
    return bool(out.text or out.token_ids) and not out.error


@dataclass
class _RunTrace:
    """A traced run: its span, when it started, when each token came (unix seconds)."""

    span: object
    started: float
    times: list[float] = field(default_factory=list)

    def token_at(self, t: float) -> None:
        self.times.append(t)

    def close(self, rid: str, now: float) -> None:
        """The two phase spans, from the times seen: run start -> first token -> the end."""
        ns = 1_000_000_000
        first = self.times[0] if self.times else now
        tracing.end(tracing.child("natsched.worker.first_token", self.span, rid, start_time_ns=int(self.started * ns)),
                    end_time_ns=int(first * ns))
        if self.times:
            tracing.end(tracing.child("natsched.worker.done", self.span, rid, {"natsched.tokens": len(self.times)},
                                      start_time_ns=int(first * ns)), end_time_ns=int(now * ns))
