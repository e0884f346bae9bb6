"""The worker agent's own states: backoff under pressure, drain, engine failure, a clean exit.

A scripted engine stands in for vLLM (its real counterpart is tested in ``test_vllm_*``); the bus
is the real test server.
"""

from __future__ import annotations

import asyncio
import time

from natsched.wire import subjects as S
from natsched.wire.schema import Assignment, CacheEvent, Completion, Control, DeadLetter, Heartbeat, Reply, WorkerId
from tests.factories.core import make_request
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.backoff import BackoffMonitor, BackoffSettings
from natsched.workers.engine import EngineOutput, EngineStats
from tests.factories.core import wait_for


class ScriptedEngine:
    """Generates ``steps`` outputs, one per ``step_s``; stats and failure are set by the test."""

    block_size = 32

    def __init__(self, steps: int = 3, step_s: float = 0.01) -> None:
        self.steps, self.step_s = steps, step_s
        self.st = EngineStats(kv_total_blocks=100, capacity_tokens=3200)
        self.failure: str | None = None
        self.gate = asyncio.Event()
        self.gate.set()
        self.listener = None
        self.stopped = False
        self.seen: list[str] = []  # ids of the requests it was asked to generate
        self.requests: list = []  # the EngineRequests themselves
        self.pause_after: int | None = None  # clear the gate once this step's output is out

    async def start(self) -> None: ...

    async def stop(self) -> None:
        self.stopped = True

    def set_cache_listener(self, fn) -> None:
        self.listener = fn

    def cached_hashes(self) -> list:
        return []

    def stats(self) -> EngineStats:
        return self.st

    async def abort(self, request_id: str) -> None: ...

    async def generate(self, request):
        self.seen.append(request.id)
        self.requests.append(request)
        for i in range(self.steps):
            await self.gate.wait()
            if self.failure:
                yield EngineOutput(i, finished=True, finish_reason="error", error=f"engine_dead: {self.failure}")
                return
            await asyncio.sleep(self.step_s)
            last = i == self.steps - 1
            yield EngineOutput(i, text=f" t{i}", token_ids=[i], finished=last, finish_reason="length" if last else None,
                               prompt_tokens=request.prompt_tokens, output_tokens=i + 1)
            if i == self.pause_after:
                self.gate.clear()


async def collect(bus, subject: str, cls):
    out: list = []

    async def on(subj, data, headers):
        out.append(cls.decode(data))

    await bus.subscribe(subject, on)
    if subject.startswith("resp."):  # a worker answers on its own sub-subject (S.worker_reply)
        await bus.subscribe(f"{subject}.*", on)
    return out


async def assign(bus, worker: str, expected_cached_tokens: int = 0, **req_fields):
    req = make_request(**req_fields)
    a = Assignment(request=req, worker=WorkerId(worker), runtime_tokens=100, admitted_at=time.time(),
                   routed_at=time.time(), expected_cached_tokens=expected_cached_tokens)
    await bus.jpublish(S.work(WorkerId(worker)), a, msg_id=req.id)
    return req


def settings(wid: str, **kw) -> WorkerSettings:
    kw.setdefault("backoff", BackoffSettings(min_backoff_s=0.2, rate_window_s=1.0))
    return WorkerSettings(id=wid, heartbeat_interval_s=0.05, **kw)


# ------------------------------------------------------------------------------ pure monitor
def test_backoff_enters_high_leaves_low_after_min_time():
    m = BackoffMonitor(BackoffSettings(kv_high=0.9, kv_low=0.7, min_backoff_s=5))
    st = EngineStats(kv_total_blocks=100, kv_used_blocks=50)
    assert not m.update(st, 0)
    st.kv_used_blocks = 92
    assert m.update(st, 1) and "kv usage" in m.reason
    st.kv_used_blocks = 80  # below high, above low: stays
    assert m.update(st, 2)
    st.kv_used_blocks = 60  # below low, but not yet 5 s in backoff: stays
    assert m.update(st, 3)
    assert not m.update(st, 6.5)


def test_backoff_on_a_preemption_storm():
    m = BackoffMonitor(BackoffSettings(preemptions_per_s_high=2, preemptions_per_s_low=0.2, rate_window_s=2,
                                       min_backoff_s=0))
    st = EngineStats(kv_total_blocks=100)
    for t in range(3):
        st.preemptions = 10 * t  # 10 per second
        m.update(st, float(t))
    assert m.active and "preemptions/s" in m.reason
    for t in range(3, 8):  # no new preemptions
        m.update(st, float(t))
    assert not m.active


def test_backoff_can_be_disabled():
    m = BackoffMonitor(BackoffSettings(enabled=False))
    assert not m.update(EngineStats(kv_total_blocks=10, kv_used_blocks=10), 0)


# ------------------------------------------------------------------------------ agent
async def test_agent_announces_backoff_and_returns_to_healthy(bus):
    engine = ScriptedEngine()
    agent = WorkerAgent(bus, engine, settings("wb"))
    hbs = await collect(bus, S.heartbeat(WorkerId("wb")), Heartbeat)
    await agent.start()
    try:
        engine.st.kv_used_blocks = 99
        assert await wait_for(lambda: hbs and hbs[-1].state == "backoff")
        assert agent.state == "backoff"
        engine.st.kv_used_blocks = 10
        assert await wait_for(lambda: hbs[-1].state == "healthy")
        # work assigned during backoff still runs (backoff only stops *new* routing)
        engine.st.kv_used_blocks = 99
        assert await wait_for(lambda: agent.state == "backoff")
        dones = await collect(bus, S.completions_of("t1"), Completion)
        await assign(bus, "wb")
        assert await wait_for(lambda: dones and dones[0].status == "ok")
    finally:
        await agent.stop()


async def test_drain_finishes_inflight_work_then_leaves_cleanly(bus):
    engine = ScriptedEngine(steps=5)
    engine.gate.clear()  # hold the request in flight
    agent = WorkerAgent(bus, engine, settings("wd"))
    hbs = await collect(bus, S.heartbeat(WorkerId("wd")), Heartbeat)
    kvs = await collect(bus, S.cache_events(WorkerId("wd")), CacheEvent)
    dones = await collect(bus, S.completions_of("t1"), Completion)
    await agent.start()
    await assign(bus, "wd")
    assert await wait_for(lambda: agent.inflight)
    await bus.publish(S.control(WorkerId("wd")), Control(kind="drain", by="test"))
    assert await wait_for(lambda: agent.state == "quiescing")
    await asyncio.sleep(0.2)
    assert not agent._stopped.is_set()  # still running its request
    late = await assign(bus, "wd")  # arrives while quiescing: not run here
    engine.gate.set()
    await asyncio.wait_for(agent.wait_drained(), 10)
    assert [d.status for d in dones] == ["ok"] and late.id not in [d.request_id for d in dones]
    await agent.stop()
    await bus.flush()
    assert await wait_for(lambda: hbs[-1].state == "quiescing" and hbs[-1].inflight == [])
    assert await wait_for(lambda: kvs and kvs[-1].kind == "cleared")
    assert engine.stopped


async def test_engine_failure_is_reported_and_the_worker_leaves(bus):
    engine = ScriptedEngine(steps=50, step_s=0.02)
    agent = WorkerAgent(bus, engine, settings("wf"))
    dones = await collect(bus, S.completions_of("t1"), Completion)
    hbs = await collect(bus, S.heartbeat(WorkerId("wf")), Heartbeat)
    await agent.start()
    req = await assign(bus, "wf")
    assert await wait_for(lambda: agent.inflight)
    engine.failure = "vLLM engine core died"
    await asyncio.wait_for(agent.wait_drained(), 10)
    assert await wait_for(lambda: dones)
    assert dones[0].request_id == req.id and dones[0].status == "error" and dones[0].reason == "engine_dead"
    assert agent.failure == "vLLM engine core died" and agent.state == "quiescing"
    assert await wait_for(lambda: hbs[-1].state == "quiescing")
    await bus.publish(S.control(WorkerId("wf")), Control(kind="resume"))  # a dead engine cannot resume
    await asyncio.sleep(0.1)
    assert agent.state == "quiescing"
    await agent.stop()


async def test_engine_dying_while_idle_is_noticed_by_the_heartbeat(bus):
    engine = ScriptedEngine()
    agent = WorkerAgent(bus, engine, settings("wi"))
    await agent.start()
    engine.failure = "gone"
    await asyncio.wait_for(agent.wait_drained(), 5)
    assert agent.failure == "gone"
    await agent.stop()


async def test_a_request_whose_completion_another_run_stored_is_counted_and_still_answered(bus):
    """Rescued from a worker that only looked dead, a request runs twice; the second completion
    is deduplicated by its msg id. The worker counts that, and still sends its result: the
    producer, told "rerouted", ignores the first run's."""
    engine = ScriptedEngine()
    agent = WorkerAgent(bus, engine, settings("w2nd"))
    await agent.start()
    try:
        req = make_request(id="twice")
        req.reply = S.tenant_reply(req.tenant, req.id)
        replies = await collect(bus, req.reply, Reply)
        first = Completion(request_id=req.id, tenant=req.tenant, status="ok", runtime_tokens=100, worker="w1st")
        await bus.jpublish(S.completion(req.tenant, first.worker or "w1st"), first, msg_id=f"{req.id}:done")
        a = Assignment(request=req, worker=WorkerId("w2nd"), runtime_tokens=100, admitted_at=time.time(),
                       routed_at=time.time(), attempt=1, avoid=["w1st"])
        await bus.jpublish(S.work(WorkerId("w2nd")), a, msg_id=f"{req.id}:work:1")
        assert await wait_for(lambda: any(r.kind == "result" for r in replies))
        assert agent.metrics.duplicate_runs._value.get() == 1
        stored = [Completion.decode(d) for _, d in await bus.stream_messages(S.STREAM_COMPLETIONS)]
        assert [c.worker for c in stored] == ["w1st"]
    finally:
        await agent.stop()


async def test_a_restarted_worker_rerunning_a_request_its_predecessor_answered_does_not_answer_again(bus):
    """The first process under this id ran the request, stored its completion and answered, then
    died before its ack reached the server: the restarted worker gets the copy and runs it (it has
    no memory of it). Its completion is deduplicated; the producer already has its answer and
    gets no second one."""
    first = ScriptedEngine()
    first.gate.clear()  # holds the request: the process "dies" with it un-acked
    old = WorkerAgent(bus, first, settings("wre", ack_wait_s=1.0))
    await old.start()
    req = make_request(id="again")
    req.reply = S.tenant_reply(req.tenant, req.id)
    replies = await collect(bus, req.reply, Reply)
    a = Assignment(request=req, worker=WorkerId("wre"), runtime_tokens=100, admitted_at=time.time(),
                   routed_at=time.time())
    await bus.jpublish(S.work(WorkerId("wre")), a, msg_id=f"{req.id}:work")
    assert await wait_for(lambda: old.inflight)
    await old.stop()  # no ack: the message stays on WORK
    # what the first process had done before it died: its completion stored, its answer sent
    done = Completion(request_id=req.id, tenant=req.tenant, status="ok", runtime_tokens=100, worker="wre")
    await bus.jpublish(S.completion(req.tenant, done.worker or "wre"), done, msg_id=f"{req.id}:done")
    await bus.publish(req.reply, Reply(request_id=req.id, kind="result", worker="wre"))
    new = WorkerAgent(bus, ScriptedEngine(), settings("wre", ack_wait_s=1.0))
    await new.start()
    try:
        assert await wait_for(lambda: new.metrics.duplicate_runs._value.get() == 1, timeout=10)
        assert await wait_for(lambda: req.id in new.finished)
        await asyncio.sleep(0.3)
        assert [r.kind for r in replies if r.final] == ["result"]  # the predecessor's only
    finally:
        await new.stop()


async def test_the_engine_is_told_what_the_router_expected_cached_of_the_prompt(bus):
    """The engine reports only the uncached prompt as queued prefill: the router's backlog
    estimate takes at most each request's uncached part, and read a whole prompt's worth more
    as another prompt queued behind it (a cache holder looked seconds busier than it was)."""
    engine = ScriptedEngine()
    agent = WorkerAgent(bus, engine, settings("wcached"))
    await agent.start()
    try:
        req = await assign(bus, "wcached", expected_cached_tokens=96, prompt_token_ids=list(range(1, 129)))
        assert await wait_for(lambda: engine.requests)
        er = engine.requests[0]
        assert er.id == req.id and (er.prompt_tokens, er.expected_cached_tokens, er.uncached_tokens) == (128, 96, 32)
    finally:
        await agent.stop()


async def test_a_request_running_longer_than_the_ack_wait_is_kept_alive_and_runs_once(bus):
    """The server would redeliver a WORK message after its ack wait; a request that runs 2.5
    ack waits is marked in progress meanwhile, so it is delivered and run once."""
    engine = ScriptedEngine(steps=5, step_s=0.5)
    runs: list[str] = []
    generate = engine.generate

    def counting(request):
        runs.append(request.id)
        return generate(request)

    engine.generate = counting
    agent = WorkerAgent(bus, engine, settings("wk", ack_wait_s=1.0))
    deliveries: list[int] = []
    on_assignment = agent._on_assignment

    async def counting_deliveries(d):
        deliveries.append(d.num_delivered)
        await on_assignment(d)

    agent._on_assignment = counting_deliveries
    dones = await collect(bus, S.completions_of("t1"), Completion)
    await agent.start()
    try:
        req = await assign(bus, "wk", tenant="t1")
        assert await wait_for(lambda: len(dones) == 1, timeout=10)
        await asyncio.sleep(1.5)  # a redelivered copy would have come back by now
        assert runs == [req.id]
        assert deliveries == [1]  # never redelivered while it ran
        assert agent.metrics.duplicate_runs._value.get() == 0
        assert not agent._progress  # nothing left to keep alive
    finally:
        await agent.stop()


async def test_a_final_reply_says_when_the_request_was_admitted_routed_and_received(bus):
    """The producer learns where its wait went before any engine work: the admitter's and the
    router's stamps, copied from the assignment, and the moment this worker's agent received it
    (what ``natsched bench pipeline`` measures the scheduler's overhead to). An engine failure's
    error reply carries them too."""
    engine = ScriptedEngine(steps=2)
    agent = WorkerAgent(bus, engine, settings("wstamp"))
    await agent.start()
    try:
        outcomes = {}
        for rid, fail in (("stamped-ok", False), ("stamped-err", True)):
            req = make_request(id=rid)
            req.reply = S.tenant_reply(req.tenant, req.id)
            replies = await collect(bus, req.reply, Reply)
            engine.failure = "boom" if fail else None
            routed = time.time()
            a = Assignment(request=req, worker=WorkerId("wstamp"), runtime_tokens=100, admitted_at=routed - 0.5,
                           routed_at=routed)
            await bus.jpublish(S.work(WorkerId("wstamp")), a, msg_id=f"{req.id}:work")
            assert await wait_for(lambda: any(r.final for r in replies))
            outcomes[rid] = next(r for r in replies if r.final)
            assert outcomes[rid].admitted_at == a.admitted_at and outcomes[rid].routed_at == a.routed_at
            assert routed <= outcomes[rid].received_at <= time.time()
        assert outcomes["stamped-ok"].kind == "result" and outcomes["stamped-err"].kind == "error"
    finally:
        engine.failure = None
        await agent.stop()


async def test_an_assignment_naming_another_worker_does_not_run_here(bus):
    """An assignment for w-other stored on this worker's subject (a confused or hostile router):
    refused, dead-lettered and counted, never run (its fence names the other worker, so its
    completion could release nothing); the next, addressed one runs."""
    engine = ScriptedEngine(steps=1)
    agent = WorkerAgent(bus, engine, settings("wmine"))
    await agent.start()
    try:
        dead = await collect(bus, S.deadletter("worker"), DeadLetter)
        dones = await collect(bus, S.completions_of("t1"), Completion)
        stray = make_request(id="stray-1")
        a = Assignment(request=stray, worker=WorkerId("w-other"), runtime_tokens=100, admitted_at=time.time(),
                       routed_at=time.time())
        await bus.jpublish(S.work(WorkerId("wmine")), a, msg_id=f"{stray.id}:work")
        ours = await assign(bus, "wmine", id="ours-1")
        assert await wait_for(lambda: any(c.request_id == ours.id for c in dones))
        assert await wait_for(lambda: dead and dead[0].reason == "misrouted")
        assert [c.request_id for c in dones] == [ours.id] and "stray-1" not in engine.seen
        assert agent.metrics.registry.get_sample_value("natsched_worker_misrouted_assignments_total") == 1
    finally:
        await agent.stop()


async def test_a_request_running_past_its_reservation_is_reported_in_the_heartbeat(bus):
    """Runtime tokens include the generated ones: once 2 x prompt + generated passes what the
    assignment reserved, every heartbeat names the request and what it holds, until it ends."""
    engine = ScriptedEngine(steps=3)
    engine.pause_after = 0  # held after its first step until the test saw the report
    agent = WorkerAgent(bus, engine, settings("wover"))
    hbs = await collect(bus, S.heartbeat(WorkerId("wover")), Heartbeat)
    await agent.start()
    try:
        req = make_request(id="over-1", prompt_token_ids=list(range(10)))
        a = Assignment(request=req, worker=WorkerId("wover"), runtime_tokens=20, admitted_at=time.time(),
                       routed_at=time.time())
        await bus.jpublish(S.work(WorkerId("wover")), a, msg_id=f"{req.id}:work")
        # one step: 2 x 10 + 1 > 20
        assert await wait_for(lambda: any(hb.over.get("over-1", 0) == 21 for hb in hbs))
        engine.gate.set()
        assert await wait_for(lambda: not agent.inflight)
        seq = hbs[-1].seq
        assert await wait_for(lambda: hbs[-1].seq > seq and not hbs[-1].over)
    finally:
        await agent.stop()


async def test_an_attempt_handed_over_to_the_admitters_never_runs_here_a_later_one_does(bus):
    """A restarted worker's predecessor left attempt 0 un-acked and an admitter rescues it
    (Control ``handover``): a copy of attempt 0 delivered afterwards is acked and not run, one
    already running is stopped, and the rescued attempt 1 routed back here runs."""
    engine = ScriptedEngine(steps=3)
    agent = WorkerAgent(bus, engine, settings("who"))
    dones = await collect(bus, S.completions_of("t-ho"), Completion)
    await agent.start()
    try:
        late = make_request(tenant="t-ho", id="late")
        await bus.publish(S.control(WorkerId("who")), Control(kind="handover", by="adm", request_id=late.id, attempt=0))
        await bus.flush()
        assert await wait_for(lambda: agent._handed_over.get(late.id) == 0)
        for attempt in (0, 1):
            a = Assignment(request=late, worker=WorkerId("who"), runtime_tokens=100, admitted_at=time.time(),
                           routed_at=time.time(), attempt=attempt)
            await bus.jpublish(S.work(WorkerId("who")), a, msg_id=f"{late.id}:work:{attempt}")
        assert await wait_for(lambda: len(dones) == 1, timeout=10)
        assert engine.seen == [late.id] and dones[0].status == "ok"  # attempt 1 only
        # one that started before its handover arrived is stopped
        engine.gate.clear()
        running = await assign(bus, "who", tenant="t-ho", id="running")
        assert await wait_for(lambda: running.id in agent.inflight)
        await bus.publish(S.control(WorkerId("who")), Control(kind="handover", by="adm", request_id=running.id,
                                                             attempt=0))
        assert await wait_for(lambda: running.id not in agent.inflight, timeout=10)
        engine.gate.set()
        # a handover without an attempt is refused, not read as "every attempt"
        await bus.publish(S.control(WorkerId("who")), Control(kind="handover", by="adm", request_id="x"))
        await bus.flush()
        await assign(bus, "who", tenant="t-ho", id="x")
        assert await wait_for(lambda: "x" in engine.seen, timeout=10)
    finally:
        await agent.stop()


async def test_heartbeats_carry_the_decode_progress_of_the_running_requests(bus):
    """Every token after a request's first is counted once, with the gap before it, in the next
    heartbeat (the router's early slowness signal, natsched.router.progress)."""
    engine = ScriptedEngine(steps=12, step_s=0.02)
    agent = WorkerAgent(bus, engine, settings("wprog"))
    hbs = await collect(bus, S.heartbeat(WorkerId("wprog")), Heartbeat)
    await agent.start()
    try:
        await assign(bus, "wprog", id="prog-1")
        assert await wait_for(lambda: engine.seen and not agent.inflight)
        seq = hbs[-1].seq
        assert await wait_for(lambda: hbs[-1].seq > seq + 1)  # a heartbeat after the last token
        assert sum(hb.decode_tokens for hb in hbs) == 11  # 12 tokens, the first one not a decode step
        assert sum(hb.decode_s for hb in hbs) >= 11 * 0.02  # each gap at least one engine step
    finally:
        await agent.stop()
