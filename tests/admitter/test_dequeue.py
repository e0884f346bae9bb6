"""The queue: token-weighted dequeue, floors and weights, the long reserve, aging, expiry."""

from hypothesis import given, settings, strategies as st

from natsched.admitter.policy import ALLOW, QUEUE, REJECT, AdmissionSettings, AdmitterCore
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.admitter.usage import Usage
from tests.factories.core import make_completion, make_request


def sized(cost: int, tenant: str = "t1", cls: str = "online", **fields):
    out = 2 if cost % 2 == 0 else 1
    return make_request(prompt_token_ids=[0] * ((cost - out) // 2), max_tokens=out, tenant=tenant, cls=cls,
                        **fields)


def make_core(total: int = 100, tenants: dict | None = None, quotas: dict | None = None, **settings) -> AdmitterCore:
    settings.setdefault("early_reject", False)
    settings.setdefault("queue_timeout_s", 1000.0)
    settings.setdefault("degrade_watermark", 1.0)
    return AdmitterCore(AdmissionSettings(**settings), Quotas(total=total, tenants=tenants or {}, **(quotas or {})))


def submit(core, request, now: float = 0.0):
    decision = core.evaluate(request, now)
    core.apply(request, decision, now)
    return decision


def finish(core, request, now: float = 0.0, output_tokens: int = 1):
    return core.release(make_completion(request.id, tenant=request.tenant, runtime_tokens=core.cost(request),
                                        model=request.model, output_tokens=output_tokens), now)


def drain(core, now: float = 0.0):
    picks = core.plan_dequeue(now)
    core.commit_dequeue(picks, now)
    return picks


def allowed(picks):
    return [r.id for r, d in picks if d.decision == ALLOW]


def test_dequeue_fills_the_free_budget_by_tokens_not_by_count():
    core = make_core(total=100)
    big = sized(100)
    assert submit(core, big).decision == ALLOW
    small = [sized(10) for _ in range(12)]
    assert {submit(core, r).decision for r in small} == {QUEUE}
    finish(core, big, 1.0)
    picks = drain(core, 1.0)
    assert allowed(picks) == [r.id for r in small[:10]]  # all that fit, in order
    assert core.usage.used == 100 and core.queued() == 2


def test_no_backfill_past_the_top_request():
    core = make_core(total=100)
    filler = sized(50)
    submit(core, filler)
    head, behind = sized(60), sized(10)
    assert submit(core, head, 1.0).decision == QUEUE
    assert submit(core, behind, 2.0).decision == QUEUE  # would fit, but does not jump the head
    assert core.plan_dequeue(3.0) == []
    finish(core, filler, 4.0)
    assert allowed(drain(core, 4.0)) == [head.id, behind.id]


def test_plan_has_no_side_effects_and_commit_applies_it():
    core = make_core(total=100)
    filler = sized(100)
    submit(core, filler)
    queued = [sized(30) for _ in range(3)]
    for r in queued:
        submit(core, r)
    finish(core, filler, 1.0)
    first, second = core.plan_dequeue(1.0), core.plan_dequeue(1.0)
    assert [r.id for r, _ in first] == [r.id for r, _ in second] == [r.id for r in queued]
    assert core.queued() == 3 and core.usage.used == 0
    core.commit_dequeue(first, 1.0)
    assert core.queued() == 0 and core.usage.used == 90
    core.commit_dequeue(first, 1.0)  # committing again (e.g. a retried loop) changes nothing
    assert core.usage.used == 90


def test_backlogged_tenant_below_its_floor_goes_first():
    core = make_core(total=100, tenants={"a": TenantQuota(floor=0.5), "b": TenantQuota(floor=0.5)})
    a_running = [sized(25, tenant="a") for _ in range(4)]
    assert [submit(core, r).decision for r in a_running] == [ALLOW] * 4  # b idle: a may use it all
    a_next, b_next = sized(25, tenant="a"), sized(25, tenant="b")
    submit(core, a_next, 1.0)
    submit(core, b_next, 2.0)  # younger, but b is below its floor
    finish(core, a_running[0], 3.0)
    assert allowed(drain(core, 3.0)) == [b_next.id]


def test_elastic_use_may_not_eat_a_backlogged_tenants_unused_floor():
    core = make_core(total=100, tenants={"b": TenantQuota(floor=0.6), "c": TenantQuota()},
                     quotas={"models": {"m": 50}})
    submit(core, sized(45, tenant="b", model="m"))
    stuck = sized(10, tenant="b", model="m")
    assert submit(core, stuck).decision == QUEUE  # its model is at its limit: b is backlogged, 15 below floor
    assert core.evaluate(sized(50, tenant="c"), 0).decision == QUEUE  # would leave 5; b's unused floor is 15
    assert core.evaluate(sized(40, tenant="c"), 0).decision == ALLOW  # leaves exactly b's 15


def test_idle_capacity_is_shared_by_weight():
    core = make_core(total=400, tenants={"x": TenantQuota(weight=1), "y": TenantQuota(weight=3)})
    filler = sized(400, tenant="z")
    submit(core, filler)
    for i in range(40):
        submit(core, sized(10, tenant="x"), float(i))
        submit(core, sized(10, tenant="y"), float(i))
    finish(core, filler, 50.0)
    drain(core, 50.0)
    assert (core.usage.tenant("x"), core.usage.tenant("y")) == (100, 300)


def test_floors_first_then_weights():
    core = make_core(total=400, tenants={"x": TenantQuota(floor=0.5, weight=1), "y": TenantQuota(weight=1)})
    filler = sized(400, tenant="z")
    submit(core, filler)
    for i in range(40):
        submit(core, sized(10, tenant="x"), float(i))
        submit(core, sized(10, tenant="y"), float(i))
    finish(core, filler, 50.0)
    drain(core, 50.0)
    assert (core.usage.tenant("x"), core.usage.tenant("y")) == (300, 100)  # 200 floor + half of the idle 200


def test_long_reserve_keeps_room_for_waiting_long_requests():
    core = make_core(total=100, tenants={"s": TenantQuota(floor=0.9)}, long_threshold_tokens=50,
                     reserve_long_share=0.2)
    submit(core, sized(35, tenant="s"))  # short work in flight
    submit(core, sized(35, tenant="s"))
    assert core.usage.long == 0
    short = sized(20, tenant="s")
    assert core.evaluate(short, 0).decision == ALLOW  # no long request waiting: 90 is fine
    assert submit(core, sized(50, tenant="l"), 1.0).decision == QUEUE
    assert core.evaluate(short, 2.0).decision == QUEUE  # 90 would eat into the 20 kept for long requests
    assert core.evaluate(sized(10, tenant="s"), 2.0).decision == ALLOW  # 80 leaves the reserve whole


def test_short_requests_compete_freely_once_long_ones_hold_the_reserve():
    core = make_core(total=100, tenants={"s": TenantQuota(floor=0.9)}, long_threshold_tokens=30,
                     reserve_long_share=0.2)
    submit(core, sized(30, tenant="l"))  # a long request in flight holds more than the reserve (20)
    submit(core, sized(25, tenant="s"))
    assert submit(core, sized(50, tenant="l"), 1.0).decision == QUEUE  # another long one waits
    assert (core.usage.used, core.usage.long) == (55, 30)
    assert core.evaluate(sized(26, tenant="s"), 2.0).decision == ALLOW  # 81 > 100 - 20, but the reserve is held
    core.usage = Usage(core.usage.used, core.usage.tenants, core.usage.models, long=0)  # as if nothing long ran
    assert core.evaluate(sized(26, tenant="s"), 2.0).decision == QUEUE


def test_queued_short_requests_cannot_take_the_reserve_in_a_plan():
    core = make_core(total=100, long_threshold_tokens=50, reserve_long_share=0.3)
    filler = sized(100)
    submit(core, filler)
    shorts = [sized(10) for _ in range(10)]
    for i, r in enumerate(shorts):
        submit(core, r, float(i))
    long = sized(60)
    submit(core, long, 20.0)
    finish(core, filler, 21.0)
    assert allowed(drain(core, 21.0)) == [r.id for r in shorts[:7]]  # 70: the top 30 stays for the long one
    for r in shorts[:6]:
        finish(core, r, 22.0)
    assert allowed(drain(core, 22.0)) == [r.id for r in shorts[7:]] + [long.id]  # in order, and it fits


def test_without_reserve_short_requests_take_everything():
    core = make_core(total=100, long_threshold_tokens=50, reserve_long_share=0.0)
    filler = sized(100)
    submit(core, filler)
    shorts = [sized(10) for _ in range(10)]
    for i, r in enumerate(shorts):
        submit(core, r, float(i))
    submit(core, sized(60), 20.0)
    finish(core, filler, 21.0)
    assert len(allowed(drain(core, 21.0))) == 10


def test_higher_class_first_until_aging_then_oldest_first():
    core = make_core(total=100, aging_s=10.0, degrade_classes=())
    submit(core, sized(65))
    filler = sized(30)
    submit(core, filler)
    batch = sized(20, cls="batch")
    assert submit(core, batch, 0.0).decision == QUEUE
    online = sized(20)
    assert submit(core, online, 5.0).decision == QUEUE
    finish(core, filler, 6.0)  # 35 free: room for one of them
    assert allowed(drain(core, 6.0)) == [online.id]  # online before a batch request not yet aged
    late = sized(20)
    assert submit(core, late, 11.0).decision == QUEUE
    finish(core, online, 12.0)
    assert allowed(drain(core, 12.0)) == [batch.id]  # aged: before the younger online request


def test_aged_request_outranks_an_arrival_that_would_fit():
    core = make_core(total=100, aging_s=10.0, degrade_classes=())
    submit(core, sized(70))
    old = sized(40, cls="batch")
    assert submit(core, old, 0.0).decision == QUEUE
    assert core.evaluate(sized(20), 5.0).decision == ALLOW  # online jumps a young batch request
    assert core.evaluate(sized(20), 15.0).decision == QUEUE  # not an aged one


def test_queue_timeout_and_deadline_are_rejected_by_the_plan():
    core = make_core(total=100, queue_timeout_s=30.0)
    submit(core, sized(100))
    stale, doomed, fresh = sized(10), sized(10, deadline=20.0), sized(10)
    submit(core, stale, 0.0)
    submit(core, doomed, 5.0)
    submit(core, fresh, 25.0)
    picks = drain(core, 31.0)
    assert [(r.id, d.decision, d.reason) for r, d in picks] == [
        (stale.id, REJECT, "queue_timeout"), (doomed.id, REJECT, "deadline_exceeded")]
    assert picks[0][1].retry_after > 0
    assert core.queued() == 1 and core.usage.used == 100


def test_quota_change_rejects_queued_requests_that_can_no_longer_fit():
    core = make_core(total=100, tenants={"a": TenantQuota()})
    submit(core, sized(100, tenant="b"))
    queued = sized(40, tenant="a")
    submit(core, queued)
    core.set_quotas(Quotas(total=100, tenants={"a": TenantQuota(cap=30)}))
    picks = core.plan_dequeue(1.0)
    assert [(r.id, d.decision, d.reason) for r, d in picks] == [(queued.id, REJECT, "tenant_cap")]


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(["arrive", "finish", "drain"]), st.integers(3, 70),
                          st.sampled_from(["a", "b", "c"]), st.sampled_from(["online", "batch"])),
                max_size=80))
def test_never_over_admits_and_accounting_stays_consistent(ops):
    core = make_core(total=100, tenants={"a": TenantQuota(floor=0.5), "b": TenantQuota(floor=0.3, cap=60)},
                     long_threshold_tokens=40)
    running, now = [], 0.0
    for op, cost, tenant, cls in ops:
        now += 1.0
        if op == "arrive":
            req = sized(cost, tenant=tenant, cls=cls)
            if submit(core, req, now).decision == ALLOW:
                running.append(req)
        elif op == "finish" and running:
            finish(core, running.pop(0), now)
        else:
            picks = drain(core, now)
            running += [r for r, d in picks if d.decision == ALLOW]
        assert core.usage.used == sum(core.cost(r) for r in running) <= 100
        assert core.usage.long == sum(core.cost(r) for r in running if core.cost(r) >= 40)
        assert core.usage.tenant("b") <= 60
        assert sum(core.queue_depths().values()) == core.queued()


# ---------------------------------------------------------------- TTFT SLOs


def test_a_request_queued_past_its_slo_share_is_degraded_not_admitted_late():
    from natsched.admitter.policy import DEGRADE

    core = make_core(total=100, slo_ttft_s={"online": 2.0}, degrade_classes=())  # may wait 1 s (share 0.5)
    big = sized(100, id="big")
    assert submit(core, big, 0.0).decision == ALLOW
    late, fresh, batch = sized(50, id="late"), sized(50, id="fresh"), sized(60, id="b", cls="batch")
    assert submit(core, late, 0.0).decision == QUEUE
    assert submit(core, batch, 0.0).decision == QUEUE
    assert submit(core, fresh, 1.4).decision == QUEUE
    finish(core, big, 1.5)
    picks = {r.id: (d.decision, d.reason) for r, d in drain(core, 1.5)}
    assert picks["late"] == (DEGRADE, "slo")  # waited 1.5 s > 1 s: it goes to the offline path
    assert picks["fresh"] == (ALLOW, None)  # the capacity goes to the one that can still make it
    assert "b" not in picks and core.queued() == 1  # batch has no SLO: it waits its turn
    assert core.used == 50  # the degraded one holds nothing here


def test_an_arrival_whose_estimated_wait_is_beyond_its_slo_share_is_degraded_at_once():
    from natsched.admitter.policy import DEGRADE

    core = make_core(total=100, early_reject=True, slo_ttft_s={"online": 2.0})
    hog = sized(100, id="hog")
    assert submit(core, hog, 0.0).decision == ALLOW
    for i in range(6):  # a measured release rate: 10 tokens per second
        core.releases.add(float(i), 10)
    d = submit(core, sized(60, id="x"), 5.0)  # 60 tokens short at 10/s: ~6 s, beyond 1 s
    assert (d.decision, d.reason) == (DEGRADE, "slo")
    assert make_core(total=100, early_reject=True).evaluate(sized(60, id="y"), 5.0).decision in (ALLOW, QUEUE)


def test_bad_slo_settings_are_refused():
    import pytest

    from natsched.admitter.errors import SettingsError

    with pytest.raises(SettingsError, match="slo_ttft_s"):
        AdmissionSettings(slo_ttft_s={"online": 0})
    with pytest.raises(SettingsError, match="slo_wait_share"):
        AdmissionSettings(slo_wait_share=1.5)
