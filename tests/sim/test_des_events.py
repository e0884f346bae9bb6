"""The DES's cluster changes and clients: add / kill / slow events, rescue, the SDK's retry rule."""

from __future__ import annotations

import random

import pytest

from natsched.router.core import RouterCore, RouterSettings
from natsched.router.policy import RouteDecision
from natsched.sim.admission import ALLOW, QUEUE, REJECT
from natsched.sim.des import ClientRetry, SimSettings, Simulator, WorkerEvent, WorkerSpec, simulate
from natsched.sim.errors import SimConfigError
from natsched.workers.profiles import H100_LLAMA8B
from tests.factories.sim import make_trace, trace_row

BLOCK = 512


class Pinned:
    """Every request to one worker while it is a candidate, else the first candidate."""

    name = "pinned"

    def __init__(self, worker: str = "w0") -> None:
        self.worker = worker

    def route(self, req, workers, now):
        ids = sorted(w.id for w in workers)
        if not ids:
            return RouteDecision(None, self.name, reason="no_worker")
        return RouteDecision(self.worker if self.worker in ids else ids[0], self.name)


def sim(rows, policy=None, admission=None, **kw):
    s = SimSettings(**{"workers": 2, **kw})
    router = RouterCore(RouterSettings(block_size=BLOCK), policy=policy or Pinned())
    return Simulator(make_trace(rows), s, admission=admission, router=router)


def long_rows(n=1, gap_ms=0.0, n_out=2000):
    return [trace_row(i * gap_ms, ids=[100 + i], n_out=n_out) for i in range(n)]


def test_client_retry_follows_the_openai_sdk_defaults():
    r, rng = ClientRetry(), random.Random(0)
    first, second = r.delay(0, None, rng), r.delay(1, None, rng)
    assert 0.375 <= first <= 0.5 and 0.75 <= second <= 1.0  # 0.5 x 2^n, less 0-25 % jitter
    assert r.delay(2, None, rng) is None  # max_retries = 2
    assert r.delay(0, 7.0, rng) == 7.0  # retry_after honoured
    assert r.delay(0, 121.0, rng) is None  # beyond two minutes: the SDK does not retry
    assert min(ClientRetry(max_retries=10).delay(9, None, rng), 99) <= 8.0  # capped at 8 s


class RejectOnce:
    """Rejects every first attempt (with ``retry_after``), allows the retries."""

    name, tick_s = "reject_once", None

    def __init__(self, retry_after=None):
        self.retry_after, self.seen = retry_after, {}

    def admit(self, req, now):
        self.seen.setdefault(req.index, []).append(now)
        return (REJECT, self.retry_after) if len(self.seen[req.index]) == 1 else ALLOW

    def release(self, now):
        return []

    def on_finish(self, req, ok, now):
        pass


def test_a_refused_client_comes_back_after_retry_after_or_the_backoff():
    hook = RejectOnce(retry_after=5.0)
    res = sim([trace_row(0, ids=[1])], admission=hook, client_retry=ClientRetry()).run()
    (t1, t2), = hook.seen.values()
    assert t2 - t1 == pytest.approx(5.0)
    rec = res.records[0]
    assert (rec.status, rec.attempts, rec.refused, rec.refused_retry_after) == ("ok", 2, 1, 1)
    hook = RejectOnce()
    sim([trace_row(0, ids=[1])], admission=hook, client_retry=ClientRetry()).run()
    (t1, t2), = hook.seen.values()
    assert 0.375 <= t2 - t1 <= 0.5
    res = sim([trace_row(0, ids=[1])], admission=RejectOnce()).run()  # no client retry: final
    assert res.records[0].status == "rejected"


def test_kill_with_rescue_reruns_the_work_no_client_has_seen_elsewhere():
    kill = WorkerEvent(0.001, "kill", "w0")  # inside their first prefill step: no token out yet
    res = sim(long_rows(3), events=(kill,), rescue_s=3.0).run()
    assert all(r.status == "ok" and r.attempts == 1 for r in res.records)
    assert all(r.rescued == 1 and r.worker == "w1" for r in res.records)
    assert min(r.routed for r in res.records) == pytest.approx(1.0 + 0.001 + 3.0)  # warm-up + kill + rescue
    assert all(r.first_token > 1.0 + 0.001 + 3.0 for r in res.records)  # the re-run's first token


def test_a_stream_with_output_is_failed_to_its_client_not_rescued():
    """A stream cannot take back tokens it sent: natsched's producer fails it with ``worker_lost``
    (``natsched.client.producer._rerouted``) and cancels the re-run. So only the request with no
    token out yet is rescued; the other is the client's to retry, like any peer's."""
    rows = [trace_row(0, ids=[100], n_out=2000), trace_row(490, ids=[101], n_out=2000)]
    kill = WorkerEvent(0.5, "kill", "w0")
    early, late = sim(rows, events=(kill,), rescue_s=3.0).run().records
    assert (early.status, early.reason, early.rescued, early.attempts) == ("failed", "worker_lost", 0, 1)
    assert early.first_token - early.arrival < 0.5  # it had streamed before the death
    assert (late.status, late.rescued, late.attempts) == ("ok", 1, 1)
    assert late.first_token - late.arrival > 3.0  # the re-run's

    early, late = sim(rows, events=(kill,), rescue_s=3.0, client_retry=ClientRetry()).run().records
    # its producer hears of the death from the rescue (3 s on), its client retries from scratch
    # on w1 (the router has excluded w0 by then); its TTFT stays the first attempt's
    assert (early.status, early.attempts, early.refused, early.rescued, early.worker) == ("ok", 2, 1, 0, "w1")
    assert early.routed > 1.0 + 0.5 + 3.0
    assert early.first_token - early.arrival < 0.5
    assert late.rescued == 1 and late.attempts == 1


def test_a_migrated_stream_goes_on_after_its_output_once_the_rescue_tells_its_producer():
    """With ``migrate`` (natsched's producer): 3 s after the death the producer hears ``rerouted``
    and sends the next try continuing after the tokens it has, so w1 generates only the rest —
    sooner done than the client's restart from scratch, with the same first token."""
    rows = [trace_row(0, ids=[100], n_out=2000)]
    kill = WorkerEvent(5.0, "kill", "w0")
    moved = sim(rows, events=(kill,), rescue_s=3.0, migrate=2).run().records[0]
    over = sim(rows, events=(kill,), rescue_s=3.0, client_retry=ClientRetry()).run().records[0]
    assert (moved.status, moved.migrated, moved.rescued, moved.attempts, moved.worker) == ("ok", 1, 0, 2, "w1")
    assert moved.routed == pytest.approx(1.0 + 5.0 + 3.0)  # warm-up + kill + the rescue's news
    assert moved.first_token == pytest.approx(over.first_token) and moved.first_token < 1.0 + 5.0
    alone = sim(rows).run().records[0]
    rest = alone.finish - (1.0 + 5.0)  # what w0 had left to generate
    assert moved.finish - moved.routed == pytest.approx(rest, rel=0.1)  # the rest, plus one prefill
    assert over.finish - over.routed == pytest.approx(alone.finish - 1.0, rel=0.1)  # a restart: all 2000 again


def test_a_request_finishing_in_the_step_a_kill_cuts_keeps_its_first_token():
    """Its last step is in flight when w0 dies: the engine core has already let the sequence go,
    but the client saw its first token long before, and the re-run must not replace that time
    with its own (an elastic cell once read 52 s for a request served since 0.2 s)."""
    rows = [trace_row(0, ids=[100], n_out=400)]
    alone = sim(rows).run().records[0]
    kill = WorkerEvent(alone.finish - 1.0 - 0.0005, "kill", "w0")  # 1 s warm-up; inside the last step
    r = sim(rows, events=(kill,), rescue_s=3.0, client_retry=ClientRetry()).run().records[0]
    assert r.status == "ok" and r.attempts == 2 and r.worker == "w1"
    assert r.first_token == pytest.approx(alone.first_token)  # the first token of the attempt that died
    assert r.finish > alone.finish + 3.0  # the re-run


def test_kill_without_rescue_fails_to_the_client_who_retries():
    kill = WorkerEvent(0.5, "kill", "w0")
    # the router keeps choosing w0 until it misses two heartbeats (~2 s); the SDK's two retries
    # (0.5 s, 1 s) both land before that: the requests are lost
    res = sim(long_rows(2), events=(kill,), client_retry=ClientRetry()).run()
    assert all((r.status, r.attempts, r.rescued, r.reason) == ("failed", 3, 0, "worker_lost") for r in res.records)
    assert res.metrics()["failed"] == 2
    # a client that keeps trying past the router's detection gets through on w1
    res = sim(long_rows(2), events=(kill,), client_retry=ClientRetry(max_retries=5)).run()
    assert all(r.status == "ok" and r.worker == "w1" and r.attempts > 2 for r in res.records)
    res = sim(long_rows(2), events=(kill,)).run()  # without retries: lost at once
    assert [(r.status, r.attempts) for r in res.records] == [("failed", 1), ("failed", 1)]


def test_a_request_routed_to_a_dead_worker_is_not_swallowed():
    # w0 dies between heartbeats: the router still sends it work until it goes stale
    rows = [trace_row(0, ids=[1], n_out=4), trace_row(1500, ids=[2], n_out=4)]
    res = sim(rows, events=(WorkerEvent(1.0, "kill", "w0"),), rescue_s=1.0).run()
    assert [r.status for r in res.records] == ["ok", "ok"]
    assert res.records[1].rescued == 1 and res.records[1].worker == "w1"


def test_slow_makes_steps_longer_then_recovers():
    one = [trace_row(0, ids=[1], n_out=200)]
    base = sim(one).run().records[0]
    slow = sim(one, events=(WorkerEvent(0.0, "slow", "w0", factor=0.5, duration_s=1000.0),)).run().records[0]
    assert slow.finish - slow.arrival == pytest.approx(2 * (base.finish - base.arrival), rel=0.02)
    later = [trace_row(0, ids=[9], n_out=1), trace_row(10_000, ids=[1], n_out=200)]  # after a 5 s slowdown
    back = sim(later, events=(WorkerEvent(0.0, "slow", "w0", factor=0.5, duration_s=5.0),)).run().records[1]
    assert back.finish - back.arrival == pytest.approx(base.finish - base.arrival, rel=1e-6)


def test_add_brings_a_cold_worker_that_takes_work():
    rows = [trace_row(i * 500, ids=[i + 1], n_out=50) for i in range(20)]
    s = sim(rows, policy=Pinned("w2"), events=(WorkerEvent(4.0, "add", spec=WorkerSpec()),))
    res = s.run()
    assert "w2" in s.router.workers and s.router.workers["w2"].joined_at == pytest.approx(5.0)
    on_new = [r for r in res.records if r.worker == "w2"]
    assert on_new and min(r.routed for r in on_new) >= 5.0
    assert all(r.status == "ok" for r in res.records)


def test_worker_specs_give_unequal_machines_and_models():
    specs = (WorkerSpec(H100_LLAMA8B, "a"), WorkerSpec("h100-27b-int4", "b"))
    rows = [trace_row(0, ids=[1], n_out=100)]
    s = sim(rows, worker_specs=specs)
    assert s.settings.workers == 2 and {w.model for w in s.workers.values()} == {"a", "b"}
    t = make_trace(rows)
    t.requests[0].model = "b"
    res = Simulator(t, SimSettings(worker_specs=specs, policy="least_loaded")).run()
    assert res.records[0].worker == "w1"


def test_bad_events_are_refused():
    with pytest.raises(SimConfigError, match="kind"):
        WorkerEvent(1.0, "explode", "w0")
    with pytest.raises(SimConfigError, match="names its worker"):
        WorkerEvent(1.0, "kill")
    with pytest.raises(SimConfigError, match=r"\(0, 1\]"):
        WorkerEvent(1.0, "slow", "w0", factor=2.0)
    with pytest.raises(SimConfigError, match="no live worker"):
        simulate(make_trace([trace_row(5000, ids=[1])]), SimSettings(workers=1, events=(WorkerEvent(0.0, "kill", "w7"),)))


def test_a_request_finishing_inside_the_step_the_worker_dies_in_is_lost_not_stuck():
    # one short request: its only decode step is in flight when the worker dies
    rows = [trace_row(0, ids=[1], n_out=1)]
    s = sim(rows, events=(WorkerEvent(0.0, "kill", "w0"),), rescue_s=1.0)
    s.settings.events = (WorkerEvent(1e-4, "kill", "w0"),)
    res = s.run()
    assert res.records[0].status == "ok" and res.records[0].worker == "w1" and res.records[0].rescued == 1


class ReleaseOnFinish:
    """Queues every second request and lets one in at each completion (a door with a queue)."""

    name = "door"
    tick_s = 0.0

    def __init__(self) -> None:
        self.queue = []
        self.n = 0

    def admit(self, req, now):
        self.n += 1
        if self.n % 2:
            return ALLOW
        self.queue.append(req)
        return QUEUE

    def release(self, now):
        return [self.queue.pop(0)] if self.queue else []

    def on_finish(self, req, ok, now):
        pass


def test_a_request_released_by_a_completion_joins_the_next_step_not_a_second_one():
    """One engine, one step at a time: a completion that lets a queued request in (routed to the
    same worker at once) must not start a step beside the one that follows it."""
    rows = [trace_row(i * 10.0, ids=[200 + i], n_out=20 + i) for i in range(12)]
    res = sim(rows, admission=ReleaseOnFinish(), workers=1).run()
    step = H100_LLAMA8B.memory_seconds(0) + H100_LLAMA8B.step_overhead_s
    ok = [r for r in res.records if r.status == "ok"]
    assert len(ok) == 12
    assert all((r.finish - r.first_token) / (r.output_tokens - 1) >= step * 0.999 for r in ok)


def test_the_simulated_producer_migrates_as_the_real_one_does():
    from natsched.client.producer import MIGRATIONS as REAL
    from natsched.sim.bench_scenarios import sim_settings
    from natsched.sim.contenders import MIGRATIONS
    from natsched.sim.scenario import BUILTIN_DIR, load_scenario

    sc = load_scenario(BUILTIN_DIR / "elastic.yaml")
    assert MIGRATIONS == REAL
    assert sim_settings(sc, "natsched", rescue=True).migrate == REAL
    assert sim_settings(sc, "llm-d", rescue=False).migrate == 0  # a peer's client cannot: no rerouted news
