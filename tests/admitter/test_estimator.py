"""Learned estimates: calibrated output lengths (EWMA + true-up), the release rate, est_wait."""

import pytest

from natsched.admitter.estimator import OutputEstimator, ReleaseRate
from natsched.admitter.policy import ALLOW, QUEUE, AdmissionSettings, AdmitterCore
from natsched.admitter.quotas import Quotas, TenantQuota
from tests.factories.core import make_completion, make_request


def make_core(total: int = 10_000, tenants: dict | None = None, **settings) -> AdmitterCore:
    return AdmitterCore(AdmissionSettings(**settings), Quotas(total=total, tenants=tenants or {}))


def prompt(n: int = 100, **kw):
    return make_request(prompt_token_ids=[1] * n, **kw)


def test_ewma_needs_min_samples_then_follows_completions():
    est = OutputEstimator(alpha=0.5, min_samples=2)
    assert est.observe("a", "m", 100) == 100.0
    assert est.estimate("a", "m") is None  # one sample is not enough
    assert est.observe("a", "m", 200) == 150.0
    assert est.estimate("a", "m") == 150.0
    assert est.estimate("a", "other") is None and est.estimate("b", "m") is None  # per (tenant, model)
    assert est.expected_output("a", "m", max_tokens=1000, margin=0.1) == 165
    assert est.expected_output("a", "m", max_tokens=120, margin=0.1) == 120  # never above max_tokens


def test_uncalibrated_cost_reserves_max_tokens():
    core = make_core(ewma_min_samples=1)
    core.release(make_completion("x", runtime_tokens=0, output_tokens=5), 1.0)
    assert core.cost(prompt(100, max_tokens=500)) == 700


def test_calibrated_cost_uses_the_ewma_and_completions_true_it_up():
    core = make_core(calibrated_output=True, ewma_alpha=0.5, ewma_min_samples=2, calibrated_margin=0.0)
    first = prompt(100, max_tokens=500)
    assert core.cost(first) == 700  # nothing learned yet
    assert core.evaluate(first, 0).decision == ALLOW
    core.apply(first, core.evaluate(first, 0), 0)
    freed = core.release(make_completion(first.id, runtime_tokens=700, output_tokens=40), 1.0)
    assert freed == 700 and core.usage.used == 0  # the reservation is released as made
    core.release(make_completion("other", runtime_tokens=0, output_tokens=60), 2.0)
    assert core.cost(prompt(100, max_tokens=500)) == 200 + 50  # EWMA of 40 and 60
    core.release(make_completion("third", runtime_tokens=0, output_tokens=250), 3.0)
    assert core.cost(prompt(100, max_tokens=500)) == 200 + 150  # moved toward the longer answers
    assert core.cost(prompt(100, max_tokens=500, tenant="t2")) == 700  # another tenant learns on its own


def test_failed_completions_do_not_teach_output_lengths():
    core = make_core(calibrated_output=True, ewma_min_samples=1, calibrated_margin=0.0)
    core.release(make_completion("x", runtime_tokens=0, output_tokens=3, status="error"), 1.0)
    assert core.cost(prompt(10, max_tokens=100)) == 120


def test_a_producer_expectation_raises_the_learned_price_never_lowers_it():
    core = make_core(calibrated_output=True, ewma_min_samples=1, calibrated_margin=0.0)
    core.release(make_completion("x", runtime_tokens=0, output_tokens=50), 1.0)
    assert core.cost(prompt(10, max_tokens=100, expected_output_tokens=7)) == 20 + 50  # the learned 50
    assert core.cost(prompt(10, max_tokens=100, expected_output_tokens=80)) == 20 + 80  # more room: granted
    assert core.cost(prompt(10, max_tokens=100, expected_output_tokens=900)) == 20 + 100  # never past max_tokens
    assert make_core().cost(prompt(10, max_tokens=100, expected_output_tokens=7)) == 120  # nothing learned


def test_release_rate_needs_history_then_measures_the_window():
    rate = ReleaseRate(window_s=10.0, min_samples=3)
    assert rate.rate(0.0) is None
    for t in range(3):
        rate.add(float(t), 100)
    assert rate.rate(2.0) is None  # 2 s of history in a 10 s window
    for t in range(3, 12):
        rate.add(float(t), 100)
    assert rate.rate(11.0) == pytest.approx(100.0, rel=0.11)
    assert rate.rate(30.0) is None  # everything left the window


def test_est_wait_grows_with_the_queue_and_shrinks_with_the_rate():
    core = make_core(total=1000, early_reject=False)
    for t in range(20):
        core.release(make_completion(f"d{t}", runtime_tokens=100), float(t))  # 100 tokens/s
    core.apply(prompt(450, max_tokens=100), core.evaluate(prompt(450, max_tokens=100), 20.0), 20.0)
    waits = []
    for _ in range(3):
        req = prompt(100, max_tokens=100)  # 300 each
        d = core.evaluate(req, 20.0)
        core.apply(req, d, 20.0)
        assert d.decision == QUEUE
        waits.append(d.est_wait)
    assert waits == pytest.approx([3.0, 6.0, 9.0])  # tokens ahead (nothing free) / 100 per s
    for t in range(21, 31):
        core.release(make_completion(f"e{t}", runtime_tokens=300), float(t))  # now ~300 tokens/s
    later = core.est_wait(prompt(100, max_tokens=100))
    assert later < waits[-1] / 2


def test_est_wait_counts_only_the_tenants_share_of_releases():
    core = make_core(total=1000, tenants={"a": TenantQuota(floor=0.5), "b": TenantQuota(floor=0.5)},
                     early_reject=False)
    for t in range(20):
        core.release(make_completion(f"d{t}", runtime_tokens=100), float(t))
    filler = prompt(450, max_tokens=100, tenant="b")
    core.apply(filler, core.evaluate(filler, 20.0), 20.0)
    alone = core.est_wait(prompt(100, max_tokens=100, tenant="a"))
    q = prompt(50, max_tokens=100, tenant="b")
    core.apply(q, core.evaluate(q, 20.0), 20.0)  # b is backlogged now
    shared = core.est_wait(prompt(100, max_tokens=100, tenant="a"))
    assert shared == pytest.approx(2 * alone)  # a now gets its floor's half of the releases, not all
