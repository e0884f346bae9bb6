"""The role permission model (natsched.wire.roles), as data: no server needed (tests/ops runs them on one)."""

import subprocess
import sys

import pytest

from natsched.wire import roles as R
from natsched.wire import subjects as S


def test_render_fills_the_given_placeholders_and_opens_the_rest():
    assert R.render("decision.<stage>.<tenant>", stage="admission") == "decision.admission.*"
    assert R.subject("tenant_reply", tenant="A") == "resp.A.*"
    with pytest.raises(ValueError):
        R.render("req.<class>.<tenant>", tenant="a.b")


def test_a_producer_may_publish_its_own_tenants_requests_and_cancels_only():
    role = R.producer_role("A")
    assert role.user == "producer-A" and role.publish == [S.requests_of("A"), S.cancels_of("A")]
    allowed = role.permissions()
    assert allowed["subscribe"]["allow"] == ["_INBOX.producer-A.>", S.replies_of("A")]


def test_a_workers_consumer_is_pinned_to_its_own_work_subject():
    pub = R.worker_role("w1").publish
    assert R._js("CONSUMER", "CREATE", S.STREAM_WORK, S.worker_consumer("w1"), S.work("w1")) in pub
    assert not any(p.startswith("$JS.API.CONSUMER.CREATE.WORK.") and p.endswith((".>", ".*")) for p in pub)
    assert S.ADMITTED_ALL not in pub and not any(p.startswith("decision.") for p in pub)


def test_the_scheduler_is_exactly_the_admitter_and_the_router_together():
    adm, rtr, both = R.admitter_role(), R.router_role(), R.scheduler_role()
    assert set(both.publish) == set(adm.publish) | set(rtr.publish)
    assert set(both.subscribe) == set(adm.subscribe) | set(rtr.subscribe)


def test_roles_lists_each_user_once_and_refuses_bad_names():
    users = [r.user for r in R.roles(["A", "B"], ["w1"])]
    assert len(users) == len(set(users)) and {"admin", "gateway", "batch-A", "producer-B", "worker-w1"} <= set(users)
    with pytest.raises(ValueError):
        R.gateway_role([])
    with pytest.raises(ValueError):
        R.worker_role("w.1")


def test_the_wire_package_imports_no_nats():
    code = ("import sys, pkgutil, importlib, natsched.wire as w\n"
            "for m in pkgutil.iter_modules(w.__path__): importlib.import_module('natsched.wire.' + m.name)\n"
            "bad = sorted(n for n in sys.modules if n == 'nats' or n.startswith(('nats.', 'natsched.bus')))\n"
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_gateway_cancels_its_own_tenants_requests_and_touches_no_worker_control():
    pub = R.gateway_role(["A", "B"]).publish
    assert S.cancels_of("A") in pub and S.cancels_of("B") in pub
    assert not any(p.startswith("worker.") or p.startswith("cancel.*") or p == S.CANCELS_ALL for p in pub)


def test_every_service_that_holds_a_request_hears_every_cancel():
    for role in (R.admitter_role(), R.router_role(), R.scheduler_role(), R.worker_role("w1")):
        assert S.CANCELS_ALL in role.subscribe, role.user
        assert not any(p.startswith("cancel.") for p in role.publish), role.user


def _rights(role: R.Role) -> tuple[list[str], list[str]]:
    return role.publish, role.subscribe


def test_partitions_and_pools_add_their_users_and_grow_no_producer_worker_or_batch_right():
    plain = {r.user: r for r in R.roles(["A", "B"], ["w1"])}
    split = {r.user: r for r in R.roles(["A", "B"], ["w1"], partitions=4, pools=["a", "b"])}
    assert set(split) - set(plain) == {"admitter-p0", "admitter-p1", "admitter-p2", "admitter-p3", "coordinator",
                                       "router-a", "router-b"}
    assert set(plain) <= set(split)
    for user in ("producer-A", "batch-B", "worker-w1", "admitter", "router", "scheduler"):
        assert _rights(split[user]) == _rights(plain[user]), user
    assert [r.user for r in R.roles(["A"], ["w1"], partitions=1)] == [r.user for r in R.roles(["A"], ["w1"])]
    with pytest.raises(ValueError, match="partitions"):
        R.roles(["A"], ["w1"], partitions=0)


def test_a_partition_admitter_names_its_own_partition_only():
    for k in range(4):
        pub = R.partition_admitter_role(k).publish
        mine = {f"inflight-p{k}", f"admitter-p{k}", f"admitter-completions-p{k}"}
        others = [p for p in pub for j in range(8) if j != k and (
            f"-p{j}." in p or p.endswith(f"-p{j}") or f"reqp.{j}." in p or f"report.{j}." in p)]
        assert not others, others
        assert R._js("CONSUMER", "CREATE", S.STREAM_REQUESTS, f"admitter-p{k}", f"reqp.{k}.>") in pub
        assert any(m in p for p in pub for m in mine)
        assert not any(p.startswith(("$KV.inflight.", "$KV.*")) or ".admitter." in p for p in pub)
        assert "$KV.quotas." + S.KEY_DYNAMIC_TOTAL not in pub  # off in a partition
        assert "$KV.budget.plan" in pub and "$KV.budget.coordinator" in pub  # every one is a candidate
    coordinator = R.coordinator_role()
    assert not any(p.startswith(("$KV.inflight", "$KV.budget.report", "adm.", "resp.", "work.")) for p in coordinator.publish)
    assert not any("CONSUMER.CREATE.REQUESTS" in p for p in coordinator.publish)


def test_the_runner_and_the_gateway_reach_every_partition_up_to_n_and_write_no_budget():
    runner, gateway = R.offline_role(partitions=3).publish, R.gateway_role(["A"], partitions=3).publish
    for k in range(3):
        assert f"$KV.inflight-p{k}.usage" in runner and f"$KV.inflight-p{k}.res.*" in runner
        assert not any(p.startswith(f"$KV.inflight-p{k}") for p in gateway)  # gets only
        assert R._js("DIRECT", "GET", f"KV_inflight-p{k}", f"$KV.inflight-p{k}.usage") in gateway
    assert not any("inflight-p3" in p for p in runner + gateway)
    assert not any(p.startswith("$KV.budget") for p in runner + gateway)
    assert R.offline_role().publish == R.offline_role(partitions=1).publish


def test_a_pool_routers_consumer_is_pinned_to_its_pool():
    pub = R.router_role("a").publish
    assert R._js("CONSUMER", "CREATE", S.STREAM_ADMITTED, "router-a", "adm.a.>") in pub
    assert not any(p.startswith("$JS.API.CONSUMER.CREATE.ADMITTED.") and "router-a.adm.a." not in p for p in pub)
