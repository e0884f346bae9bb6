"""Status readers under partitioned admission, against a real nats-server and two real partition
admitters: ``natsched status``, ``quota show`` and the gateway's ``/status`` show what the
partitions hold (their usage keys added, each partition's use and budget), not the empty
unpartitioned ``inflight/usage``."""

from __future__ import annotations

import asyncio

import orjson

from natsched.admitter.budget import partition_of
from natsched.admitter.coordinator import decode_plan
from natsched.admitter.inflight import decode_inflight
from natsched.admitter.usage import Usage
from natsched.gateway.status import StatusCollector, StatusSettings
from natsched.gateway.status_page import render_html
from natsched.ops.status import render_text
from natsched.wire import subjects as S
from tests.admitter.test_partitions import start_partition
from tests.admitter.test_service import decisions, publish, request, set_quotas, stop
from tests.cli.test_status import natsched
from tests.factories.core import wait_for as until

A, B = "globex", "acme"  # partitions 0 and 1 of 2
assert (partition_of(A, 2), partition_of(B, 2)) == (0, 1)


def test_partition_usages_are_added_and_a_bad_key_is_a_warning():
    u0 = Usage().plus(A, "m", 300, cls=S.ONLINE)
    u1 = Usage().plus(B, "m", 600, cls=S.ONLINE).plus(B, "n", 100, cls=S.BATCH)
    plan = orjson.dumps({"epoch": 4, "total": 3000, "grants": {"0": 1000, "1": 2000}})
    view = decode_inflight({0: u0.to_json(), 1: u1.to_json()}, plan, partitioned=True)
    assert (view.usage.used, view.usage.tenants, view.usage.models) == (1000, {A: 300, B: 700}, {"m": 900, "n": 100})
    assert view.usage.classes == {S.ONLINE: 900, S.BATCH: 100}
    assert [(p.partition, p.used, p.budget) for p in view.partitions] == [(0, 300, 1000), (1, 700, 2000)]
    assert view.plan_epoch == 4 and not view.warnings
    broken = decode_inflight({0: b"{garbage", 1: u1.to_json()}, b"not a plan", partitioned=True)
    assert broken.corrupt and broken.usage.used == 700 and len(broken.warnings) == 2
    assert [p.budget for p in broken.partitions] == [None, None]


async def test_status_quota_show_and_the_status_page_sum_the_partitions(bus, nats_url):
    await set_quotas(bus, cluster__total=3000, class__online__queue=100)
    a0 = await start_partition(nats_url, 0, coordinate=True)
    a1 = await start_partition(nats_url, 1)
    try:
        await asyncio.gather(*(publish(bus, request(t)) for t in (A, A, B, B, B)))  # 300 each, all fit

        async def all_allowed():
            return sum(d.decision == "allow" for d in await decisions(bus)) == 5
        assert await until(all_allowed)
        assert await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE) is None  # what the readers used to read

        collector = StatusCollector(bus, StatusSettings(backfill=100))
        await collector.start()
        got = {}

        async def shows_the_plan_in_force():  # (the coordinator may rebalance between two reads)
            got["view"] = await collector.snapshot()
            got["plan"] = decode_plan((await bus.kv(S.BUCKET_BUDGET).get(S.KEY_PLAN))[0])
            return [p.budget for p in got["view"].partitions] == [got["plan"].grant(0), got["plan"].grant(1)]
        assert await until(shows_the_plan_in_force)
        view, plan = got["view"], got["plan"]
        assert view.used == 1500 and {t.tenant: t.used for t in view.tenants} == {A: 600, B: 900}
        assert [(p.partition, p.used) for p in view.partitions] == [(0, 600), (1, 900)]
        text = render_text(view)
        assert "in use 1500 of 3000" in text and f"p1 900/{plan.grant(1)}" in text
        assert "<table id=partitions>" in render_html(view) and orjson.loads(view.to_json())["partitions"][1]["used"] == 900

        proc = await natsched("quota", "show", "--json", "--nats-url", nats_url)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        shown = orjson.loads(out)
        assert shown["used"] == 1500 and (shown["tenants"].get(A), shown["classes"]["online"]["used"]) == (None, 1500)
        assert [p["used"] for p in shown["partitions"]] == [600, 900] and shown["plan_epoch"] >= plan.epoch
        assert all(p["used"] <= p["budget"] for p in shown["partitions"])
        assert sum(p["budget"] for p in shown["partitions"]) <= 3000

        proc = await natsched("status", "--nats-url", nats_url)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert "in use 1500 of 3000" in out.decode() and "PARTITIONS (2" in out.decode()
    finally:
        await stop(a0, a1)
