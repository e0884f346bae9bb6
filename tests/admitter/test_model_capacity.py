"""Per-model capacity: each model's admitted runtime tokens are bounded by what the workers serving
that model can hold (natsched/admitter/dynamic.py ModelTotals, natsched/admitter/planner.py 7.),
and a full model's queue never blocks another model's requests."""

import pytest

from natsched.admitter.dynamic import DynamicTotalSettings, ModelTotals, ModelLoad
from natsched.admitter.policy import ALLOW, QUEUE
from tests.admitter.test_dequeue import allowed, drain, finish, make_core, sized, submit


def of(model: str, cost: int, **fields):
    return sized(cost, model=model, **fields)


def pools(big: int = 4, small: int = 1, per_worker: int = 100) -> list[ModelLoad]:
    """``big`` workers of model "big" and ``small`` of model "small", idle."""
    return ([ModelLoad(frozenset({"big"}), per_worker, 0) for _ in range(big)]
            + [ModelLoad(frozenset({"small"}), per_worker, 0) for _ in range(small)])


def test_totals_follow_each_models_own_workers():
    totals = ModelTotals(DynamicTotalSettings())
    assert totals.current(pools(), ceiling=10_000) == {"big": 400, "small": 100}  # factor 1 at first
    assert totals.current(pools(), ceiling=250) == {"big": 250, "small": 100}  # never above the cluster total
    # a model's reservations over what its workers hold measure its factor, not the other model's
    loads = [ModelLoad(frozenset({"big"}), 100, 50) for _ in range(4)] + [ModelLoad(frozenset({"small"}), 100, 50)]
    for _ in range(40):
        out = totals.next_totals(loads, {"big": 400, "small": 50}, ceiling=10_000)
    # big books 2 per held token, small 1; each aimed at the high watermark (0.8) of its own workers
    assert out["small"] == 80 and out["big"] == pytest.approx(640, abs=2)


def test_a_worker_without_capacity_gives_its_model_no_bound_and_a_gone_model_is_absent():
    totals = ModelTotals(DynamicTotalSettings())
    loads = [ModelLoad(frozenset({"a"}), 0, 0), ModelLoad(frozenset({"b", "b-lora"}), 100, 0)]
    out = totals.next_totals(loads, {}, ceiling=1_000)  # (idle: b's factor loosens a step, to 1.1)
    assert out == {"a": None, "b": 110, "b-lora": 110}  # an adapter shares its server's KV
    assert totals.next_totals(loads[1:], {}, ceiling=1_000).keys() == {"b", "b-lora"}  # a's worker left
    disabled = ModelTotals(DynamicTotalSettings(enabled=False))
    assert disabled.next_totals(loads, {}, ceiling=1_000) == {"a": None, "b": None, "b-lora": None}


def test_the_small_pools_model_queues_while_the_big_pools_is_admitted():
    core = make_core(total=500)  # the cluster total has room for both
    core.set_model_totals({"big": 400, "small": 100})
    assert submit(core, of("small", 60)).decision == ALLOW
    held_back = of("small", 60)
    assert submit(core, held_back).decision == QUEUE  # 120 > small's 100, though 120 < 500
    big = [of("big", 60) for _ in range(5)]
    assert [submit(core, r).decision for r in big] == [ALLOW] * 5  # not behind the queued small one
    assert core.usage.model("big") == 300 and core.usage.model("small") == 60


def test_queued_requests_of_a_full_model_do_not_block_other_models():
    """Head-of-line blocking across models: more queued requests of the full model than the
    planner's scan window, then one of another model behind them in the same tenant and class."""
    core = make_core(total=10_000, scan_limit=4)
    core.set_model_totals({"big": 10_000, "small": 100})
    assert submit(core, of("small", 100)).decision == ALLOW
    stuck = [of("small", 50) for _ in range(10)]
    assert {submit(core, r).decision for r in stuck} == {QUEUE}
    filler = of("big", 9_900)
    assert submit(core, filler).decision == ALLOW  # the cluster is full: what comes next queues
    behind = of("big", 50)
    assert submit(core, behind).decision == QUEUE
    finish(core, filler, 1.0)
    assert allowed(drain(core, 1.0)) == [behind.id]  # past all ten small ones


def test_a_leaving_worker_shrinks_its_models_bound_and_a_model_with_none_waits():
    totals = ModelTotals(DynamicTotalSettings())
    core = make_core(total=1_000)
    core.set_model_totals(totals.current(pools(big=2, small=2), ceiling=core.total))
    first, second = of("small", 100), of("small", 100)
    assert [submit(core, r).decision for r in (first, second)] == [ALLOW, ALLOW]
    core.set_model_totals(totals.current(pools(big=2, small=1), ceiling=core.total))  # a small worker left
    third = of("small", 100)
    assert submit(core, third).decision == QUEUE  # 300 > the one worker's 100
    finish(core, first, 1.0)
    assert allowed(drain(core, 1.0)) == []  # still 100 held of 100
    finish(core, second, 2.0)
    assert allowed(drain(core, 2.0)) == [third.id]
    core.set_model_totals(totals.current(pools(big=2, small=0), ceiling=core.total))  # the last one left
    orphan = of("small", 10)
    assert submit(core, orphan).decision == QUEUE  # no worker of it: held at the door, not sent
    finish(core, third, 3.0)
    assert allowed(drain(core, 3.0)) == []
    core.set_model_totals(totals.current(pools(big=2, small=1), ceiling=core.total))  # a worker is back
    assert allowed(drain(core, 4.0)) == [orphan.id]


def test_a_request_larger_than_its_models_bound_goes_when_the_model_holds_nothing():
    core = make_core(total=1_000)
    core.set_model_totals({"small": 100})
    large = of("small", 150)
    assert submit(core, large).decision == ALLOW  # the bound moves with measurement: never a starvation
    assert submit(core, of("small", 150)).decision == QUEUE


def test_the_configured_model_limit_still_caps_and_no_map_means_no_bound():
    core = make_core(total=1_000, quotas={"models": {"small": 50}})
    core.set_model_totals({"small": 500})
    assert submit(core, of("small", 40)).decision == ALLOW
    assert submit(core, of("small", 40)).decision == QUEUE  # 80 > the configured 50
    free = make_core(total=1_000)
    free.set_model_totals(None)  # no worker heard yet: the cluster total alone
    assert [submit(free, of("small", 400)).decision for _ in range(2)] == [ALLOW, ALLOW]


def test_a_contended_models_queue_goes_by_age_not_by_what_tenants_hold_elsewhere():
    """Tenant a holds most of the big model; its request for the small model was queued first.
    The tenant order (by cluster-wide holdings) would put b's later one first at every freed slot."""
    core = make_core(total=10_000)
    core.set_model_totals({"big": 10_000, "small": 150})
    assert submit(core, of("big", 5_000, tenant="a")).decision == ALLOW
    running = of("small", 100, tenant="b")
    assert submit(core, running).decision == ALLOW
    older = of("small", 100, tenant="a")
    assert submit(core, older, 1.0).decision == QUEUE
    newer = of("small", 100, tenant="b")
    assert submit(core, newer, 2.0).decision == QUEUE
    finish(core, running, 3.0)
    assert allowed(drain(core, 3.0)) == [older.id]
    late = of("small", 50, tenant="c")  # it would fit (150 of 150), but b's older request waits for the room
    assert submit(core, late, 3.5).decision == QUEUE


def test_with_one_model_the_tenant_order_stays():
    """The model's bound as large as the cluster total: the cluster binds, and the tenant order
    (by holdings: b, holding nothing, before a) decides as it did before per-model capacity."""
    core = make_core(total=250)
    core.set_model_totals({"only": 250})
    assert submit(core, heavy := of("only", 150, tenant="a")).decision == ALLOW
    assert submit(core, of("only", 50, tenant="a")).decision == ALLOW  # a still holds this after
    older = of("only", 150, tenant="a")
    newer = of("only", 100, tenant="b")
    assert [submit(core, older, 1.0).decision, submit(core, newer, 2.0).decision] == [QUEUE, QUEUE]
    finish(core, heavy, 3.0)
    assert allowed(drain(core, 3.0))[0] == newer.id
