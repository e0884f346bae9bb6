"""The offline runner's pure parts: which held work may run now, and what a reply does to a job."""

import pytest

from natsched.admitter.errors import SettingsError
from natsched.admitter.offline import IdleGate, OfflineSettings, on_failure, on_reply, on_take, stale
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.admitter.usage import Usage
from natsched.wire.schema import JobRecord, Reply
from tests.factories.core import make_request


def held(n=1, *, tokens=100, max_tokens=20, **kw):
    """Requests of 2 * tokens + max_tokens runtime tokens each."""
    return [make_request(prompt_token_ids=list(range(tokens)), max_tokens=max_tokens, cls="batch", **kw)
            for _ in range(n)]


def gate(**kw) -> IdleGate:
    return IdleGate(OfflineSettings(**kw))


def test_takes_only_what_fits_under_the_low_watermark():
    v = gate(low_watermark=0.5).plan(Usage(), Quotas(total=1000), 1000, held(4))  # 220 each, budget 500
    assert [i for i, _ in v.takes] == [0, 1] and v.usage.used == 440
    assert v.budget["offline_budget"] == 500


def test_online_usage_counts_against_the_offline_share():
    v = gate().plan(Usage(used=400), Quotas(total=1000), 1000, held(2))
    assert v.takes == [] and v.usage is None  # 400 + 220 > 500: the online reserve is not taken


def test_no_overtaking_a_large_head():
    work = held(1, tokens=200) + held(1)  # 420, then 220
    v = gate().plan(Usage(used=100), Quotas(total=1000), 1000, work)
    assert v.takes == []  # 100 + 420 > 500 and the small one waits behind it


def test_a_capped_tenant_is_skipped_others_still_run():
    quotas = Quotas(total=1000, tenants={"capped": TenantQuota(cap=300), "t1": TenantQuota()})
    work = held(1, tenant="capped") + held(1, tenant="capped") + held(1)
    v = gate().plan(Usage(), quotas, 1000, work)
    assert [i for i, _ in v.takes] == [0, 2]


def test_hopeless_work_is_refused_not_held_forever():
    quotas = Quotas(total=1000, unknown_tenant="reject", tenants={"t1": TenantQuota()})
    work = held(1, tokens=400) + held(1, tenant="stranger") + held(1, max_tokens=0) + held(1)
    v = gate().plan(Usage(), quotas, 1000, work)
    assert [(i, reason) for i, reason, _ in v.refusals] == [(0, "too_large"), (1, "unknown_tenant"),
                                                            (2, "invalid_max_tokens")]
    assert [i for i, _ in v.takes] == [3]


@pytest.mark.parametrize("kw", [{"low_watermark": 0}, {"low_watermark": 1.5}, {"max_attempts": 0},
                                {"job_timeout_s": 0}])
def test_unusable_settings_are_refused(kw):
    with pytest.raises(SettingsError):
        OfflineSettings(**kw)


# ---------------------------------------------------------------- job records

JOB = ("t1", "b1", "job1")


def record(status="submitted", **kw) -> JobRecord:
    kw.setdefault("request", make_request(id="job1", cls="batch"))
    return JobRecord(id="job1", tenant="t1", status=status, batch="b1", **kw)


def reply(kind="status", request_id="job1", **kw) -> Reply:
    return Reply(request_id=request_id, kind=kind, **kw)


def test_degraded_then_taken_runs_attempt_one_under_the_job_id():
    r, act = on_reply(record(), reply(status="degraded", job_id="job1"), JOB, 1.0, 3)
    assert (r.status, r.enqueued, act) == ("waiting", 1, None)
    r = on_take(r, r.request, "b1", 2.0, "offline")
    assert (r.status, r.attempts, r.attempt_id, r.path) == ("running", 1, "job1", "offline")


def test_admitted_online_then_result_completes_once():
    r, _ = on_reply(record(), reply(status="admitted"), JOB, 1.0, 3)
    assert (r.status, r.path, r.attempt_id) == ("running", "online", "job1")
    r, _ = on_reply(r, reply("result", text="out", worker="w1", output_tokens=3), JOB, 2.0, 3)
    assert (r.status, r.output, r.worker, r.output_tokens) == ("completed", "out", "w1", 3)
    again, act = on_reply(r, reply("result", text="other"), JOB, 3.0, 3)
    assert again is None and act is None  # the first outcome stands


def test_result_overtaking_its_admitted_status_still_counts_one_attempt():
    r, _ = on_reply(record(), reply("result", text="x"), JOB, 1.0, 3)
    assert (r.status, r.attempts) == ("completed", 1)
    assert on_reply(r, reply(status="admitted"), JOB, 2.0, 3) == (None, None)


def test_transient_failure_is_retried_then_dead_lettered_at_the_limit():
    r = on_take(record(), record().request, "b1", 1.0, "offline")
    r, act = on_reply(r, reply("error", status="failed", reason="no_worker"), JOB, 2.0, 2)
    assert (r.status, act, r.reason) == ("waiting", "retry", "no_worker")
    r = on_take(r, r.request, "b1", 3.0, "offline")
    assert r.attempt_id == "job1-r2"
    r, act = on_reply(r, reply("error", request_id="job1-r2", status="failed", reason="engine_error"), JOB, 4.0, 2)
    assert (r.status, act, r.reason) == ("failed", "fail", "engine_error")
    assert "after 2 attempt" in r.message


def test_permanent_failure_ends_at_once():
    r = on_take(record(), record().request, "b1", 1.0, "offline")
    r, act = on_reply(r, reply("error", status="failed", reason="prompt_too_long"), JOB, 2.0, 3)
    assert (r.status, act, r.attempts) == ("failed", "fail", 1)


def test_an_old_attempts_error_is_ignored():
    r = on_take(on_take(record(), record().request, "b1", 1.0, "o"), record().request, "b1", 2.0, "o")
    assert on_reply(r, reply("error", request_id="job1", status="failed", reason="no_worker"), JOB, 3.0, 3) == \
        (None, None)


def test_quota_rejection_requeues_without_spending_an_attempt():
    r, act = on_reply(record(), reply("error", status="rejected", reason="queue_full", retry_after=1.0), JOB, 1.0, 3)
    assert (r.status, act, r.attempts, r.enqueued) == ("waiting", "requeue", 0, 1)


def test_invalid_rejection_fails_the_job():
    r, act = on_reply(record(), reply("error", status="rejected", reason="too_large"), JOB, 1.0, 3)
    assert (r.status, act) == ("failed", "fail")


def test_a_reply_for_an_unknown_job_is_kept_not_dropped():
    r, _ = on_reply(None, reply("result", text="x"), JOB, 1.0, 3)
    assert (r.id, r.tenant, r.batch, r.status) == ("job1", "t1", "b1", "completed")


def test_without_its_request_a_job_cannot_be_retried():
    r = record(status="running", request=None, attempts=1, attempt_id="job1")
    r, act = on_failure(r, "no_worker", None, 1.0, 3)
    assert (r.status, act) == ("failed", "fail")


def test_history_is_capped():
    r = record()
    for i in range(100):
        r, _ = on_reply(r, reply(status="assigned", worker=f"w{i}"), JOB, float(i), 3) if r.status == "running" \
            else on_reply(r, reply(status="admitted"), JOB, float(i), 3)
    assert len(r.history) == 32 and r.worker == "w99"


def test_a_reply_of_another_request_on_our_subject_changes_nothing():
    r, _ = on_reply(record(), reply(status="admitted"), JOB, 1.0, 3)
    assert on_reply(r, reply("result", request_id="someone-else", text="forged"), JOB, 2.0, 3) == (None, None)
    assert on_reply(r, reply("result", request_id="job1-r2", text="not yet"), JOB, 2.0, 3) == (None, None)


# --- outcomes fenced by admission attempt (issue 26) ------------------------------------------

def _running_record(admission_attempt=0) -> JobRecord:
    r = on_take(None, make_request(id="job-1", cls="batch"), "b", 1.0, "offline")
    r.admission_attempt = admission_attempt
    return r


def _result(attempt, rid="job-1") -> Reply:
    return Reply(request_id=rid, kind="result", text="out", worker="w", attempt=attempt)


def test_an_outcome_older_than_the_reservations_or_the_records_attempt_is_stale():
    assert stale(_running_record(), _result(0), reserved=1)  # the rescue moved the reservation on
    assert stale(_running_record(admission_attempt=1), _result(0), reserved=0)  # released; the record knows
    assert not stale(_running_record(admission_attempt=1), _result(1), reserved=1)  # the attempt running now
    assert not stale(_running_record(), _result(0), reserved=0)  # never rescued
    assert not stale(_running_record(admission_attempt=2), _result(0, rid="job-1-r2"))  # another attempt id: on_reply decides
    assert stale(None, _result(0), reserved=1)  # no record yet: the reservation alone decides


def test_a_rerouted_status_moves_the_records_admission_attempt_on_and_a_taken_result_keeps_it():
    record = _running_record()
    rerouted = Reply(request_id="job-1", kind="status", status="rerouted", worker="w1", attempt=1)
    record, act = on_reply(record, rerouted, ("t", "b", "job-1"), 2.0, 3)
    assert (record.admission_attempt, record.worker, act) == (1, None, None)
    assert on_reply(record, rerouted, ("t", "b", "job-1"), 2.5, 3) == (None, None)  # told twice: nothing new
    record, _ = on_reply(record, _result(1), ("t", "b", "job-1"), 3.0, 3)
    assert (record.status, record.admission_attempt) == ("completed", 1)
    assert on_take(record, record.request, "b", 4.0, "offline").admission_attempt == 0  # a fresh attempt id
