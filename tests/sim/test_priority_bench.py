"""``natsched bench priority``: the shipped core over a seeded online burst on a batch backlog."""

from dataclasses import replace

from natsched.sim.priority import PrioritySettings, priority_table, run_priority, run_priority_benchmark

QUICK = PrioritySettings(duration_s=80.0, burst_start_s=25.0, burst_s=20.0)


def test_lending_shortens_online_waits_in_a_burst_and_the_loan_is_bounded_and_repaid():
    lend, no_lend, no_limits = run_priority_benchmark(QUICK, (1.5,))
    assert (lend.contender, no_lend.contender, no_limits.contender) == ("lend", "no_lend", "no_limits")
    assert lend.online_offered == no_lend.online_offered > 0  # paired: the same arrivals
    assert lend.online_wait_p99 < no_lend.online_wait_p99
    assert 0 < lend.max_loan <= QUICK.lend_share * QUICK.batch_limit
    assert lend.repaid_after_s is not None  # given back after the burst
    assert no_lend.max_loan == no_limits.max_loan == 0
    assert lend.batch_tokens_burst < no_lend.batch_tokens_burst  # the backlog yielded its room ...
    assert lend.batch_tokens_after > 0  # ... and ran again afterwards


def test_the_same_arguments_give_the_same_numbers():
    a = run_priority("lend", replace(QUICK, seed=7))
    b = run_priority("lend", replace(QUICK, seed=7))
    assert (a.online_wait_p99, a.batch_tokens_burst, a.max_loan) == (b.online_wait_p99, b.batch_tokens_burst,
                                                                      b.max_loan)
    assert "lend" in priority_table([a])
