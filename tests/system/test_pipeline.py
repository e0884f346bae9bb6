"""End to end through a real nats-server: producer -> admitter -> router -> worker -> producer."""

import asyncio

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.client.producer import make_request
from natsched.wire.codec import encode
from natsched.client.errors import DuplicateRequest, Rejected, RequestFailed
from natsched.wire.ids import scoped
from natsched.wire.schema import Completion, Control, DeadLetter, Decision, Reply
from tests.factories.stack import start_stack
from tests.factories.core import wait_for




async def stream_records(bus, stream, schema, subject=None):
    return [schema.decode(data) for _, data in await bus.stream_messages(stream, subject)]


async def test_requests_travel_every_stage(stack, bus):
    reqs = [make_request("t1", f"prompt number {i} " * 10, max_tokens=5) for i in range(6)]
    results = await asyncio.gather(*(stack.client.submit(r) for r in reqs))
    assert all(r.status == "completed" and r.output_tokens == 5 for r in results)
    assert all(r.text.split() == [f"tok{i}" for i in range(5)] for r in results)
    # "admitted" (admitter) and "assigned" (router) come from two connections: NATS orders neither first
    assert all(sorted(r.statuses) == ["admitted", "assigned"] for r in results)
    assert {r.worker for r in results} == {"w1", "w2"}  # least_loaded spreads a burst
    completions = await stream_records(bus, S.STREAM_COMPLETIONS, Completion)
    assert sorted(c.request_id for c in completions) == sorted(r.id for r in reqs)
    decisions = await stream_records(bus, S.STREAM_DECISIONS, Decision)
    assert sorted((d.stage, d.decision) for d in decisions) == [("admission", "allow")] * 6 + [("routing", "assign")] * 6
    assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)  # completions released every reservation


async def test_streaming_yields_tokens_as_generated(stack):
    stream = stack.client.stream(make_request("t1", "stream me", max_tokens=6))
    chunks = [c async for c in stream]
    assert [c.index for c in chunks] == list(range(6))
    assert "".join(c.text for c in chunks).split() == [f"tok{i}" for i in range(6)]
    assert stream.result.output_tokens == 6 and stream.result.ttft is not None


async def test_repeated_prefix_is_served_from_cache(bus, nats_url):
    stack = await start_stack(nats_url, workers=1)
    try:
        system = "You are a meticulous assistant. " * 40  # 1280 bytes = 10 text blocks
        first = await stack.client.submit(make_request("t1", "q1", system_prompt=system, max_tokens=2))
        second = await stack.client.submit(make_request("t1", "q2", system_prompt=system, max_tokens=2))
        assert first.cached_tokens == 0
        assert second.cached_tokens == 10 * 32
    finally:
        await stack.close()


async def test_over_budget_online_request_queues_then_runs(stack, bus):
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(300))
    assert await wait_for(lambda: stack.admitter.total == 300)
    # The first request must still hold its reservation when the second arrives, however slow the
    # machine: its engine steps take ~0.5 s each until the second is seen queued.
    for w in stack.workers:
        w.engine.time_scale = 50.0
    big = make_request("t1", prompt_token_ids=list(range(100)), max_tokens=50)  # 250 runtime tokens
    first = asyncio.create_task(stack.client.submit(big))
    await wait_for(lambda: stack.admitter.shared.usage.used > 0)
    waiting = make_request("t1", prompt_token_ids=list(range(100)), max_tokens=50)
    second_task = asyncio.create_task(stack.client.submit(waiting))
    assert await wait_for(lambda: stack.admitter.core.queue.get(waiting.id) is not None)
    for w in stack.workers:
        w.engine.time_scale = 0.05
    second = await second_task
    # "admitted" (from the admitter) and "assigned" (from the router) come from two connections, so
    # NATS does not order them against each other; "queued" came first and was answered alone.
    assert second.statuses[0] == "queued" and sorted(second.statuses) == ["admitted", "assigned", "queued"]
    assert (await first).status == "completed"
    with pytest.raises(Rejected) as err:
        await stack.client.submit(make_request("t1", prompt_token_ids=list(range(200)), max_tokens=50))
    assert err.value.reason == "too_large"


async def test_quota_exhausted_is_rejected_with_retry_after_when_the_class_does_not_queue(stack, bus):
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(300))
    await bus.kv(S.BUCKET_QUOTAS).put("class.online.queue", orjson.dumps(0))
    assert await wait_for(lambda: stack.admitter.total == 300 and stack.admitter.core.quotas.queue_limit("online") == 0)
    slow = asyncio.create_task(stack.client.submit(make_request("t1", prompt_token_ids=list(range(100)),
                                                                max_tokens=50)))
    await wait_for(lambda: stack.admitter.shared.usage.used > 0)
    with pytest.raises(Rejected) as err:
        await stack.client.submit(make_request("t1", prompt_token_ids=list(range(100)), max_tokens=50))
    assert err.value.reason == "quota_exhausted" and err.value.retry_after > 0
    assert (await slow).status == "completed"


async def test_corrupted_quota_value_keeps_last_good_total(stack, bus):
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(5000))
    assert await wait_for(lambda: stack.admitter.total == 5000)
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, b"{not json")
    await asyncio.sleep(0.3)
    assert stack.admitter.total == 5000


@pytest.mark.parametrize(
    "fields,reason",
    [({"max_tokens": 0}, "invalid_max_tokens"), ({"cls": "gold"}, "invalid_class"),
     ({"prompt_token_ids": list(range(200_000))}, "prompt_too_long")],
)
async def test_invalid_requests_rejected_before_quota(stack, fields, reason):
    with pytest.raises(Rejected) as err:
        await stack.client.submit(make_request("t1", "x", **fields))
    assert err.value.reason == reason and err.value.retry_after is None
    assert stack.admitter.shared.usage.used == 0


async def _raw_publish(bus, payload: bytes, request_id: str):
    reply = S.reply(request_id)
    sub = await bus.inbox(reply)
    await bus.jpublish(S.request("online", "t1"), payload, msg_id=request_id, headers={S.HDR_REPLY: reply})
    msg = await sub.next_msg(timeout=5)
    await sub.unsubscribe()
    return Reply.decode(msg.data)


async def test_malformed_bytes_get_error_reply_dead_letter_and_service_keeps_serving(stack, bus):
    reply = await _raw_publish(bus, b"\xc1\xff not msgpack", "bad1")
    assert (reply.kind, reply.reason) == ("error", "malformed")
    dead = await stream_records(bus, S.STREAM_DEADLETTER, DeadLetter)
    assert [(d.subject, d.reason, d.data) for d in dead] == [("req.online.t1", "malformed", b"\xc1\xff not msgpack")]
    # the term goes out before the reply, but the server applies acks on its own time: wait for it
    async def settled():
        info = await bus.stream(S.STREAM_REQUESTS).consumer(S.CONSUMER_ADMITTER)
        return info.ack_pending == 0 and info.redelivered == 0  # terminated, not redelivered
    assert await wait_for(settled)
    result = await stack.client.submit(make_request("t1", "still serving", max_tokens=2))
    assert result.status == "completed"


async def test_missing_field_error_names_it(stack, bus):
    reply = await _raw_publish(bus, encode({"id": "bad2", "tenant": "t1", "prompt": "x"}), "bad2")
    assert reply.reason == "invalid" and "'class'" in reply.message


async def test_unknown_fields_are_ignored(stack, bus):
    wire = make_request("t1", "hello", max_tokens=2, id="extra1", reply=S.reply("extra1")).to_wire()
    wire["priority_hint"] = {"future": True}
    sub = await bus.inbox(S.reply("extra1"), S.reply("extra1") + ".*")  # the services', the workers' (S.worker_reply)
    await bus.jpublish(S.request("online", "t1"), encode(wire), msg_id="extra1")
    kinds = []
    while not kinds or kinds[-1] not in ("result", "error"):
        kinds.append(Reply.decode((await sub.next_msg(timeout=5)).data).kind)
    assert kinds[-1] == "result"


async def test_duplicate_request_id_is_answered_once(stack, bus):
    first = await stack.client.submit(make_request("t1", "once", max_tokens=2, id="dup1"))
    assert first.status == "completed"
    with pytest.raises(DuplicateRequest):
        await stack.client.submit(make_request("t1", "once", max_tokens=2, id="dup1"))
    decisions = await stream_records(bus, S.STREAM_DECISIONS, Decision, S.decision("admission", "t1"))
    assert [d.request_id for d in decisions] == [scoped("t1", "dup1")]  # the id in its tenant's scope


async def test_engine_refusal_is_reported_and_releases_tokens(stack):
    with pytest.raises(RequestFailed) as err:
        await stack.client.submit(make_request("t1", prompt_token_ids=list(range(131_000)), max_tokens=5000))
    assert err.value.reason == "prompt_too_long"
    assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)


async def test_drained_worker_gets_no_new_work(stack, bus):
    await bus.publish(S.control("w1"), Control(kind="drain", by="test"))
    assert await wait_for(lambda: stack.router.core.workers["w1"].state == "quiescing")
    results = await asyncio.gather(*(stack.client.submit(make_request("t1", f"p{i}", max_tokens=2))
                                     for i in range(4)))
    assert {r.worker for r in results} == {"w2"}
    await asyncio.wait_for(stack.workers[0].wait_drained(), 5)


async def test_no_worker_fails_cleanly_and_releases(bus, nats_url):
    stack = await start_stack(nats_url, workers=0, no_worker_wait_s=0.6)
    try:
        with pytest.raises(RequestFailed) as err:
            await stack.client.submit(make_request("t1", "anyone?", max_tokens=2))
        assert err.value.reason == "no_worker"
        assert await wait_for(lambda: stack.admitter.shared.usage.used == 0)
    finally:
        await stack.close()


async def test_routing_policy_switches_live_and_bad_config_is_ignored(stack, bus):
    await bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG,
                     orjson.dumps({"policy": "round_robin", "canary": "least_loaded", "canary_share": 0.5}))
    assert await wait_for(lambda: stack.router.core.policy.name == "round_robin", 2.0)
    assert stack.router.core.canary.name == "least_loaded"
    await bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, orjson.dumps({"policy": "no_such_policy"}))
    await bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, b"[broken")
    await asyncio.sleep(0.3)
    assert stack.router.core.policy.name == "round_robin"
    results = await asyncio.gather(*(stack.client.submit(make_request("t1", f"x{i}", max_tokens=2)) for i in range(20)))
    decisions = await stream_records(bus, S.STREAM_DECISIONS, Decision, S.decision("routing", "t1"))
    assert {d.policy for d in decisions} == {"round_robin", "least_loaded"}  # both tagged in the audit
    assert len(results) == 20  # P(all 20 on one side of a 50 % canary) ≈ 2e-6
