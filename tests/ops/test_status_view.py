"""The status view: the pure accumulator, the terminal rendering, and the collector on a live cluster."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.client.producer import make_request
from natsched.client.errors import Rejected
from natsched.wire.schema import Completion, Decision, RequestId, TenantId
from natsched.gateway.status import StatusCollector, StatusSettings, StatusState
from natsched.ops.status import render_text
from tests.factories.core import make_heartbeat
from tests.factories.stack import start_stack

NOW = 1_000_000.0


def make_decision(rid: str = "r1", *, decision: str = "allow", reason: str | None = None, cls: str = "online",
                  ts: float = NOW, stage: str = "admission", tenant: str = "t1") -> Decision:
    return Decision(request_id=RequestId(rid), tenant=TenantId(tenant), stage=stage, decision=decision, ts=ts,
                    cls=cls, reason=reason)


def make_done(rid: str = "r1", *, worker: str = "w1", prompt: int = 100, cached: int = 0, ts: float = NOW,
              status: str = "ok") -> Completion:
    return Completion(request_id=RequestId(rid), tenant=TenantId("t1"), status=status, runtime_tokens=10,
                      worker=worker, prompt_tokens=prompt, cached_tokens=cached, ts=ts)


def quota_entries(**tenants) -> dict[str, bytes]:
    entries = {S.KEY_CLUSTER_TOTAL: orjson.dumps(1000)}
    for name, quota in tenants.items():
        entries[S.tenant_quota_key(name)] = orjson.dumps(quota)
    return entries


def test_workers_show_state_load_kv_hit_ratio_and_go_stale_after_three_missed_heartbeats():
    state = StatusState()
    state.on_heartbeat(make_heartbeat("w1", runtime_tokens=250, capacity_tokens=1000, kv_used_blocks=30,
                                      kv_total_blocks=100, interval=1.0), NOW - 0.5)
    state.on_heartbeat(make_heartbeat("w2", state="backoff", interval=1.0), NOW - 3.5)
    state.on_completion(make_done("a", prompt=100, cached=0))
    state.on_completion(make_done("b", prompt=100, cached=50))
    state.on_completion(make_done("c", prompt=100, cached=100, status="error"))  # failures say nothing of the cache
    rows = {w.id: w for w in state.view({}, None, NOW).workers}
    assert (rows["w1"].state, rows["w1"].load, rows["w1"].kv_use, rows["w1"].hit_ratio) == ("healthy", 0.25, 0.3, 0.25)
    assert rows["w1"].heartbeat_age_s == pytest.approx(0.5)
    assert rows["w2"].state == "stale" and rows["w2"].hit_ratio is None


def test_queue_depth_counts_requests_whose_last_record_is_queue():
    state = StatusState()
    for rid in ("q1", "q2", "q3"):
        state.on_decision(make_decision(rid, decision="queue", cls="batch"))
    state.on_decision(make_decision("q4", decision="queue", cls="online"))
    state.on_decision(make_decision("q1", decision="allow", cls="batch"))  # dequeued
    state.on_decision(make_decision("q2", decision="reject", reason="deadline_exceeded", cls="batch"))
    state.on_decision(make_decision("q3", decision="assign", stage="routing", cls="batch"))  # not admission
    queues = {q.cls: (q.depth, q.limit) for q in state.view({}, None, NOW).queues}
    assert queues == {"online": (1, 1000), "batch": (1, 10000), "offline": (0, 0)}


def test_an_allow_inside_an_inline_routing_record_ends_the_queue_wait():
    state = StatusState()
    state.on_decision(make_decision("q1", decision="queue", cls="batch"))
    routing = make_decision("q1", decision="assign", stage="routing", cls="batch")
    routing.admission = make_decision("q1", decision="allow", cls="batch").to_wire()
    state.on_decision(routing)
    assert {q.cls: q.depth for q in state.view({}, None, NOW).queues}["batch"] == 0


def test_rejections_are_counted_by_reason_within_the_window():
    state = StatusState(StatusSettings(window_s=60))
    state.on_decision(make_decision("old", decision="reject", reason="quota_exhausted", ts=NOW - 120))
    for i in range(3):
        state.on_decision(make_decision(f"r{i}", decision="reject", reason="quota_exhausted"))
    state.on_decision(make_decision("t", decision="reject", reason="tenant_cap"))
    assert state.view({}, None, NOW).rejections == {"quota_exhausted": 3, "tenant_cap": 1}


def test_tenants_show_floor_usage_and_cap_including_active_tenants_on_the_default_quota():
    state = StatusState()
    usage = orjson.dumps({"used": 450, "tenants": {"gold": 400, "walkin": 50}, "models": {}, "long": 0})
    view = state.view(quota_entries(gold={"floor": 0.5, "weight": 1, "cap": 800}), usage, NOW)
    rows = {t.tenant: t for t in view.tenants}
    assert (rows["gold"].floor_tokens, rows["gold"].used, rows["gold"].cap, rows["gold"].configured) == \
        (500, 400, 800, True)
    assert (rows["walkin"].used, rows["walkin"].configured) == (50, False)
    assert view.used == 450 and view.total == 1000


def test_a_corrupt_usage_or_quota_entry_is_a_warning_not_a_crash():
    state = StatusState()
    entries = quota_entries()
    entries[S.tenant_quota_key("bad")] = b"{nope"
    view = state.view(entries, b"[not usage]", NOW)
    assert view.used == 0 and len(view.warnings) == 2


def test_render_text_shows_every_section():
    state = StatusState()
    state.on_heartbeat(make_heartbeat("w1", runtime_tokens=10, capacity_tokens=100), NOW)
    state.on_decision(make_decision("x", decision="reject", reason="quota_exhausted"))
    text = render_text(state.view(quota_entries(gold={"floor": 0.1}), None, NOW))
    assert "WORKERS (1)" in text and "w1" in text and "healthy" in text and "10%" in text
    assert "TENANTS (1)" in text and "gold" in text and "100 (10%)" in text
    assert "QUEUES  online 0/1000   batch 0/10000   offline 0/0" in text
    assert "REJECTIONS (last 5 min)  quota_exhausted 1" in text


async def test_collector_follows_a_live_cluster_and_backfills_from_the_streams(bus, nats_url):
    stack = await start_stack(nats_url, workers=2, time_scale=1.0)  # real-time decode: the hog holds its tokens
    try:
        await bus.kv(S.BUCKET_QUOTAS).put(S.tenant_quota_key("t1"), orjson.dumps({"floor": 0.2, "cap": 5000}))
        await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(300))
        await bus.kv(S.BUCKET_QUOTAS).put("class.online.queue", orjson.dumps(0))
        for _ in range(100):
            if stack.admitter.total == 300 and stack.admitter.core.quotas.queue_limit("online") == 0:
                break
            await asyncio.sleep(0.05)
        await stack.client.submit(make_request("t1", "warm up", max_tokens=2))  # recorded before the collector
        for _ in range(100):  # its reservation released
            if not stack.admitter.shared.usage.used:
                break
            await asyncio.sleep(0.02)
        hog = asyncio.create_task(stack.client.submit(make_request("t1", prompt_token_ids=list(range(100)),
                                                                   max_tokens=50)))
        for _ in range(100):
            if stack.admitter.shared.usage.used:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(Rejected):
            await stack.client.submit(make_request("t1", prompt_token_ids=list(range(100)), max_tokens=50))
        collector = StatusCollector(bus)
        await collector.start()  # backfill: the rejection above is already in DECISIONS
        for _ in range(100):
            if len(collector.state.heartbeats) == 2:
                break
            await asyncio.sleep(0.05)
        view = await collector.snapshot()
        assert [w.id for w in view.workers] == ["w1", "w2"] and {w.state for w in view.workers} == {"healthy"}
        assert view.rejections == {"quota_exhausted": 1}
        tenant = {t.tenant: t for t in view.tenants}["t1"]
        assert (tenant.floor_tokens, tenant.cap, tenant.used) == (60, 5000, 250)  # the hog's reservation
        await hog
        for _ in range(100):  # live: its completion arrives through the subscription; the
            # admitter's release of the reservation (two round trips after the same completion
            # reached it through its consumer) may come a moment later: both are waited for
            view = await collector.snapshot()
            if sum(len(v) for v in collector.state.served.values()) == 2 and \
                    {t.tenant: t.used for t in view.tenants}["t1"] == 0:
                break
            await asyncio.sleep(0.05)
        assert {t.tenant: t.used for t in view.tenants}["t1"] == 0
        assert sum(len(v) for v in collector.state.served.values()) == 2
    finally:
        await stack.close()


def test_the_html_page_escapes_whatever_it_shows():
    from natsched.gateway.status_page import render_html
    from natsched.gateway.status import StatusView, WorkerRow

    view = StatusView(at=NOW, total=10, configured_total=10, used=0, rejections={"<b>x</b>": 1},
                      workers=[WorkerRow("<script>alert(1)</script>", "healthy", "m&m", 0, 0, 0, 0, 0, 0, 0.1, None)])
    page = render_html(view)
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>x</b>" not in page and "m&amp;m" in page


async def test_collector_ignores_garbage_on_the_subjects_it_follows(bus):
    collector = StatusCollector(bus)
    await collector.start()
    await bus.publish(S.heartbeat("w9"), b"\xc1 not msgpack")
    await bus.publish(S.decision("admission", "t1"), b"{}")
    await bus.publish(S.completion("t1", "w1"), b"\x00" * 10)
    await bus.publish(S.heartbeat("w8"), make_heartbeat("w8"))
    for _ in range(100):
        if collector.state.heartbeats:
            break
        await asyncio.sleep(0.02)
    view = await collector.snapshot()
    assert [w.id for w in view.workers] == ["w8"] and view.rejections == {} and not collector.state.served


def test_a_worker_a_router_holds_half_open_shows_so_with_its_learned_rate():
    state = StatusState()
    state.on_heartbeat(make_heartbeat("w1", interval=1.0), NOW)
    state.on_heartbeat(make_heartbeat("w2", interval=1.0), NOW)
    record = {"at": NOW, "health": "half_open", "estimate": {"prefill_tokens_per_s": 12_000.0}}
    state.on_cost_record(S.cost_key("w1", "router-a1"), orjson.dumps(record))
    state.on_cost_record(S.cost_key("w2", "router-a1"), orjson.dumps({**record, "health": "healthy"}))
    state.on_cost_record(S.cost_key("w2", "router-b2"), orjson.dumps({**record, "at": NOW - 600}))  # a gone router
    state.on_cost_record(S.cost_key("w2", "router-c3"), b"garbage")
    rows = {w.id: w for w in state.view(quota_entries(), None, NOW).workers}
    assert rows["w1"].state == "half_open" and rows["w1"].prefill_tps == 12_000.0
    assert rows["w2"].state == "healthy"
    assert "half_open" in render_text(state.view(quota_entries(), None, NOW))
