"""natsched replay: a recorded window run again in the simulator, under the live and another policy."""

import asyncio
import time

import pytest

from natsched.wire import subjects as S
from natsched.client.producer import make_request
from natsched.wire.schema import Completion, Decision, Request
from natsched.sim.errors import SimConfigError
from natsched.sim.replay import ReplayError, WindowAgedOut, load_recording, match, replay
from tests.client.test_batch_submit import cli




async def record_some(stack, n: int = 16) -> float:
    """``n`` requests in 4 prefix groups; returns a time just before them."""
    since = time.time() - 1
    system = [f"group {g} shared instructions " * 20 for g in range(4)]
    await asyncio.gather(*(stack.client.submit(make_request("t1", f"q{i}", system_prompt=system[i % 4], max_tokens=4))
                           for i in range(n)))
    return since


async def test_replay_prints_recorded_beside_both_policies(stack, bus):
    since = await record_some(stack)
    recording = await load_recording(bus, since)
    assert recording.submitted == 16 and len(recording.routed) == 16
    assert {r.policy for r in recording.routed} == {"least_loaded"}
    assert all(r.completion is not None and r.completion.request_id == r.request.id for r in recording.routed)
    report = replay(recording, "round_robin", time_scale=0.05)
    assert report.baseline == "least_loaded" and report.workers == 2
    assert list(report.columns) == ["recorded", "replay least_loaded", "replay round_robin"]
    for column in report.columns.values():
        assert (column["requests"], column["completed"]) == (16, 16) and column["workers_used"] == 2
    same = replay(recording, "least_loaded", time_scale=0.05)
    assert list(same.columns) == ["recorded", "replay least_loaded"]


async def test_a_window_that_aged_out_names_the_retention(stack, bus, nats_url):
    await record_some(stack, 2)
    gone_until = time.time()
    await asyncio.sleep(0.01)
    await stack.client.submit(make_request("t1", "kept", max_tokens=2))
    await bus.js.purge_stream(S.STREAM_REQUESTS, keep=1)  # what max_age does to old messages
    with pytest.raises(WindowAgedOut, match="aged out: REQUESTS keeps messages for 7d and at most 1 GiB"):
        await load_recording(bus, gone_until - 60, gone_until)
    done = cli(nats_url, "replay", "--since", str(gone_until - 60), "--until", str(gone_until), "--policy",
               "round_robin")
    assert done.returncode == 1 and "aged out" in done.stderr and "retention" in done.stderr


async def test_an_empty_window_replays_nothing_exit_0(stack, bus, nats_url):
    recording = await load_recording(bus, time.time() - 60)
    assert (recording.submitted, recording.routed) == (0, [])
    done = cli(nats_url, "replay", "--since", "1m", "--policy", "round_robin")
    assert done.returncode == 0 and "nothing to replay" in done.stdout


async def test_an_unknown_policy_is_refused_with_the_known_ones(stack, bus):
    since = await record_some(stack, 2)
    recording = await load_recording(bus, since)
    with pytest.raises(SimConfigError, match="round_robin"):
        replay(recording, "no_such_policy")
    with pytest.raises(ReplayError):
        replay(recording, "round_robin", time_scale=0)


def test_retry_attempts_count_as_their_job_and_stale_completions_are_ignored():
    req = Request(id="job1", tenant="t1", cls="batch", prompt="x")
    routing = [Decision(request_id=rid, tenant="t1", stage="routing", decision="assign", ts=ts, worker=w,
                        policy="natsched") for rid, ts, w in (("job1", 1.0, "w1"), ("job1-r2", 5.0, "w2"))]
    done = [Completion(request_id=rid, tenant="t1", status=st, runtime_tokens=1, ts=ts)
            for rid, st, ts in (("job1", "error", 2.0), ("job1-r2", "ok", 6.0), ("stranger", "ok", 3.0))]
    (only,) = match({"job1": (req, 0.5)}, routing, done)
    assert (only.arrival, only.worker, only.completion.request_id) == (5.0, "w2", "job1-r2")
