"""The discrete-event simulator: cache hits, message flow to the router, admission, identical arrivals."""

from __future__ import annotations

import pytest

from natsched.wire.schema import CacheEvent, Completion, Heartbeat
from natsched.router.core import RouterCore, RouterSettings
from natsched.router.policies import POLICIES
from natsched.router.policy import RouteDecision
from natsched.sim.admission import ALLOW, QUEUE, REJECT
from natsched.sim.des import SimSettings, Simulator, simulate
from natsched.sim.errors import SimConfigError, SimError
from natsched.sim.metrics import ceiling_hit_ratio
from tests.factories.sim import make_trace, repeated_prefix_rows, trace_row
from natsched.workers.profiles import H100_LLAMA8B

BLOCK = 512


class Pinned:
    """Every request to one worker (or to none): routing that a test can predict exactly."""

    name = "pinned"

    def __init__(self, worker: str | None = "w0") -> None:
        self.worker = worker
        self.calls = 0

    def route(self, req, workers, now):
        self.calls += 1
        if self.worker is None or not any(w.id == self.worker for w in workers):
            return RouteDecision(None, self.name, reason="no_worker")
        return RouteDecision(self.worker, self.name)


class SpyRouter(RouterCore):
    """The shipped RouterCore, recording every message the simulator feeds it."""

    def __init__(self, *a, refuse_cache_seq: int | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self.log: list[tuple[str, object, float]] = []
        self.refuse_cache_seq = refuse_cache_seq

    def on_heartbeat(self, hb, now):
        self.log.append(("hb", hb, now))
        return super().on_heartbeat(hb, now)

    def on_cache_event(self, ev, now):
        self.log.append(("kv", ev, now))
        ok = super().on_cache_event(ev, now)
        if ev.seq == self.refuse_cache_seq and ev.kind != "snapshot":
            self.refuse_cache_seq = None
            return False
        return ok

    def on_completion(self, c, now):
        self.log.append(("done", c, now))
        return super().on_completion(c, now)

    def route(self, req, now):
        self.log.append(("route", req, now))
        return super().route(req, now)


def run(trace, *, policy="least_loaded", workers=2, router=None, admission=None, **settings):
    return Simulator(trace, SimSettings(policy=policy, workers=workers, **settings), admission=admission,
                     router=router).run()


def spy(policy="least_loaded", obj=None, **kw):
    return SpyRouter(RouterSettings(policy=policy, block_size=BLOCK), policy=obj, **kw)


# ------------------------------------------------------------------ cache hits


@pytest.mark.parametrize("policy", ["consistent_hash", "sglang_cache_aware", "natsched"])
def test_a_repeated_prefix_hits_under_cache_aware_and_consistent_policies(policy):
    assert policy in POLICIES
    trace = make_trace(repeated_prefix_rows(6))  # 4 shared blocks + a 100-token tail, 10 s apart
    res = run(trace, policy=policy, workers=2)
    m = res.metrics()
    assert [r.cached_tokens for r in res.records] == [0] + [4 * BLOCK] * 5
    assert len({r.worker for r in res.records}) == 1
    assert m["hit_ratio"] == pytest.approx(5 * 2048 / (6 * 2148))
    assert m["completed"] == 6 and m["rejected"] == 0 and m["migration_rate"] == 0.0


def test_round_robin_alternation_costs_exactly_one_miss_per_worker():
    res = run(make_trace(repeated_prefix_rows(6)), policy="round_robin", workers=2)
    assert [r.worker for r in res.records] == ["w0", "w1"] * 3
    assert [r.cached_tokens for r in res.records] == [0, 0] + [2048] * 4
    assert res.metrics()["migration_rate"] == 1.0


def test_one_worker_with_a_huge_cache_reaches_the_ceiling_exactly():
    rows = [trace_row(i * 5000, ids=ids) for i, ids in enumerate(
        [[1, 2, 3], [1, 2, 9], [1, 2, 3], [4, 5], [1, 2, 3, 4], [4, 5, 6], [7]])]
    trace = make_trace(rows)
    res = run(trace, workers=1, kv_blocks=10_000)
    ceiling = ceiling_hit_ratio(trace.requests, BLOCK)
    assert ceiling > 0.3
    assert res.metrics()["hit_ratio"] == pytest.approx(ceiling)


def test_a_single_request_takes_exactly_the_profile_step_times():
    trace = make_trace([trace_row(0, n_in=3000, n_out=3, ids=[1, 2, 3, 4, 5, 6])])
    rec = run(trace, workers=1).records[0]
    p = H100_LLAMA8B
    first = p.step_seconds(p.prefill_seconds(3000, 0), 3000)
    assert rec.first_token - rec.arrival == pytest.approx(first)
    decode = p.step_seconds(0.0, 3001) + p.step_seconds(0.0, 3002)
    assert rec.finish - rec.arrival == pytest.approx(first + decode)
    assert rec.cached_tokens == 0 and rec.worker == "w0" and rec.status == "ok"


# ------------------------------------------------------------------ identical arrivals, determinism


def _mixed_trace(n=80):
    # four prefix families, bursts of simultaneous arrivals, so policies really differ
    return make_trace([trace_row((i // 3) * 150, n_in=2048 + 37 * i, n_out=5 + i % 7,
                                 ids=[i % 4, 10 + i % 4, 20 + i % 4, 30 + i, 40 + i]) for i in range(n)])


def test_every_policy_sees_identical_arrivals_and_finishes_everything():
    trace = _mixed_trace()
    expected = [1.0 + r.arrival for r in trace.requests]  # after the default 1 s warm-up
    placements = {}
    for policy in POLICIES:
        res = run(trace, policy=policy, workers=3)
        assert [r.arrival for r in res.records] == expected, policy
        assert all(r.status == "ok" and r.finish >= r.first_token >= r.arrival for r in res.records), policy
        placements[policy] = tuple(r.worker for r in res.records)
    assert len(set(placements.values())) > 1  # the policies did route differently


def test_runs_are_deterministic():
    a = run(_mixed_trace(), policy="round_robin", workers=3)
    b = run(_mixed_trace(), policy="round_robin", workers=3)
    key = lambda res: [(r.worker, r.first_token, r.finish, r.cached_tokens) for r in res.records]  # noqa: E731
    assert key(a) == key(b) and a.steps == b.steps


# ------------------------------------------------------------------ what the router is fed


def test_the_router_is_fed_like_the_service_feeds_it():
    router = spy()
    trace = _mixed_trace(30)
    res = run(trace, workers=3, router=router, hb_interval=0.5)
    kinds = [k for k, _, _ in router.log]
    assert kinds.count("route") == 30 and kinds.count("done") == 30
    for wid in ("w0", "w1", "w2"):
        evs = [ev for k, ev, _ in router.log if k == "kv" and ev.worker == wid]
        assert [ev.seq for ev in evs] == list(range(1, len(evs) + 1))
        assert evs[0].kind == "snapshot" and {ev.kind for ev in evs[1:]} <= {"stored", "removed"}
        assert all(isinstance(ev, CacheEvent) and ev.block_size == BLOCK for ev in evs)
        hbs = [(hb, t) for k, hb, t in router.log if k == "hb" and hb.worker == wid]
        assert [hb.seq for hb, _ in hbs] == list(range(1, len(hbs) + 1))
        gaps = {round(b[1] - a[1], 9) for a, b in zip(hbs[1:], hbs[2:])}
        assert gaps == {0.5} and all(isinstance(hb, Heartbeat) and hb.kv_total_blocks > 0 for hb, _ in hbs)
        delivered = 0
        for k, msg, _ in router.log:  # a heartbeat never announces a cache event not yet delivered
            if k == "kv" and msg.worker == wid:
                delivered = msg.seq
            elif k == "hb" and msg.worker == wid:
                assert msg.kv_seq == delivered
    done = {c.request_id: c for k, c, _ in router.log if k == "done"}
    for r in res.records:
        c = done[f"r{r.index}"]
        assert isinstance(c, Completion) and c.status == "ok" and c.worker == r.worker
        assert c.cached_tokens == r.cached_tokens and c.prompt_tokens == r.prompt_tokens
    routes = [req for k, req, _ in router.log if k == "route"]
    assert [req.hashes for req in routes] == [trace.requests[int(req.id[1:])].hashes for req in routes]
    assert all(req.route_key == req.hashes[0] for req in routes)


def test_a_heartbeat_lists_the_requests_in_the_engine():
    router = spy()
    trace = make_trace([trace_row(0, n_in=60_000, n_out=50, ids=list(range(117)))])
    run(trace, workers=1, router=router, hb_interval=0.25)
    busy = [hb for k, hb, _ in router.log if k == "hb" and hb.inflight]
    assert busy and all(hb.inflight == ["r0"] and hb.running + hb.waiting == 1 for hb in busy)


def test_a_worker_with_full_kv_announces_backoff_like_the_agent():
    # one worker, KV for ~one prompt: a burst of big prompts fills it and the agent's rule fires
    trace = make_trace([trace_row(0, n_in=7 * BLOCK + 100, n_out=200, ids=[i * 10 + k for k in range(8)])
                        for i in range(6)])
    states = []
    for backoff in (True, False):
        router = spy(obj=Pinned("w0"))
        res = run(trace, workers=1, router=router, kv_blocks=16, worker_backoff=backoff, hb_interval=0.1,
                  no_worker_wait_s=1000.0)
        states.append({hb.state for k, hb, _ in router.log if k == "hb"})
        assert res.metrics()["completed"] == 6  # backoff only delays new work; nothing is lost
        assert (res.backoff_changes > 0) == backoff
    assert states == [{"healthy", "backoff"}, {"healthy"}]


def test_a_refused_cache_event_is_answered_with_a_snapshot():
    router = spy(refuse_cache_seq=2)
    run(make_trace(repeated_prefix_rows(3)), workers=1, router=router)
    evs = [ev for k, ev, _ in router.log if k == "kv"]
    assert [ev.kind for ev in evs[:3]] == ["snapshot", "stored", "snapshot"]
    assert [ev.seq for ev in evs] == list(range(1, len(evs) + 1))
    assert set(evs[2].hashes) == set(make_trace(repeated_prefix_rows(1)).requests[0].hashes)


# ------------------------------------------------------------------ rejections and admission


def test_no_worker_is_retried_like_the_service_then_rejected():
    policy = Pinned(worker=None)
    res = run(make_trace([trace_row(0)]), router=spy(obj=policy), route_retry_s=1.0, no_worker_wait_s=10.0)
    assert policy.calls == 11  # t = 0, 1, ..., 10
    assert res.records[0].status == "rejected" and res.records[0].reason == "no_worker"
    assert res.metrics()["rejected"] == 1 and res.metrics()["completed"] == 0


def test_a_request_larger_than_an_engine_is_rejected_not_stuck():
    trace = make_trace([trace_row(0, n_in=4 * BLOCK, ids=[1, 2, 3, 4]), trace_row(1, ids=[5])])
    res = run(trace, workers=1, kv_blocks=4)
    assert [(r.status, r.reason) for r in res.records] == [("rejected", "too_large"), ("ok", None)]


def test_max_model_len_rejects_long_requests():
    trace = make_trace([trace_row(0, n_in=3 * BLOCK, ids=[1, 2, 3]), trace_row(1, ids=[5])])
    res = run(trace, workers=1, max_model_len=1000)
    assert [r.status for r in res.records] == ["rejected", "ok"]


class RejectOdd:
    name = "reject_odd"
    tick_s = None

    def __init__(self):
        self.finished = []

    def admit(self, req, now):
        return REJECT if req.index % 2 else ALLOW

    def release(self, now):
        return []

    def on_finish(self, req, ok, now):
        self.finished.append((req.index, ok))


class OneAtATime:
    """Queue everything while one request runs; release the next on completion."""

    name = "one_at_a_time"
    tick_s = None

    def __init__(self):
        self.queue, self.busy = [], False

    def admit(self, req, now):
        if self.busy:
            self.queue.append(req)
            return QUEUE
        self.busy = True
        return ALLOW

    def release(self, now):
        if self.busy or not self.queue:
            return []
        self.busy = True
        return [self.queue.pop(0)]

    def on_finish(self, req, ok, now):
        self.busy = False


def test_admission_hook_rejects_before_routing():
    hook = RejectOdd()
    router = spy()
    res = run(make_trace([trace_row(i) for i in range(6)]), router=router, admission=hook)
    assert [r.status for r in res.records] == ["ok", "rejected"] * 3
    assert {r.reason for r in res.records if r.status == "rejected"} == {"admission"}
    assert [k for k, _, _ in router.log].count("route") == 3
    assert sorted(hook.finished) == [(0, True), (2, True), (4, True)]


def test_admission_hook_can_queue_and_release_later():
    trace = make_trace([trace_row(0, n_in=20_000, ids=list(range(39)), n_out=20) for _ in range(4)])
    res = run(trace, workers=2, admission=OneAtATime())
    recs = sorted(res.records, key=lambda r: r.routed)
    assert all(r.status == "ok" for r in recs)
    for prev, nxt in zip(recs, recs[1:]):  # strictly one at a time, each released at its predecessor's finish
        assert nxt.routed == pytest.approx(prev.finish)
    assert recs[-1].first_token - recs[-1].arrival > recs[0].first_token - recs[0].arrival  # queueing counts


def test_a_hook_that_never_releases_is_a_clear_error_not_a_hang():
    class Hoarder(RejectOdd):
        def admit(self, req, now):
            return QUEUE

    with pytest.raises(SimError, match=r"stalled.*2 request\(s\) were unfinished.*'queued': 2"):
        run(make_trace([trace_row(0), trace_row(10)]), admission=Hoarder(), stall_s=30.0)


def test_admission_hook_must_answer_a_known_verdict():
    class Bad(RejectOdd):
        def admit(self, req, now):
            return "degrade"

    with pytest.raises(SimConfigError, match="degrade"):
        run(make_trace([trace_row(0)]), admission=Bad())


def test_bus_latency_delays_work_but_everything_finishes():
    trace = make_trace(repeated_prefix_rows(3))
    fast = run(trace, policy="consistent_hash")
    slow = run(trace, policy="consistent_hash", net_delay_s=0.05)
    assert slow.metrics()["completed"] == 3
    for a, b in zip(fast.records, slow.records):
        assert b.first_token - b.arrival == pytest.approx(a.first_token - a.arrival + 0.05)
        assert b.cached_tokens == a.cached_tokens


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize("kw, what", [
    ({"workers": 0}, "workers"),
    ({"hb_interval": 0}, "hb_interval"),
    ({"profile": "tpu-v9"}, "unknown engine profile"),
    ({"route_retry_s": 0}, "route_retry_s"),
])
def test_bad_settings_are_refused(kw, what):
    with pytest.raises(SimConfigError, match=what):
        SimSettings(**kw)


def test_unknown_policy_and_router_setting_are_config_errors():
    trace = make_trace([trace_row(0)])
    with pytest.raises(SimConfigError, match="unknown routing policy"):
        simulate(trace, SimSettings(policy="nope"))
    with pytest.raises(SimConfigError, match="unknown router setting"):
        simulate(trace, SimSettings(router={"bogus": 1}))
