"""The one id rule (natsched.wire.ids): schema and subjects refuse the same bad ids."""

import pytest

from natsched.wire import subjects as S
from natsched.wire.errors import IdError, SchemaError, WireError
from natsched.wire.ids import ID_PATTERN, is_token, token
from natsched.wire.schema import Completion, Request

BAD = ["", "a.b", "a b", "*", ">", "a*", "tenant/1", "x" * 129, "é", "a\n"]
GOOD = ["a", "A-1_b", "x" * 128, "0"]


@pytest.mark.parametrize("value", GOOD)
def test_good_ids_pass_everywhere(value):
    assert is_token(value) and token(value) == value and ID_PATTERN.match(value)
    assert S.work(value) == f"work.{value}"
    Request(id=value, tenant=value, cls="online", prompt="p").__post_init_check__()


@pytest.mark.parametrize("value", BAD)
def test_bad_ids_are_refused_by_the_builders_and_the_schema_alike(value):
    assert not is_token(value)
    with pytest.raises(IdError, match="tenant") as err:
        S.completion(value, "w1")
    assert err.value.what == "tenant" and isinstance(err.value, (ValueError, WireError))
    with pytest.raises(SchemaError) as bad:
        Completion.from_wire({"request_id": "r1", "tenant": value, "status": "ok", "runtime_tokens": 1})
    assert bad.value.field == "tenant"


def test_non_strings_are_not_tokens():
    assert not is_token(None) and not is_token(12)
    with pytest.raises(IdError):
        token(12, "worker id")  # type: ignore[arg-type]


def test_schema_and_subjects_import_without_a_cycle():
    import subprocess
    import sys

    for first in ("natsched.wire.subjects", "natsched.wire.schema", "natsched.wire.ids"):
        done = subprocess.run([sys.executable, "-c", f"import {first}"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_kv_names_follow_nats_kv():
    assert S.kv_stream(S.BUCKET_JOBS) == "KV_jobs"
    assert S.kv_subject(S.BUCKET_JOBS, S.job_filter("A")) == "$KV.jobs.job.A.*.*"
