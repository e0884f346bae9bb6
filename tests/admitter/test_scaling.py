"""Scaling signals: the pure advisor, then the admitter publishing them on a real nats-server
and ``natsched status`` showing the latest (issue 25)."""

import time

import pytest

from natsched.admitter.errors import SettingsError
from natsched.admitter.scaling import IN, OUT, ScaleAdvisor, ScaleSettings, WorkerLoad, p95
from natsched.wire import subjects as S
from natsched.wire.schema import Heartbeat, ScaleEvent

W = [WorkerLoad("w1", 10_000, 9_000), WorkerLoad("w2", 10_000, 9_500)]


def advisor(**kw) -> ScaleAdvisor:
    kw.setdefault("window_s", 60)
    kw.setdefault("idle_window_s", 120)
    kw.setdefault("repeat_s", 30)
    return ScaleAdvisor(ScaleSettings(**kw))


def test_p95_is_the_nearest_rank():
    assert p95([]) == 0.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([3.0]) == 3.0


def test_scale_out_needs_the_wait_over_the_threshold_for_the_whole_window():
    a = advisor()
    for t in range(0, 60, 5):  # queued requests waiting 6 s and more: over 5 s, but not for 60 s yet
        assert a.check(1000 + t, [6.0 + t], 30_000, 19_000, W) is None
    sig = a.check(1060, [66.0], 30_000, 19_000, W)
    assert sig is not None and sig.kind == OUT
    # demand 49 000 runtime tokens over 10 000 per worker: 5 workers, 2 there, so add 3
    assert (sig.add, sig.worker_capacity, sig.demand_tokens, sig.workers) == (3, 10_000, 49_000, 2)
    assert a.check(1065, [71.0], 30_000, 19_000, W) is None  # not again before repeat_s
    assert a.check(1090, [96.0], 30_000, 19_000, W).kind == OUT  # still holding: repeated


def test_a_short_spike_does_not_scale_out_and_the_condition_restarts():
    a = advisor()
    a.check(1000, [8.0], 1000, 0, W)
    assert a.check(1030, [], 0, 0, W) is None and a.over_since is None  # the queue emptied
    for t in (1100, 1120, 1150):
        a.observe_wait(t, 1.0)
        assert a.check(t, [], 0, 18_000, W) is None


def test_finished_waits_count_and_age_out_of_the_window():
    a = advisor()
    for t in range(0, 61, 5):
        a.observe_wait(2000 + t, 7.0)
        sig = a.check(2000 + t, [], 0, 19_000, W)
    assert sig is not None and sig.kind == OUT and sig.add == 1  # demand fits: still at least one
    assert a.check(2200, [], 0, 19_000, W) is None  # the waits left the window


def test_scale_in_picks_the_least_loaded_worker_after_an_idle_window():
    a = advisor()
    idle = [WorkerLoad("w1", 10_000, 300), WorkerLoad("w2", 10_000, 0), WorkerLoad("w3", 8_000, 0)]
    assert a.check(0, [], 0, 300, idle) is None
    assert a.check(119, [], 0, 300, idle) is None
    sig = a.check(120, [], 0, 300, idle)
    assert sig.kind == IN and sig.drain == "w3"  # none in use on w2 and w3: the smaller one
    assert a.check(125, [], 0, 300, [WorkerLoad("w1", 10_000, 5_000)] + idle[1:]) is None  # busy: over


def test_no_scale_in_below_the_minimum_nor_while_anything_queues():
    a = advisor(min_workers=2)
    two = [WorkerLoad("w1", 10_000, 0), WorkerLoad("w2", 10_000, 0)]
    assert all(a.check(t, [], 0, 0, two) is None for t in range(0, 400, 10))
    b = advisor()
    assert all(b.check(t, [0.5], 10, 0, two) is None for t in range(0, 400, 10))


@pytest.mark.parametrize("bad", [dict(out_wait_s=0), dict(window_s=-1), dict(idle_util=1.0),
                                 dict(min_workers=0), dict(repeat_s=float("nan")), dict(interval_s="5")])
def test_bad_scale_settings_are_refused(bad):
    with pytest.raises(SettingsError, match="scale"):
        ScaleSettings(**bad)


async def test_the_admitter_publishes_scale_out_and_status_shows_it(bus, nats_url):
    from tests.admitter.test_service import publish, request, set_quotas, start_admitter, stop
    from natsched.ops.status import read_scale, render_scale
    from tests.factories.core import wait_for

    await set_quotas(bus, cluster__total=300)  # one request of 300 fits, the next ones queue
    adm = await start_admitter(nats_url, scale=ScaleSettings(out_wait_s=0.2, window_s=0.5, repeat_s=60,
                                                             interval_s=0.1))
    seen: list[ScaleEvent] = []

    async def on_scale(subject, data, headers):
        seen.append(ScaleEvent.decode(data))

    await bus.subscribe(S.SCALE_ALL, on_scale)
    try:
        # one worker reporting 300 runtime tokens of capacity, all in use
        hb = Heartbeat(worker="w1", seq=1, ts=time.time(), capacity_tokens=300, runtime_tokens=300, interval=30)
        await bus.publish(S.heartbeat("w1"), hb)
        assert await wait_for(lambda: "w1" in adm.worker_load)
        for _ in range(3):
            await publish(bus, request())  # 300 runtime tokens each
        assert await wait_for(lambda: seen, timeout=30)
        event = seen[0]
        assert event.kind == "out" and event.by == "admitter" and event.workers == 1
        assert event.add == 2  # 900 tokens of demand over 300 per worker, 1 there
        assert adm.metrics.scale_signals.labels("out")._value.get() >= 1
        stored = await read_scale(bus)
        assert stored is not None and stored.kind == "out"
        assert "scale out: add 2 worker(s)" in render_scale(stored, stored.ts + 1)
    finally:
        await stop(adm)


async def test_an_idle_cluster_is_advised_to_drain_its_least_loaded_worker_and_status_says_which(bus, nats_url):
    import os
    import subprocess
    import sys

    import orjson

    from tests.admitter.test_service import start_admitter, stop
    from tests.factories.core import wait_for

    adm = await start_admitter(nats_url, scale=ScaleSettings(idle_window_s=0.5, interval_s=0.1, idle_util=0.1))
    seen: list[ScaleEvent] = []

    async def on_scale(subject, data, headers):
        seen.append(ScaleEvent.decode(data))

    await bus.subscribe(S.SCALE_ALL, on_scale)
    try:
        for wid, used in (("w1", 50), ("w2", 0), ("w3", 20)):  # 70 of 3000 in use: idle
            await bus.publish(S.heartbeat(wid), Heartbeat(worker=wid, seq=1, ts=time.time(), capacity_tokens=1000,
                                                          runtime_tokens=used, interval=30))
        assert await wait_for(lambda: len(adm.worker_load) == 3)
        assert await wait_for(lambda: seen, timeout=30)
        event = seen[0]
        assert event.kind == "in" and event.drain == "w2" and event.workers == 3 and event.add == 0
        assert adm.metrics.scale_advice.labels("in")._value.get() == 1
        assert adm.metrics.scale_signals.labels("in")._value.get() == 1
        env = os.environ | {"NATSCHED_NATS_URL": nats_url}
        cmd = [sys.executable, "-m", "natsched", "status"]
        text = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert text.returncode == 0 and "scale in: drain w2" in text.stdout, text.stdout + text.stderr
        shown = orjson.loads(subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True,
                                            timeout=60).stdout)
        assert shown["scale"]["kind"] == "in" and shown["scale"]["drain"] == "w2"
    finally:
        await stop(adm)
        await bus.kv(S.BUCKET_CONFIG).delete(S.KEY_SCALE)
