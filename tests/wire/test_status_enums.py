"""Reply, completion and job statuses are closed sets: same bytes as the old strings, unknown ones refused."""

import msgpack
import pytest

from natsched.wire.errors import SchemaError
from natsched.wire.schema import (Completion, CompletionStatus, JobRecord, JobStatus, Reply, ReplyKind,
                                  ReplyStatus)


def test_enum_values_are_the_strings_on_the_wire():
    reply = Reply(request_id="r1", kind=ReplyKind.STATUS, status=ReplyStatus.QUEUED, est_wait=1.5)
    plain = msgpack.packb({"request_id": "r1", "kind": "status", "status": "queued", "est_wait": 1.5, "v": 1},
                          use_bin_type=True)
    assert reply.encode() == plain
    back = Reply.decode(plain)
    assert back.status is ReplyStatus.QUEUED and back.kind is ReplyKind.STATUS and back == reply


@pytest.mark.parametrize("status", list(ReplyStatus))
def test_every_reply_status_round_trips_to_its_member(status):
    kind = ReplyKind.ERROR if status in (ReplyStatus.REJECTED, ReplyStatus.FAILED) else ReplyKind.STATUS
    assert Reply.decode(Reply(request_id="r1", kind=kind, status=status).encode()).status is status


@pytest.mark.parametrize(("cls", "data", "field"), [
    (Reply, {"request_id": "r1", "kind": "status", "status": "teleported"}, "status"),
    (Reply, {"request_id": "r1", "kind": "status", "status": 3}, "status"),
    (Reply, {"request_id": "r1", "kind": "status", "status": True}, "status"),
    (Reply, {"request_id": "r1", "kind": "gossip"}, "kind"),
    (Reply, {"request_id": "r1", "kind": "Result"}, "kind"),  # the values are case-sensitive
    (Completion, {"request_id": "r1", "tenant": "t", "status": "maybe", "runtime_tokens": 1}, "status"),
    (JobRecord, {"id": "j1", "tenant": "t", "status": "pending"}, "status"),
    (JobRecord, {"id": "j1", "tenant": "t", "status": ["completed"]}, "status"),
])
def test_an_unknown_status_or_kind_is_a_schema_error_naming_the_field(cls, data, field):
    with pytest.raises(SchemaError, match="must be one of") as err:
        cls.from_wire(data)
    assert err.value.field == field


def test_job_statuses_final_and_the_batch_names():
    from natsched.client import batch

    assert {s for s in JobStatus if s.final} == {JobStatus.COMPLETED, JobStatus.FAILED} == batch.FINAL
    assert batch.JOB_STATUSES == ("submitted", "waiting", "running", "completed", "failed")
    record = JobRecord.decode(JobRecord(id="j1", tenant="t", status=JobStatus.RUNNING).encode())
    assert record.status is JobStatus.RUNNING and record.status == "running" and f"{record.status}" == "running"


def test_completion_status_and_a_final_reply():
    c = Completion.from_wire({"request_id": "r1", "tenant": "t", "status": "error", "runtime_tokens": 0})
    assert c.status is CompletionStatus.ERROR
    assert Reply.from_wire({"request_id": "r1", "kind": "result"}).final
    assert not Reply.from_wire({"request_id": "r1", "kind": "token"}).final
