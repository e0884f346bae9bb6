"""Saturated models (natsched/admitter/engines.py): a model whose every engine has requests waiting
takes no more at the door until one of them may start one; another model, and a model one of
whose engines has room, go on."""

from natsched.admitter.engines import EngineQueues
from natsched.admitter.policy import ALLOW, QUEUE
from tests.admitter.test_dequeue import allowed, drain, make_core, sized, submit


def test_a_model_is_saturated_only_while_every_engine_of_it_has_requests_waiting():
    eq = EngineQueues()
    eq.heartbeat("w1", frozenset({"m"}), waiting=2)
    assert eq.saturated() == {"m"}  # its only worker
    eq.heartbeat("w2", frozenset({"m"}), waiting=0)
    assert eq.saturated() == frozenset()  # w2 may take one
    eq.heartbeat("w2", frozenset({"m", "lora-a"}), waiting=1)
    assert eq.saturated() == {"m", "lora-a"}


def test_completions_since_the_heartbeat_free_a_backed_up_engine_one_waiting_request_each():
    eq = EngineQueues()
    eq.heartbeat("w1", frozenset({"m"}), waiting=2)
    eq.completed("w1")
    assert eq.backed_up("w1") and eq.saturated() == {"m"}  # one of its two waiting started
    eq.completed("w1")
    assert not eq.backed_up("w1") and eq.saturated() == frozenset()
    eq.completed(None)  # a completion naming no worker changes nothing
    eq.completed("w9")  # ... nor one of a worker never heard
    eq.heartbeat("w1", frozenset({"m"}), waiting=1)  # the next heartbeat starts the count anew
    assert eq.saturated() == {"m"}


def test_a_dead_worker_holds_no_model_and_bad_counts_are_no_queue():
    eq = EngineQueues()
    eq.heartbeat("w1", frozenset({"m"}), waiting=3)
    eq.heartbeat("w2", frozenset({"m"}), waiting=-5)  # hostile or broken: nothing waits
    assert eq.saturated() == frozenset()
    eq.gone("w2")
    assert eq.saturated() == {"m"}
    eq.gone("w1")
    eq.gone("w1")  # twice: no error
    assert eq.saturated() == frozenset()


def test_the_door_holds_a_saturated_model_and_lets_the_others_pass():
    core = make_core(total=1000)
    first = sized(10, model="m")
    assert submit(core, first, 0.0).decision == ALLOW
    core.set_saturated(frozenset({"m"}))
    held = sized(10, model="m")
    assert submit(core, held, 0.1).decision == QUEUE  # the budget has room; the engines have none
    other = sized(10, model="n")
    assert submit(core, other, 0.2).decision == ALLOW
    assert drain(core, 0.3) == []
    assert core.model_wait("m", 10, 0.3) == 0.0  # (no release rate measured yet: no estimate)
    core.set_saturated(frozenset())  # an engine of it may take one again
    assert allowed(drain(core, 0.4)) == [held.id]


def test_with_the_rule_off_a_saturated_model_is_admitted_as_before():
    core = make_core(total=1000, hold_saturated=False)
    assert submit(core, sized(10, model="m"), 0.0).decision == ALLOW
    core.set_saturated(frozenset({"m"}))
    assert submit(core, sized(10, model="m"), 0.1).decision == ALLOW
