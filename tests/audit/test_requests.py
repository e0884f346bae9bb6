"""natsched audit against a real nats-server: one request's story, a window in numbers, bad input."""

import time
from argparse import ArgumentTypeError

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.audit.records import AuditNotFound, accepted, audit_request, audit_window, summarize, timeline
from natsched.client.producer import make_request
from natsched.client.errors import Rejected
from natsched.cli.jobs import parse_time
from natsched.wire.schema import Decision
from natsched.wire.ids import scoped
from tests.client.test_batch_submit import cli
from tests.factories.core import make_completion




async def test_an_online_request_tells_its_whole_story(stack, bus):
    system = "Shared system prompt for the audit. " * 12
    await stack.client.submit(make_request("t1", "warm", system_prompt=system, max_tokens=2))
    result = await stack.client.submit(make_request("t1", "q", system_prompt=system, max_tokens=3, id="aud1"))
    story = await audit_request(bus, "aud1")
    assert [(e["stage"], e["what"]) for e in story["events"]] == [
        ("submitted", "stored"), ("admission", "allow"), ("routing", "assign"), ("completion", "ok")]
    admission, routing, completion = story["events"][1:]
    assert admission["budget"]["total"] == stack.admitter.total and admission["runtime_tokens"] > 0
    assert set(routing["scores"]) == {"w1", "w2"} and routing["policy"] == "least_loaded"
    assert completion["worker"] == result.worker == story["worker"]
    assert story["cached_tokens"] == result.cached_tokens > 0 and story["ttft"] == pytest.approx(result.ttft)
    assert story["outcome"] == "completed"


async def test_an_inline_routed_request_tells_the_same_story_from_one_record(bus, nats_url):
    """Inline routing stores the admission record inside the routing one: the audit (story and
    window) still shows both decisions with their inputs."""
    from natsched.wire.schema import Decision
    from tests.factories.stack import start_stack

    stack = await start_stack(nats_url, inline_routing=True)
    try:
        started = time.time() - 1
        await stack.client.submit(make_request("t1", "inline audit", max_tokens=2, id="inl1"))
        stored = [Decision.decode(d) for _, d in await bus.stream_messages(S.STREAM_DECISIONS)]
        assert [(d.stage, d.request_id) for d in stored] == [("routing", scoped("t1", "inl1"))]
        story = await audit_request(bus, "inl1")
        assert [(e["stage"], e["what"]) for e in story["events"]] == [
            ("submitted", "stored"), ("admission", "allow"), ("routing", "assign"), ("completion", "ok")]
        assert story["events"][1]["budget"]["total"] == stack.admitter.total and story["admission"] == "allow"
        window = await audit_window(bus, started, tenant="t1")
        assert set(window["decisions"]) == {"admission.allow", "routing.assign"}
    finally:
        await stack.close()


async def test_a_rejected_request_ends_with_its_reason(stack, bus):
    with pytest.raises(Rejected):
        await stack.client.submit(make_request("t1", "x", max_tokens=0, id="rej1"))
    story = await audit_request(bus, "rej1")
    assert story["outcome"] == "rejected (invalid_max_tokens)"
    assert [e["stage"] for e in story["events"]] == ["submitted", "admission"]


async def test_a_queued_request_shows_its_wait(stack, bus):
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(300))
    from tests.admitter.test_offline_runner import wait_for

    assert await wait_for(lambda: stack.admitter.total == 300)
    import asyncio

    first = asyncio.create_task(stack.client.submit(make_request("t1", prompt_token_ids=list(range(100)),
                                                                 max_tokens=50)))
    await wait_for(lambda: stack.admitter.shared.usage.used > 0)
    await stack.client.submit(make_request("t1", prompt_token_ids=list(range(100)), max_tokens=50, id="q1"))
    await first
    story = await audit_request(bus, "q1")
    assert [e["stage"] for e in story["events"]][:3] == ["submitted", "queue", "admission"]
    assert story["queue_wait"] > 0


async def test_unknown_id_is_not_found_and_names_the_retention(stack, bus):
    await stack.client.submit(make_request("t1", "something", max_tokens=2))
    with pytest.raises(AuditNotFound, match="not found.*REQUESTS keeps messages for 7d"):
        await audit_request(bus, "nobody")
    with pytest.raises(ValueError):
        await audit_request(bus, "not.a.token")


async def test_window_summary_counts_decisions_and_completions(stack, bus):
    since = time.time() - 1
    for i in range(4):
        await stack.client.submit(make_request("t1", f"p{i}", max_tokens=2))
    with pytest.raises(Rejected):
        await stack.client.submit(make_request("t1", "x", max_tokens=0))
    await stack.client.submit(make_request("other", "not counted", max_tokens=2))
    s = await audit_window(bus, since, None, "t1")
    assert s["requests"] == 5 and s["completed"] == 4
    assert s["decisions"] == {"admission.allow": {"-": 4}, "admission.reject": {"invalid_max_tokens": 1},
                              "routing.assign": {"load": 4}}
    assert s["ttft_p50_s"] is not None and s["ttft_p99_s"] >= s["ttft_p50_s"]
    assert sum(s["workers"].values()) == 4


async def test_empty_window_is_an_empty_summary_exit_0(bus, nats_url):
    s = await audit_window(bus, time.time() - 60, None, "t1")
    assert (s["requests"], s["completed"], s["decisions"], s["ttft_p50_s"], s["hit_ratio"]) == (0, 0, {}, None, None)
    shown = cli(nats_url, "audit", "--tenant", "t1", "--since", "10m", "--json")
    assert shown.returncode == 0 and orjson.loads(shown.stdout)["requests"] == 0


async def test_cli_unknown_id_exits_2_with_not_found(bus, nats_url):
    shown = cli(nats_url, "audit", "ghost")
    assert shown.returncode == 2 and "request ghost not found" in shown.stderr


async def test_window_reads_respect_until(bus):
    before = time.time()
    await bus.jpublish(S.request("online", "t1"), make_request("t1", "a"), msg_id="w1")
    middle = time.time()
    await bus.jpublish(S.request("online", "t1"), make_request("t1", "b"), msg_id="w2")
    ids = [m.msg_id async for m in bus.stream(S.STREAM_REQUESTS).window(before - 1, middle)]
    assert ids == ["w1"]
    later = [m.msg_id async for m in bus.stream(S.STREAM_REQUESTS).window(middle, None)]
    assert later == ["w2"]


@pytest.mark.parametrize("text,expected", [("now", 1000.0), ("15m", 100.0), ("-15m", 100.0), ("15m ago", 100.0),
                                           ("500", 500.0), ("1970-01-01T00:10:00Z", 600.0)])
def test_times(text, expected):
    assert parse_time(text, now=1000.0) == expected


@pytest.mark.parametrize("text", ["yesterday", "15x", ""])
def test_bad_times_are_refused(text):
    with pytest.raises(ArgumentTypeError):
        parse_time(text, now=1000.0)


# --- one accepted completion per request (issue 26) ----------------------------------------------

def _rescue(rid: str) -> Decision:
    return Decision(request_id=rid, tenant="t1", cls="online", stage="admission", decision="rescue", ts=2.0)


def test_a_request_has_one_accepted_completion_the_first_of_its_current_attempt():
    a0_w1 = make_completion("a", worker="w1", attempt=0, ts=3.0)
    a0_w2 = make_completion("a", worker="w2", attempt=0, ts=4.0)  # the same attempt run again elsewhere
    assert accepted([a0_w1, a0_w2]) == [a0_w1]  # the first stored took the reservation
    stale = make_completion("b", worker="w1", attempt=0, ts=5.0)  # rescued from w1, which was only slow
    rerun = make_completion("b", worker="w2", attempt=1, ts=4.0)
    assert accepted([rerun, stale], [_rescue("b")]) == [rerun]
    assert accepted([stale, rerun], [_rescue("b")]) == [rerun]  # stored first, but of an attempt since rescued
    assert accepted([stale], [_rescue("b")]) == []  # rescued and still running: nothing accepted yet
    assert accepted([a0_w1, stale]) == [a0_w1, stale]  # two requests, one each


def test_a_stale_completion_does_not_rewrite_the_story_or_the_counts():
    first = make_completion("a", worker="w1", attempt=0, ts=3.0, status="ok")
    late = make_completion("a", worker="w2", attempt=0, ts=9.0, status="error", reason="engine_error")
    story = timeline(None, None, [], accepted([first, late]))
    assert (story["worker"], story["outcome"]) == ("w1", "completed")
    assert [e["worker"] for e in story["events"] if e["stage"] == "completion"] == ["w1"]
    counts = summarize(1, [], accepted([first, late]))
    assert (counts["completed"], counts["failed"]) == (1, {})
