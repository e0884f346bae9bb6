"""Standing queues (natsched/admitter/standing.py): a lane whose queue stands while its model serves
sheds what waited past the target and the arrivals that would; a queue that drains is never
shed; SLO, batch and degradable work keep their own rules."""

from natsched.admitter.policy import ALLOW, DEGRADE, QUEUE, REJECT
from natsched.admitter.standing import StandingQueues
from tests.admitter.test_dequeue import drain, finish, make_core, sized, submit


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
