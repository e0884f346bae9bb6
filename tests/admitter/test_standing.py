"""Standing queues (natsched/admitter/standing.py): a lane whose queue stands while its model serves
sheds what waited past the target and the arrivals that would; a queue that drains is never
shed; SLO, batch and degradable work keep their own rules."""

from natsched.admitter.policy import ALLOW, DEGRADE, QUEUE, REJECT
from natsched.admitter.standing import StandingQueues
from tests.admitter.test_dequeue import allowed, drain, finish, make_core, sized, submit


def test_a_lane_stands_only_after_a_whole_interval_past_the_target_and_stops_after_a_calm_one():
    sq = StandingQueues(target_s=1.0, interval_s=5.0)
    lane = ("m", "online")
    sq.observe({lane: 3.0}, now=3.0)  # past the target since t=1
    assert not sq.standing(lane, 5.9)
    sq.observe({lane: 7.0}, now=7.0)  # ... for 6 s now
    assert sq.standing(lane, 7.0)
    sq.observe({}, now=8.0)  # drained: it still sheds until an interval passes with no shed
    sq.shed(lane, 8.5)
    assert sq.standing(lane, 13.4) and sq.lanes(13.4) == [lane]
    sq.observe({lane: 0.5}, now=13.6)
    assert not sq.standing(lane, 13.6) and lane not in sq.shedding and sq.lanes(13.6) == []


def test_a_burst_that_drains_within_the_interval_is_never_shed():
    sq = StandingQueues(target_s=1.0, interval_s=5.0)
    lane = ("m", "online")
    for t in range(0, 40):  # the oldest is 4 s old at worst, then the queue drains: again and again
        sq.observe({lane: 1.0 + (t % 5)} if t % 5 else {}, now=float(t))
        assert not sq.standing(lane, float(t))


def serving_core(**settings):
    """A core whose model "m" serves (ten completions measure its release rate) and whose budget
    a filler then holds: arrivals queue."""
    core = make_core(total=100, **settings)
    warm = [sized(10, model="m") for _ in range(10)]
    for i, r in enumerate(warm):
        assert submit(core, r, i * 0.1).decision == ALLOW
    for i, r in enumerate(warm):
        finish(core, r, 1.0 + i * 0.1)
    filler = sized(100, model="m")
    assert submit(core, filler, 2.0).decision == ALLOW
    return core, filler


def test_a_standing_queue_sheds_what_waited_past_the_target_and_refuses_arrivals_at_once():
    core, _ = serving_core()
    old = [sized(10, model="m") for _ in range(3)]
    for r in old:
        assert submit(core, r, 2.0).decision == QUEUE
    # the budget stays full: the queue's oldest ages past the target; the model's rate is
    # measured from t=6 (half the 10 s window after its first release), so the lane stands from
    # t=8 (past the target since t=3, for the 5 s interval)
    for t in (3.0, 5.0, 7.0, 7.9):
        assert drain(core, t) == []
    picks = drain(core, 8.0)
    assert [(r.id, d.decision, d.reason) for r, d in picks] == [(r.id, REJECT, "overloaded") for r in old]
    assert all(d.retry_after == core.settings.retry_after_s for _, d in picks)
    assert submit(core, sized(10, model="m"), 8.6).decision == QUEUE  # starts within the target: waits
    late = submit(core, sized(40, model="m"), 8.6)  # would wait past the target: told at once
    assert (late.decision, late.reason) == (REJECT, "overloaded") and late.retry_after
    assert "overloaded" in late.message and "'m'" in late.message


def test_without_the_rule_the_same_queue_waits_until_its_timeout():
    core, _ = serving_core(standing_shed=False)
    old = [sized(10, model="m") for _ in range(3)]
    for r in old:
        submit(core, r, 2.0)
    for t in (3.0, 5.0, 7.0, 8.0, 8.5):
        assert drain(core, t) == []
    assert submit(core, sized(40, model="m"), 8.6).decision == QUEUE


def test_another_model_and_batch_work_are_not_shed_with_a_standing_lane():
    core, _ = serving_core()
    batch = sized(10, model="m", cls="batch")
    other = sized(10, model="other")
    first = sized(10, model="m")
    assert submit(core, first, 2.0).decision == QUEUE
    assert submit(core, batch, 2.0).decision in (QUEUE, DEGRADE)
    picks = {r.id: d.reason for t in (3.0, 5.0, 7.0, 8.0, 8.5) for r, d in drain(core, t)}
    assert picks == {first.id: "overloaded"}  # batch waits on (its class is meant to)
    assert submit(core, other, 8.6).decision == QUEUE  # "other" has no measured rate, no standing lane
    assert submit(core, sized(40, model="m"), 8.6).reason == "overloaded"
    assert submit(core, sized(40, model="m", degradable=True), 8.6).reason != "overloaded"


def test_a_class_with_a_ttft_slo_keeps_its_own_rule():
    core, _ = serving_core(slo_ttft_s={"online": 4.0})
    r = sized(10, model="m")
    submit(core, r, 2.0)
    picks = [p for t in (3.0, 5.0, 7.0, 8.5) for p in drain(core, t)]
    assert [(p.id, d.decision, d.reason) for p, d in picks] == [(r.id, DEGRADE, "slo")]  # at 2 s, not shed


# ------------------------------------------------------------------ adaptive LIFO


def test_a_lane_is_forming_as_soon_as_its_oldest_is_past_the_target_and_not_after_it_drains():
    sq = StandingQueues(target_s=1.0, interval_s=5.0)
    lane = ("m", "online")
    sq.observe({lane: 0.9}, now=1.0)
    assert sq.forming(1.0) == []
    sq.observe({lane: 1.5}, now=2.0)
    assert sq.forming(2.0) == [lane] and not sq.standing(lane, 2.0)  # forming long before it stands
    sq.observe({}, now=3.0)
    assert sq.forming(3.0) == []


def forming_core(**settings):
    """:func:`serving_core` with three requests of 60 queued behind the filler at 6.0 / 6.3 / 6.6
    (the model's rate is measured from t=6) and a plan at 7.5, when the oldest has waited 1.5 s."""
    core, filler = serving_core(**settings)
    queued = [sized(60, model="m") for _ in range(3)]
    for r, t in zip(queued, (6.0, 6.3, 6.6)):
        assert submit(core, r, t).decision == QUEUE
    assert drain(core, 7.5) == []
    finish(core, filler, 7.6)  # room for one of them
    return core, queued


def test_a_forming_queue_is_served_newest_first_and_first_come_without_the_rule():
    core, (a, b, c) = forming_core()
    assert allowed(drain(core, 7.6)) == [c.id]
    core, (a, b, c) = forming_core(adaptive_lifo=False)
    assert allowed(drain(core, 7.6)) == [a.id]


def test_an_arrival_at_a_forming_queue_goes_before_the_older_requests():
    core, _ = forming_core()
    assert submit(core, sized(60, model="m"), 7.6).decision == ALLOW
    core, _ = forming_core(adaptive_lifo=False)
    assert submit(core, sized(60, model="m"), 7.6).decision == QUEUE


def test_a_class_with_a_ttft_slo_stays_first_come():
    """An SLO class degrades what waited past its share instead (measured: newest first there cost
    burst's online goodput, docs/scenarios.md)."""
    core, (a, b, c) = forming_core(slo_ttft_s={"online": 100.0})
    assert allowed(drain(core, 7.6)) == [a.id]


def test_a_contended_models_forming_queue_goes_newest_first_across_tenants():
    core = make_core(total=10_000)
    core.set_model_totals({"big": 10_000, "small": 150})
    warm = [sized(10, model="small") for _ in range(10)]
    for i, r in enumerate(warm):
        assert submit(core, r, i * 0.1).decision == ALLOW
    for i, r in enumerate(warm):
        finish(core, r, 1.0 + i * 0.1)  # "small" serves: its release rate is measured from t=6
    assert submit(core, sized(5_000, model="big", tenant="a"), 2.0).decision == ALLOW
    running = sized(100, model="small", tenant="b")
    assert submit(core, running, 2.0).decision == ALLOW
    older, newer = sized(100, model="small", tenant="a"), sized(100, model="small", tenant="b")
    assert [submit(core, older, 6.0).decision, submit(core, newer, 6.5).decision] == [QUEUE, QUEUE]
    assert drain(core, 7.2) == []  # the oldest has waited 1.2 s: the lane is forming
    finish(core, running, 7.3)
    assert allowed(drain(core, 7.3)) == [newer.id]


def test_adaptive_lifo_is_a_live_knob():
    from natsched.admitter import knobs as K
    assert "admission.adaptive_lifo" in K.names()
    off = K.apply(K.Knobs(), dict([K.parse_assignment("admission.adaptive_lifo=false")]))
    assert off.admission.adaptive_lifo is False
    core, (a, _, _) = forming_core()
    core.set_settings(off.admission)  # what an admitter does when the quotas bucket changes it
    assert allowed(drain(core, 7.6)) == [a.id]
