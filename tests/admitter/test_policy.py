"""AdmitterCore.evaluate/apply: every decision and reason code, and that evaluating changes nothing."""

import pytest

from natsched.admitter.errors import QuotaError, SettingsError
from natsched.admitter.policy import ALLOW, DEGRADE, QUEUE, REJECT, AdmissionSettings, AdmitterCore
from natsched.admitter.quotas import Quotas, TenantQuota
from tests.factories.core import make_completion, make_request


def sized(cost: int, tenant: str = "t1", cls: str = "online", **fields):
    """A request costing exactly ``cost`` runtime tokens (2 × prompt + max_tokens)."""
    out = 2 if cost % 2 == 0 else 1
    return make_request(prompt_token_ids=[0] * ((cost - out) // 2), max_tokens=out, tenant=tenant, cls=cls,
                        **fields)


def make_core(total: int = 1000, tenants: dict | None = None, quotas: dict | None = None, **settings) -> AdmitterCore:
    q = Quotas(total=total, tenants=tenants or {}, **(quotas or {}))
    return AdmitterCore(AdmissionSettings(**settings), q)


def submit(core, request, now: float = 0.0):
    decision = core.evaluate(request, now)
    core.apply(request, decision, now)
    return decision


def fill(core, cost: int, tenant: str = "filler", now: float = 0.0):
    """Reserve ``cost`` tokens for ``tenant`` through the normal path."""
    d = submit(core, sized(cost, tenant=tenant), now)
    assert d.decision == ALLOW
    return d


def test_sized_helper_costs_what_it_says():
    core = make_core()
    assert [core.cost(sized(c)) for c in (3, 10, 101, 5000)] == [3, 10, 101, 5000]


def test_unknown_tenant_gets_default_quota_or_is_rejected():
    default = make_core(tenants={"known": TenantQuota(floor=0.5)},
                        quotas={"default_tenant": TenantQuota(cap=50)})
    assert default.evaluate(sized(40, tenant="stranger"), 0).decision == ALLOW
    d = default.evaluate(sized(60, tenant="stranger"), 0)
    assert (d.decision, d.reason) == (REJECT, "tenant_cap")  # the default tenant's cap applies
    strict = make_core(tenants={"known": TenantQuota()}, quotas={"unknown_tenant": "reject"})
    d = strict.evaluate(sized(10, tenant="stranger"), 0)
    assert (d.decision, d.reason) == (REJECT, "unknown_tenant")
    assert strict.evaluate(sized(10, tenant="known"), 0).decision == ALLOW


def test_tenant_cap_never_and_now():
    core = make_core(tenants={"a": TenantQuota(cap=100)})
    d = core.evaluate(sized(150, tenant="a"), 0)
    assert (d.decision, d.reason, d.retry_after) == (REJECT, "tenant_cap", None)  # can never fit
    fill(core, 80, tenant="a")
    d = core.evaluate(sized(30, tenant="a"), 0)
    assert (d.decision, d.reason) == (REJECT, "tenant_cap") and d.retry_after > 0  # fits once it releases
    assert core.evaluate(sized(20, tenant="a"), 0).decision == ALLOW


def test_model_limit_never_rejects_and_now_queues():
    core = make_core(quotas={"models": {"big": 100}})
    d = core.evaluate(sized(150, model="big"), 0)
    assert (d.decision, d.reason) == (REJECT, "model_limit")
    assert submit(core, sized(80, model="big")).decision == ALLOW
    assert submit(core, sized(30, model="big")).decision == QUEUE  # waits for its model's releases
    assert submit(core, sized(30, model="small")).decision == ALLOW  # other models are not held up


def test_too_large_against_the_current_dynamic_total():
    core = make_core(total=1000, quotas={"hard_cap": 500})
    assert core.total == 500  # the configured total never passes the hard cap
    core.set_total(2000)
    assert core.total == 500
    core.set_total(200)
    d = core.evaluate(sized(300), 0)
    assert (d.decision, d.reason) == (REJECT, "too_large")


def test_offline_always_degrades_batch_only_when_tight():
    core = make_core(total=1000, degrade_watermark=0.8)
    d = core.evaluate(sized(10, cls="offline"), 0)
    assert (d.decision, d.reason) == (DEGRADE, "offline")
    assert core.evaluate(sized(100, cls="batch"), 0).decision == ALLOW
    fill(core, 750)
    d = core.evaluate(sized(100, cls="batch"), 0)  # 850 > 800
    assert (d.decision, d.reason) == (DEGRADE, "watermark")
    assert core.evaluate(sized(40, cls="batch"), 0).decision == ALLOW  # 790 <= 800
    d = core.evaluate(sized(100, degradable=True), 0)  # an online request flagged degradable
    assert d.decision == DEGRADE
    assert core.evaluate(sized(100), 0).decision == ALLOW  # plain online work is not degraded


def test_deadline_already_passed_is_rejected():
    core = make_core()
    d = core.evaluate(sized(10, deadline=5.0), 10.0)
    assert (d.decision, d.reason) == (REJECT, "deadline_exceeded")
    assert core.evaluate(sized(10, deadline=50.0), 10.0).decision == ALLOW


def test_queue_full_with_retry_after():
    core = make_core(total=100, quotas={"queue_limits": {"online": 2, "batch": 5}})
    fill(core, 100, tenant="t1")
    assert [submit(core, sized(10)).decision for _ in range(2)] == [QUEUE, QUEUE]
    d = submit(core, sized(10))
    assert (d.decision, d.reason) == (REJECT, "queue_full") and d.retry_after > 0
    assert core.queue_depths() == {"online": 2}


def test_full_queue_still_takes_a_tenant_owed_its_share():
    core = make_core(total=100, tenants={"hog": TenantQuota(floor=0.1), "small": TenantQuota(floor=0.5)},
                     quotas={"queue_limits": {"online": 4}})
    fill(core, 100, tenant="hog")
    assert [submit(core, sized(10, tenant="hog")).decision for _ in range(5)] == [QUEUE] * 4 + [REJECT]
    assert submit(core, sized(10, tenant="small")).decision == QUEUE  # holds none of its slice yet
    assert core.queued() == 5


def test_class_without_queue_is_quota_exhausted():
    core = make_core(total=100, quotas={"queue_limits": {"online": 0}})
    fill(core, 95)
    d = submit(core, sized(10))
    assert (d.decision, d.reason) == (REJECT, "quota_exhausted") and d.retry_after >= 1.0


def test_early_reject_when_estimated_wait_is_beyond_the_timeout():
    core = make_core(total=100, queue_timeout_s=5.0, rate_window_s=10.0)
    for i in range(10):  # a measured release rate of ~2 tokens/s
        core.release(make_completion(f"old{i}", runtime_tokens=2), float(i))
    fill(core, 100, now=10.0)
    first = submit(core, sized(8), 10.0)
    assert first.decision == QUEUE and 0 < first.est_wait <= 5.0
    d = submit(core, sized(90), 10.0)
    assert (d.decision, d.reason) == (REJECT, "quota_exhausted")
    assert d.retry_after > 1.0 and "estimated wait" in d.message


def test_no_early_reject_without_a_measured_rate():
    core = make_core(total=100, queue_timeout_s=0.001)
    fill(core, 100)
    d = submit(core, sized(90))
    assert d.decision == QUEUE and d.est_wait > 0


def test_evaluate_has_no_side_effects():
    core = make_core(total=100)
    req = sized(40)
    for _ in range(3):
        assert core.evaluate(req, 0).decision == ALLOW
    assert core.usage.used == 0 and core.queued() == 0
    fill(core, 100)
    for _ in range(3):
        assert core.evaluate(sized(10), 0).decision == QUEUE
    assert core.queued() == 0


def test_redelivered_queued_request_keeps_its_single_place():
    core = make_core(total=100)
    fill(core, 100)
    req = sized(10)
    assert submit(core, req, 1.0).decision == QUEUE
    again = submit(core, req, 5.0)
    assert again.decision == QUEUE and again.runtime_tokens == 10
    assert core.queued() == 1
    assert core.queue.get(req.id).enqueued_at == 1.0  # its place, not a new one


def test_forget_drops_a_queued_request():
    core = make_core(total=100)
    fill(core, 100)
    req = sized(10)
    submit(core, req)
    assert core.forget(req.id) is True and core.forget(req.id) is False
    assert core.queued() == 0 and core.plan_dequeue(1.0) == []


def test_decision_carries_the_budget_for_audit():
    core = make_core(total=100, tenants={"a": TenantQuota(floor=0.5)})
    fill(core, 30, tenant="a")
    d = core.evaluate(sized(10, tenant="a"), 0)
    assert d.budget == {"used": 30, "total": 100, "queued": 0, "tenant_used": 30, "tenant_floor": 50}


def test_set_quotas_refuses_invalid_and_keeps_the_old():
    core = make_core(total=1000, tenants={"a": TenantQuota(floor=0.6)})
    bad = Quotas(total=1000, tenants={"a": TenantQuota(floor=0.6), "b": TenantQuota(floor=0.6)})
    with pytest.raises(QuotaError, match="floors sum to 1.200"):
        core.set_quotas(bad)
    assert set(core.quotas.tenants) == {"a"}
    core.set_total(300)
    core.set_quotas(Quotas(total=800))
    assert core.total == 800  # new quotas: the total restarts from their ceiling


@pytest.mark.parametrize("field,value", [("reserve_long_share", 1.0), ("reserve_long_share", -0.1),
                                         ("degrade_watermark", 1.5), ("queue_timeout_s", -1),
                                         ("long_threshold_tokens", 0)])
def test_settings_out_of_range_are_refused(field, value):
    with pytest.raises(SettingsError, match=field):
        AdmissionSettings(**{field: value})
