"""Class limits and loans, pure: the lending rule, the repayment rule, and the core deciding with
them — class limit reached, online before batch across tenants past the watermark, lend then
return — plus their storage (quotas bucket, shared usage, reservation records)."""

from __future__ import annotations

import pytest

from natsched.admitter import knobs as K
from natsched.admitter.classes import ClassBook, clamp, repay
from natsched.admitter.errors import QuotaError, SettingsError, UsageError
from natsched.admitter.offline import IdleGate, OfflineSettings
from natsched.admitter.policy import ALLOW, QUEUE, REJECT, AdmissionSettings, AdmitterCore
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.admitter.shared import Reservation, SharedState
from natsched.admitter.usage import Usage
from tests.factories.core import make_completion, make_request

ON, BA, OFF = "online", "batch", "offline"


def sized(cost: int, tenant: str = "t1", cls: str = ON, **fields):
    out = 2 if cost % 2 == 0 else 1
    return make_request(prompt_token_ids=[0] * ((cost - out) // 2), max_tokens=out, tenant=tenant, cls=cls, **fields)


def make_core(total=1000, limits=None, tenants=None, **settings) -> AdmitterCore:
    settings.setdefault("early_reject", False)
    settings.setdefault("queue_timeout_s", 1000.0)
    settings.setdefault("aging_s", 1000.0)
    settings.setdefault("degrade_classes", ())  # batch queues here: the tests are about the order
    return AdmitterCore(AdmissionSettings(**settings),
                        Quotas(total=total, class_limits=dict(limits or {}), tenants=tenants or {}))


def submit(core, request, now=0.0):
    decision = core.evaluate(request, now)
    core.apply(request, decision, now)
    return decision


def finish(core, request, now=0.0):
    return core.release(make_completion(request.id, tenant=request.tenant, runtime_tokens=core.cost(request),
                                        cls=request.cls, model=request.model), now)


def drain(core, now=0.0):
    picks = core.plan_dequeue(now)
    core.commit_dequeue(picks, now)
    return picks


def allowed(picks):
    return [r.id for r, d in picks if d.decision == ALLOW]


# ---------------------------------------------------------------------- the lending rule, as a table

LIMITS = {ON: 400, BA: 600}


@pytest.mark.parametrize("case, used, loans, demand, surge, cls, cost, want", [
    ("fits its own limit", {ON: 300}, {}, {}, False, ON, 100, {}),
    ("no limit: never borrows", {BA: 600}, {}, {}, False, OFF, 10_000, {}),
    ("borrows batch's idle room", {ON: 400}, {}, {}, False, ON, 100, {BA: 100}),
    ("partly own, partly borrowed", {ON: 350}, {}, {}, False, ON, 100, {BA: 50}),
    ("batch busy: nothing idle to lend", {ON: 400, BA: 600}, {}, {}, False, ON, 100, None),
    ("batch's queue claims its free room", {ON: 400, BA: 400}, {}, {BA: 200}, False, ON, 100, None),
    ("idle room beyond batch's demand", {ON: 400, BA: 300}, {}, {BA: 200}, False, ON, 100, {BA: 100}),
    ("surge: lends despite its demand", {ON: 400, BA: 400}, {}, {BA: 200}, True, ON, 100, {BA: 100}),
    ("surge: at most lend_share on loan", {ON: 700, BA: 100}, {(ON, BA): 300}, {BA: 500}, True, ON, 1, None),
    ("never beyond the free room", {ON: 400, BA: 550}, {}, {}, True, ON, 100, None),
    ("batch does not borrow", {BA: 600}, {}, {}, True, BA, 100, None),
])
def test_what_a_class_may_borrow(case, used, loans, demand, surge, cls, cost, want):
    book = ClassBook(LIMITS, dict(used), dict(loans), demand, (ON,), 0.5, {ON: 0, BA: 1}, surge)
    assert book.fit(cls, cost) == want, case


def test_borrows_from_the_lowest_class_first_and_repays_the_highest_first():
    limits = {ON: 100, BA: 100, OFF: 100}
    book = ClassBook(limits, {ON: 100}, {}, {}, (ON,), 0.5, {ON: 0, BA: 1})
    assert book.fit(ON, 150) == {OFF: 100, BA: 50}
    classes, loans = repay({ON: 250}, {(ON, OFF): 100, (ON, BA): 50}, ON, 60)
    assert classes == {ON: 190} and loans == {(ON, OFF): 90}  # batch made whole first


@pytest.mark.parametrize("classes, loans, cls, tokens, want_classes, want_loans", [
    ({ON: 500}, {(ON, BA): 100}, ON, 30, {ON: 470}, {(ON, BA): 70}),  # a release repays first
    ({ON: 500}, {(ON, BA): 100}, ON, 500, {}, {}),
    ({ON: 500, BA: 200}, {(ON, BA): 100}, BA, 50, {ON: 500, BA: 150}, {(ON, BA): 100}),  # the lender's own
    ({ON: 500}, {(ON, BA): 100}, None, 500, {ON: 500}, {(ON, BA): 100}),  # no class: nothing moves
])
def test_repay(classes, loans, cls, tokens, want_classes, want_loans):
    assert repay(classes, loans, cls, tokens) == (want_classes, want_loans)


def test_loans_never_exceed_what_the_borrower_holds():
    assert clamp({ON: 50}, {(ON, BA): 40, (ON, OFF): 40}) == {(ON, BA): 40, (ON, OFF): 10}


# ---------------------------------------------------------------------- the core

def test_a_class_at_its_limit_waits_while_other_classes_pass_and_runs_when_it_frees():
    core = make_core(limits={BA: 300}, lend_to=())
    first = [sized(100, cls=BA) for _ in range(3)]
    assert [submit(core, r).decision for r in first] == [ALLOW] * 3
    late = sized(100, cls=BA)
    d = submit(core, late)
    assert d.decision == QUEUE and (d.budget["class_limit"], d.budget["class_used"]) == (300, 300)
    assert submit(core, sized(100)).decision == ALLOW  # online is not held by batch's limit
    assert allowed(drain(core)) == []  # the total has room: the class limit holds it
    finish(core, first[0])
    assert allowed(drain(core)) == [late.id]
    assert core.usage.classes == {ON: 100, BA: 300}


def test_a_request_larger_than_its_class_can_ever_hold_is_rejected():
    core = make_core(limits={BA: 300, ON: 200})
    d = core.evaluate(sized(400, cls=BA), 0.0)
    assert (d.decision, d.reason) == (REJECT, "class_limit") and "limited to 300" in d.message
    assert core.evaluate(sized(400), 0.0).decision == ALLOW  # online may borrow batch's 300
    assert core.evaluate(sized(600), 0.0).reason == "class_limit"  # 200 + 300 cannot hold it


def queue_both(core, holding):
    """``holding`` admitted, then b's batch and a's online queued, then room for one of them."""
    for r in holding:
        assert submit(core, r).decision == ALLOW
    batch, online = sized(100, tenant="b", cls=BA), sized(100, tenant="a")
    assert submit(core, batch, 1.0).decision == QUEUE
    assert submit(core, online, 2.0).decision == QUEUE
    finish(core, holding[-1], 3.0)
    return allowed(drain(core, 3.0)), batch.id, online.id


def test_past_the_watermark_online_of_any_tenant_goes_before_batch():
    """b holds less than a, so tenant-first order (within the elastic tier) would pick b's batch;
    past the watermark a's online goes first."""
    core = make_core(total=1000, degrade_watermark=0.8)
    got, batch, online = queue_both(core, [sized(550, tenant="a"), sized(350, tenant="b"), sized(100, tenant="c")])
    assert got == [online]
    assert core.pressure()  # 900 used + 100 queued >= 800


def test_a_floor_still_comes_before_class():
    """b below its guaranteed floor: its batch goes before a's online (a floor is a guarantee)."""
    core = make_core(total=1000, degrade_watermark=0.8,
                     tenants={"a": TenantQuota(), "b": TenantQuota(floor=0.5)})
    got, batch, online = queue_both(core, [sized(800, tenant="a"), sized(100, tenant="b"), sized(100, tenant="c")])
    assert got == [batch]


def test_past_the_watermark_an_online_arrival_jumps_another_tenants_queued_batch():
    core = make_core(total=1000, degrade_watermark=0.8)
    submit(core, sized(850, tenant="a"))
    assert submit(core, sized(200, tenant="b", cls=BA), 1.0).decision == QUEUE
    assert core.evaluate(sized(100, tenant="a"), 2.0).decision == ALLOW  # a holds more, but online
    other = sized(100, tenant="c", cls=BA)
    assert core.evaluate(other, 2.0).decision == QUEUE  # batch of a third tenant waits its turn


@pytest.mark.parametrize("case, limits, aging_s, first", [
    ("young batch: online's class first", {}, 1000.0, ON),
    ("aged batch: promoted, the lighter tenant first", {}, 10.0, BA),
    ("aged batch under a class limit: its limit guarantees it, online first", {BA: 600}, 10.0, ON),
])
def test_aging_and_class_limits_under_pressure(case, limits, aging_s, first):
    """b (holding nothing) queued batch at 0 s, a (holding 900) online at 15 s, room for one."""
    core = make_core(total=1000, limits=limits, degrade_watermark=0.8, aging_s=aging_s)
    holding = [sized(900, tenant="a"), sized(100, tenant="c")]
    for r in holding:
        submit(core, r)
    batch = sized(100, tenant="b", cls=BA)
    submit(core, batch, 0.0)
    online = sized(100, tenant="a")
    submit(core, online, 15.0)
    finish(core, holding[1], 16.0)
    assert allowed(drain(core, 16.0)) == [batch.id if first == BA else online.id], case


def test_online_borrows_batch_room_in_a_surge_and_gives_it_back():
    """The seed's loan, step by step: a batch backlog at its limit; an online burst fills online's
    own limit, then, past the watermark, takes freed batch room up to half batch's limit; once the
    burst is over no new loan is made, the loan is repaid by the first online releases, and the
    batch backlog gets its whole limit back."""
    core = make_core(total=1000, limits={ON: 400, BA: 600}, lend_share=0.5, degrade_watermark=0.8)
    batch = [sized(100, tenant="b", cls=BA) for _ in range(10)]
    assert [submit(core, r, 0.0).decision for r in batch] == [ALLOW] * 6 + [QUEUE] * 4
    burst = [sized(100, tenant="a") for _ in range(8)]
    assert [submit(core, r, 1.0).decision for r in burst] == [ALLOW] * 4 + [QUEUE] * 4
    assert core.usage.classes == {ON: 400, BA: 600} and not core.usage.loans
    for r in batch[:4]:  # 400 of batch's room frees: online's queue goes first, on loan
        finish(core, r, 2.0)
    picks = drain(core, 2.0)
    assert allowed(picks) == [burst[4].id, burst[5].id, burst[6].id, batch[6].id]
    assert [d.loan for _, d in picks] == [{BA: 100}] * 3 + [{}]
    assert core.usage.loans == {(ON, BA): 300}  # lend_share 0.5 of 600: the bound
    assert picks[0][1].budget["loan"] == {BA: 100} and picks[0][1].budget["class_limit"] == 400
    assert core.usage.classes == {ON: 700, BA: 300}
    for r in burst[:4]:  # the burst ends: online releases repay the loan first
        finish(core, r, 3.0)
    assert core.usage.loans == {} and core.usage.classes == {ON: 300, BA: 300}
    picks = drain(core, 3.0)  # the last online one fits its own limit: no new loan
    assert burst[7].id in allowed(picks) and all(not d.loan for _, d in picks)
    assert set(allowed(picks)) == {burst[7].id, batch[7].id, batch[8].id, batch[9].id}
    assert core.usage.classes == {ON: 400, BA: 600} and core.queued() == 0


def test_lend_share_zero_lends_only_idle_room():
    core = make_core(total=1000, limits={ON: 400, BA: 600}, lend_share=0.0, degrade_watermark=0.8)
    assert submit(core, sized(400)).decision == ALLOW
    assert submit(core, sized(200)).decision == ALLOW  # batch idle: its room is lent
    assert core.usage.loans == {(ON, BA): 200}
    for _ in range(4):
        assert submit(core, sized(100, tenant="b", cls=BA)).decision == ALLOW  # 400 = 600 - lent 200
    queued = sized(100, tenant="b", cls=BA)
    assert submit(core, queued).decision == QUEUE
    assert submit(core, sized(50)).decision == QUEUE  # batch waits for its room: no more lending


def test_class_limits_switch_credit_off():
    core = make_core(limits={BA: 600})
    assert not core.grantable(Usage(), "t1", "default", 10, 0.0)
    assert make_core().grantable(Usage(), "t1", "default", 10, 0.0)


# ---------------------------------------------------------------------- storage and settings

def test_class_limits_live_in_the_quotas_bucket():
    q = Quotas(total=1000, class_limits={ON: 400, BA: 600})
    kv = q.to_kv()
    assert kv["class.online.limit"] == b"400" and kv["class.batch.limit"] == b"600"
    back, errors = Quotas.from_kv(kv)
    assert errors == [] and back.class_limits == {ON: 400, BA: 600}
    bad, errors = Quotas.from_kv({**kv, "class.online.limit": b"-3", "class.nope.limit": b"5"}, previous=back)
    assert bad.class_limits == {ON: 400, BA: 600}
    assert any("class.online.limit" in e and "previous value kept" in e for e in errors)
    assert any("unknown class 'nope'" in e for e in errors)
    with pytest.raises(QuotaError, match="unknown class"):
        Quotas(class_limits={"vip": 5}).validate()


def test_the_usage_carries_classes_and_loans_and_refuses_forged_ones():
    u = Usage().plus("a", "m", 500, cls=ON, loan={BA: 100}).plus("b", "m", 300, cls=BA)
    assert Usage.from_json(u.to_json()) == u
    assert b'"loans":[["online","batch",100]]' in u.to_json()
    assert b"classes" not in Usage().to_json()  # an old reader still reads an idle usage
    for bad in (b'"classes":{"vip":3}', b'"loans":[["online","online",3]]', b'"loans":[["online","batch",-1]]',
                b'"loans":{"online":3}'):
        raw = b'{"used":0,"tenants":{},"models":{},"long":0,' + bad + b"}"
        with pytest.raises(UsageError):
            Usage.from_json(raw)


def test_reservation_records_carry_their_class_and_a_rebuild_keeps_the_loans():
    res = Reservation("r1", "a", "m", 500, 1.0, "adm", cls=ON)
    back = Reservation.from_json("r1", res.to_json(), 3)
    assert back.cls == ON
    with pytest.raises(UsageError):
        Reservation.from_json("r1", res.to_json().replace(b'"online"', b'"vip"'), 3)
    live = Usage().plus("a", "m", 500, cls=ON, loan={BA: 100})
    records = {"r1": back, "r2": Reservation("r2", "b", "m", 50, 1.0, "adm", cls=ON)}
    expected = SharedState.drift(records, lambda n: False, live)
    assert expected.classes == {ON: 550} and expected.loans == {(ON, BA): 100}
    gone = SharedState.drift({"r2": records["r2"]}, lambda n: False, live)  # r1 finished unseen
    assert gone.loans == {(ON, BA): 50}  # clamped to what online still holds


def test_lending_settings_are_knobs_checked_by_their_dataclass():
    knobs = K.apply(K.Knobs(), {"admission.lend_share": 0.25, "admission.lend_to": ["online", "batch"]})
    assert (knobs.admission.lend_share, knobs.admission.lend_to) == (0.25, ("online", "batch"))
    with pytest.raises(SettingsError, match="lend_share"):
        K.apply(K.Knobs(), {"admission.lend_share": 1.5})
    with pytest.raises(SettingsError, match="lend_to names unknown classes"):
        K.apply(K.Knobs(), {"admission.lend_to": ["vip"]})


def test_the_offline_path_counts_in_class_offline_under_its_limit():
    gate = IdleGate(OfflineSettings(low_watermark=1.0))
    held = [make_request(prompt_token_ids=list(range(100)), max_tokens=20, cls=BA) for _ in range(4)]  # 220 each
    v = gate.plan(Usage(), Quotas(total=10_000, class_limits={OFF: 500}), 10_000, held)
    assert len(v.takes) == 2 and v.usage.classes == {OFF: 440}
    lent = Usage().plus("a", "m", 300, cls=ON, loan={OFF: 300})  # online borrowed offline's room
    v = gate.plan(lent, Quotas(total=10_000, class_limits={OFF: 500}), 10_000, held)
    assert len(v.takes) == 0
    v = gate.plan(Usage(), Quotas(total=10_000, class_limits={OFF: 100}), 10_000, held)
    assert [r[1] for r in v.refusals] == ["class_limit"] * 4

