"""Foundation admission: validation before quota, the cluster total, the release of reservations."""

import pytest

from natsched.admitter.policy import ALLOW, QUEUE, REJECT, AdmissionSettings, AdmitterCore, runtime_tokens
from natsched.admitter.quotas import Quotas, TenantQuota
from tests.factories.core import make_completion, make_request


def make_core(total: int = 1000, **kw) -> AdmitterCore:
    return AdmitterCore(AdmissionSettings(**kw), Quotas(total=total))


def submit(core: AdmitterCore, request, now: float = 0.0):
    decision = core.evaluate(request, now)
    core.apply(request, decision, now)
    return decision


def test_runtime_tokens_count_prefill_plus_kv():
    req = make_request(prompt_token_ids=list(range(100)), max_tokens=20)
    assert runtime_tokens(req) == 100 + 100 + 20
    assert make_core().cost(req) == 220
    req.expected_output_tokens = 5  # a producer's claim lowers nothing: it is the one who pays
    assert runtime_tokens(req) == 220
    assert make_core().cost(req) == 220
    req.expected_output_tokens = 500  # it may ask for more room, never past max_tokens
    assert make_core().cost(req) == 220


def test_declared_costs_do_not_let_a_tenant_past_its_cap():
    """The attack: ``expected_output_tokens=1`` with ``max_tokens=8000`` put 10 requests under a
    tenant cap that admits 2 honest ones. Priced by the admitter, the third is refused."""
    core = AdmitterCore(AdmissionSettings(), Quotas(total=1_000_000, tenants={"a": TenantQuota(cap=2 * 8200)},
                                                    queue_limits={"online": 0}))
    decisions = [submit(core, make_request(tenant="a", prompt_token_ids=list(range(100)), max_tokens=8000,
                                           expected_output_tokens=1)) for _ in range(10)]
    assert [d.decision for d in decisions] == [ALLOW, ALLOW] + [REJECT] * 8
    assert {d.reason for d in decisions[2:]} == {"tenant_cap"} and decisions[0].runtime_tokens == 8200


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"cls": "gold"}, "invalid_class"),
        ({"max_tokens": 0}, "invalid_max_tokens"),
        ({"max_tokens": -3}, "invalid_max_tokens"),
        ({"max_tokens": 10**9}, "invalid_max_tokens"),
        ({"prompt_token_ids": list(range(5000))}, "prompt_too_long"),
        ({"prompt_token_ids": [1, -2]}, "invalid"),
        ({"expected_output_tokens": -1}, "invalid"),
        ({"deadline": float("nan")}, "invalid"),
    ],
)
def test_invalid_requests_are_rejected_before_any_quota(kwargs, reason):
    core = make_core(max_prompt_tokens=4096)
    d = submit(core, make_request(**kwargs))
    assert (d.decision, d.reason) == (REJECT, reason)
    assert d.message and d.retry_after is None
    assert core.usage.used == 0 and core.queued() == 0


def test_subject_must_match_body():
    core = make_core()
    d = core.evaluate(make_request(tenant="alice"), 0, subject="req.online.bob")
    assert (d.decision, d.reason) == (REJECT, "subject_mismatch")
    assert core.evaluate(make_request(tenant="bob"), 0, subject="req.online.bob").decision == ALLOW


def test_allows_until_total_then_queues_and_release_frees():
    core = make_core(total=100)
    reqs = [make_request(prompt_token_ids=list(range(10)), max_tokens=10) for _ in range(4)]  # 30 each
    decisions = [submit(core, r) for r in reqs]
    assert [d.decision for d in decisions] == [ALLOW, ALLOW, ALLOW, QUEUE]
    assert core.usage.used == 90 and core.queued() == 1
    assert core.release(make_completion(reqs[0].id, runtime_tokens=30), 1.0) == 30
    assert core.usage.used == 60
    picks = core.plan_dequeue(1.0)
    assert [(r.id, d.decision) for r, d in picks] == [(reqs[3].id, ALLOW)]
    core.commit_dequeue(picks, 1.0)
    assert core.usage.used == 90 and core.queued() == 0


def test_request_larger_than_total_is_too_large():
    core = make_core(total=10)
    d = core.evaluate(make_request(prompt_token_ids=list(range(50))), 0)
    assert (d.decision, d.reason) == (REJECT, "too_large")
    assert d.retry_after is None  # waiting would not help


def test_release_clamps_and_keeps_tenant_accounting():
    core = make_core(total=100)
    req = make_request(prompt_token_ids=list(range(10)), max_tokens=10, tenant="t9")
    submit(core, req)
    assert core.usage.tenant("t9") == 30
    core.release(make_completion(req.id, tenant="t9", runtime_tokens=30), 1.0)
    core.release(make_completion(req.id, tenant="t9", runtime_tokens=30), 1.0)  # late duplicate
    assert core.usage.used == 0 and core.usage.tenant("t9") == 0
