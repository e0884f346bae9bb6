"""Credit (admitter/credit.py, the credit part of admitter/usage.py): pure tests, no server.

The service side (real nats-server) is in tests/admitter/test_credit_service.py.
"""

import pytest

from natsched.admitter.credit import Credit, CreditSettings
from natsched.admitter.errors import SettingsError, UsageError
from natsched.admitter.shared import Reservation, SharedState
from natsched.admitter.usage import Usage

KEY = ("t1", "m")


def make_credit(replica="a", **kw) -> Credit:
    kw.setdefault("horizon_s", 1.0)
    kw.setdefault("min_requests", 1.0)
    return Credit(replica, CreditSettings(**kw))


def busy(credit: Credit, now=100.0, key=KEY, tokens=100, times=20) -> None:
    """Demand for ``key``: ``times`` requests of ``tokens`` just before ``now``."""
    for _ in range(times):
        credit.note(key, tokens, now)


def always(usage, tenant, model, n):
    return True


def written(credit: Credit, usage: Usage, now=100.0, total=100_000, queue_busy=False, grantable=always):
    """Plan and apply like the keeper: the usage written (or the same one) and the plan."""
    plan = credit.plan(usage, now, total, queue_busy, grantable)
    if plan is None:
        return usage, None
    credit.applied(plan, now)
    return plan.usage, plan


# --- the shared side: Usage ------------------------------------------------------------
def test_a_block_counts_like_a_reservation_and_round_trips():
    u = Usage().grant("a", "e1", "t1", "m", 500)
    assert (u.used, u.tenants, u.models, u.long) == (500, {"t1": 500}, {"m": 500}, 0)
    assert u.credit("a", "e1").block("t1", "m") == 500 and u.credit("a", "other") is None
    assert Usage.from_json(u.to_json()) == u
    assert b"credits" not in Usage().plus("t1", "m", 5).to_json()  # no entry: the old format exactly


def test_release_from_a_live_block_shrinks_it_and_anything_else_only_the_aggregate():
    u = Usage().grant("a", "e1", "t1", "m", 500).plus("t1", "m", 40)
    inside = u.release_from("a", "e1", "t1", "m", 100)
    assert inside.used == 440 and inside.credit("a").block("t1", "m") == 400
    stale = u.release_from("a", "e0", "t1", "m", 100)  # paid from an older, dropped block
    assert stale.used == 440 and stale.credit("a").block("t1", "m") == 500
    alone = u.release_from("a", "", "t1", "m", 40)  # reserved on its own
    assert alone.used == 500 and alone.credit("a").block("t1", "m") == 500


def test_dropping_an_entry_keeps_the_aggregate_and_giving_back_lowers_it():
    u = Usage().grant("a", "e1", "t1", "m", 500)
    dropped = u.drop_credit("a")
    assert dropped.used == 500 and not dropped.credits
    assert dropped.drop_credit("a") is dropped  # nothing to drop: the same value (no write)
    back = u.give_back("a", "e1", "t1", "m", 900)  # never more than the block holds
    assert back.used == 0 and back.credit("a").blocks == {}
    with pytest.raises(UsageError, match="epoch"):
        u.grant("a", "e2", "t1", "m", 1)
    assert u.renew("a", "e1").credit("a").beat == 1


@pytest.mark.parametrize("credits, where", [
    ([], "credits"),
    ({"a": {"beat": 1}}, "credits.a"),
    ({"a": {"epoch": "e", "blocks": {"t": 1}}}, "credits.a.blocks"),
    ({"a": {"epoch": "e", "blocks": [["t", "m"]]}}, "credits.a.blocks"),
    ({"a": {"epoch": "e", "blocks": [["t", "m", -5]]}}, "credits.a.blocks"),
    ({"a": {"epoch": "e", "beat": "x"}}, "credits.a.beat"),
])
def test_a_corrupted_credit_entry_is_a_usage_error_naming_the_field(credits, where):
    import orjson

    with pytest.raises(UsageError, match=where.replace(".", r"\.")):
        Usage.from_json(orjson.dumps({"used": 0, "tenants": {}, "models": {}, "long": 0, "credits": credits}))


def test_drift_counts_blocks_and_the_records_outside_live_blocks():
    u = Usage().grant("a", "e1", "t1", "m", 500).plus("t1", "m", 40)
    records = {
        "r1": Reservation("r1", "t1", "m", 100, 0.0, "a", credit="e1"),  # inside a's block
        "r2": Reservation("r2", "t1", "m", 40, 0.0, "b"),  # on its own
        "r3": Reservation("r3", "t1", "m", 70, 0.0, "a", credit="e0"),  # paid from a dropped block
    }
    expected = SharedState.drift(records, lambda n: False, u)
    assert expected.used == 500 + 40 + 70 and expected.credits == u.credits


# --- the replica's side: Credit ----------------------------------------------------------
def test_no_demand_no_credit_and_no_write():
    c = make_credit()
    assert c.plan(Usage(), 100.0, 100_000, False, always) is None
    c.note(KEY, 100, 100.0)  # one request: below min_requests in a horizon
    c.settings.min_requests = 2.0
    assert c.plan(Usage(), 100.0, 100_000, False, always) is None


def test_demand_opens_a_block_sized_to_the_horizon_and_spending_needs_no_write():
    c = make_credit()
    busy(c)  # 2,000 tokens in the last moment: 2,000/s over tau = 1 s, horizon 1 s
    usage, plan = written(c, Usage())
    assert plan.deltas == {KEY: 2000} and c.free == {KEY: 2000}
    assert usage.used == 2000 and usage.credit("a", c.epoch).beat == 1
    assert c.usable(usage, 100.1) and not c.usable(usage, 100.0 + c.settings.lease_s)  # half the lease
    view = c.view(usage)
    assert view.used == 0 and view.tenant("t1") == 0  # its own unspent credit is room for itself
    c.spend(KEY, 300)
    assert c.view(usage).used == 300
    c.refund(KEY, 300)
    assert c.free == {KEY: 2000}


def test_blocks_respect_the_policy_the_slack_and_the_per_replica_share():
    c = make_credit()
    busy(c)
    assert c.plan(Usage(), 100.0, 100_000, False, lambda u, t, m, n: False) is None  # the policy says no
    assert c.plan(Usage(used=95_000), 100.0, 100_000, False, always) is None  # would eat the slack
    usage, plan = written(c, Usage(), total=20_000)  # max_share 5 %: at most 1,000
    assert plan.deltas == {KEY: 1000}


def test_queued_work_takes_every_unspent_token_back_and_the_entry_goes():
    c = make_credit()
    busy(c)
    usage, _ = written(c, Usage())
    old_epoch = c.epoch
    usage, plan = written(c, usage, now=100.01, queue_busy=True)
    assert plan.deltas == {KEY: -2000} and usage.used == 0 and "a" not in usage.credits
    assert c.free == {} and c.epoch != old_epoch  # a later block must not back this one's requests


def test_an_idle_block_is_given_back_and_a_busy_one_renewed_before_its_lease():
    c = make_credit(idle_s=1.0, lease_s=10.0)
    busy(c)
    usage, _ = written(c, Usage())
    usage, plan = written(c, usage, now=100.5)  # busy, full: nothing to do yet
    assert plan is None
    c.note(KEY, 1, 102.0)
    usage, plan = written(c, usage, now=103.0)  # in use, lease_s/4 since the last write: renew
    assert plan is not None and usage.credit("a").beat == 2
    usage, plan = written(c, usage, now=104.5)  # unused for 2.5 s > idle_s
    assert usage.used == 0 and not usage.credits


def test_a_silent_replica_loses_its_entry_after_the_lease_but_not_its_reservations():
    b = make_credit("b", lease_s=10.0)
    theirs = Usage().grant("a", "ea", "t1", "m", 800).renew("a", "ea")
    assert b.plan(theirs, 100.0, 100_000, False, always) is None  # first seen now
    assert b.plan(theirs, 109.0, 100_000, False, always) is None
    usage, plan = written(b, theirs, now=110.5)
    assert plan.dropped == ["a"] and "a" not in usage.credits and usage.used == 800
    moved = theirs.renew("a", "ea")  # a beat resets the clock
    b2 = make_credit("b", lease_s=10.0)
    b2.plan(theirs, 100.0, 100_000, False, always)
    assert b2.plan(moved, 109.0, 100_000, False, always) is None
    assert b2.plan(moved, 115.0, 100_000, False, always) is None


def test_an_entry_of_an_earlier_life_is_replaced_and_a_dropped_one_is_noticed():
    c = make_credit()
    busy(c)
    earlier = Usage().grant("a", "a.old", "t1", "m", 700)
    usage, plan = written(c, earlier)
    assert usage.credit("a").epoch == c.epoch != "a.old" and usage.used == 700 + 2000
    gone = usage.drop_credit("a")  # someone dropped it (we were past our lease)
    usage, plan = written(c, gone, now=100.01)
    assert plan.lost and usage.credit("a").epoch == c.epoch
    granted = plan.deltas[KEY]  # a new block, under a new epoch; the lost one stays counted, as drift
    assert c.free == {KEY: granted} and usage.used == 700 + 2000 + granted


def test_settings_out_of_range_are_refused():
    with pytest.raises(SettingsError):
        CreditSettings(horizon_s=0)
    with pytest.raises(SettingsError):
        CreditSettings(max_share=1.5)
    with pytest.raises(SettingsError):
        CreditSettings(min_requests=0)
