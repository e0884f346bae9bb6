"""Foundation admission: validation before quota, the cluster total, idempotent release."""

import pytest

from admitter.policy import ALLOW, REJECT, AdmissionSettings, AdmitterCore, runtime_tokens
from tests.factories import make_request


def make_core(total: int = 1000, **kw) -> AdmitterCore:
    core = AdmitterCore(AdmissionSettings(**kw))
    core.set_total(total)
    return core


def test_runtime_tokens_count_prefill_plus_kv():
    req = make_request(prompt_token_ids=list(range(100)), max_tokens=20)
    assert runtime_tokens(req) == 100 + 100 + 20
    req.expected_output_tokens = 5
    assert runtime_tokens(req) == 205


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"cls": "gold"}, "invalid_class"),
        ({"max_tokens": 0}, "invalid_max_tokens"),
        ({"max_tokens": -3}, "invalid_max_tokens"),
        ({"max_tokens": 10**9}, "invalid_max_tokens"),
        ({"prompt_token_ids": list(range(5000))}, "prompt_too_long"),
        ({"prompt_token_ids": [1, -2]}, "invalid"),
    ],
)
def test_invalid_requests_are_rejected_before_any_quota(kwargs, reason):
    core = make_core(max_prompt_tokens=4096)
    d = core.decide(make_request(**kwargs), 0)
    assert (d.decision, d.reason) == (REJECT, reason)
    assert core.used == 0 and not core.inflight


def test_subject_must_match_body():
    core = make_core()
    d = core.decide(make_request(tenant="alice"), 0, subject="req.online.bob")
    assert (d.decision, d.reason) == (REJECT, "subject_mismatch")
    assert core.decide(make_request(tenant="bob"), 0, subject="req.online.bob").decision == ALLOW


def test_allows_until_total_then_rejects_with_retry_after():
    core = make_core(total=100)
    reqs = [make_request(prompt_token_ids=list(range(10)), max_tokens=10) for _ in range(4)]  # 30 each
    decisions = [core.decide(r, 0) for r in reqs]
    assert [d.decision for d in decisions] == [ALLOW, ALLOW, ALLOW, REJECT]
    assert decisions[3].reason == "quota_exhausted" and decisions[3].retry_after > 0
    assert core.used == 90
    assert core.release(reqs[0].id) == 30 and core.release(reqs[0].id) == 0  # idempotent
    assert core.decide(reqs[3], 0).decision == ALLOW


def test_request_larger_than_total_is_too_large():
    core = make_core(total=10)
    d = core.decide(make_request(prompt_token_ids=list(range(50))), 0)
    assert (d.decision, d.reason) == (REJECT, "too_large")


def test_redelivered_request_keeps_one_reservation():
    core = make_core(total=100)
    req = make_request(prompt_token_ids=list(range(10)), max_tokens=10)
    assert core.decide(req, 0).decision == ALLOW
    assert core.decide(req, 0).decision == ALLOW
    assert core.used == 30
