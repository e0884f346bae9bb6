"""Batch files line by line (pure): what each line becomes, and what a malformed one gets."""

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.client.batch import LineError, attempt_id, batch_id, parse_line, plan_batch, request_id, span_lines, to_spans
from natsched.wire.ids import ID_PATTERN, in_scope, unscoped


def jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows)


def test_prompt_line_keeps_its_fields():
    fields = parse_line(orjson.dumps({"prompt": "hi", "max_tokens": 7, "model": "m", "system_prompt": "sys",
                                      "unknown_key": 1}))
    assert fields == {"prompt": "hi", "max_tokens": 7, "model": "m", "system_prompt": "sys"}


def test_messages_are_rendered_by_the_chat_template_with_system_as_the_stable_prefix():
    fields = parse_line(orjson.dumps({"messages": [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "why?"}]}))
    assert fields["system_prompt"] == "<|system|>\nbe brief\n"
    assert fields["prompt"] == "<|user|>\nwhy?\n<|assistant|>\n"


def test_a_lines_system_prompt_leads_its_messages():
    fields = parse_line(orjson.dumps({"system_prompt": "kb v1", "messages": [{"role": "system", "content": "b"},
                                                                              {"role": "user", "content": "q"}]}))
    assert fields["system_prompt"] == "<|system|>\nkb v1\n<|system|>\nb\n"


def test_openai_batch_body_is_read():
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 9}}
    fields = parse_line(orjson.dumps(line))
    assert fields["prompt"] == "<|user|>\nq\n<|assistant|>\n" and fields["max_tokens"] == 9


def test_token_ids_line():
    assert parse_line(orjson.dumps({"prompt_token_ids": [1, 2, 3]}))["prompt_token_ids"] == [1, 2, 3]


@pytest.mark.parametrize("raw,why", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (orjson.dumps({"max_tokens": 3}), "exactly one of"),
    (orjson.dumps({"prompt": "a", "prompt_token_ids": [1]}), "exactly one of"),
    (orjson.dumps({"prompt": 5}), "'prompt' must be a string"),
    (orjson.dumps({"prompt": "a", "max_tokens": 0}), "'max_tokens' must be an integer >= 1"),
    (orjson.dumps({"prompt": "a", "max_tokens": True}), "'max_tokens' must be an integer >= 1"),
    (orjson.dumps({"prompt_token_ids": [1, -2]}), "integers >= 0"),
    (orjson.dumps({"prompt_token_ids": []}), "non-empty"),
    (orjson.dumps({"messages": [{"role": "user"}]}), "messages[0]"),
    (orjson.dumps({"messages": [{"role": "system", "content": "only"}]}), "only system"),
    (orjson.dumps({"messages": [{"role": "tool", "content": "42"}]}), "not supported"),
    (orjson.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "only text parts"),
    (orjson.dumps({"system_prompt": "s", "messages": []}), "non-empty"),
    (b'{"prompt": "' + b"x" * (1024 * 1024 + 10) + b'"}', "exceeds"),
])
def test_malformed_lines_say_why(raw, why):
    with pytest.raises(LineError) as err:
        parse_line(raw)
    assert why in str(err.value)


def test_plan_reports_malformed_lines_by_number_and_keeps_the_rest():
    data = jsonl({"prompt": "a"}, b"", b"{oops", {"prompt": "b"}, b"   ")
    plan = plan_batch(data, "t1")
    assert [line for line, _ in plan.requests] == [1, 4]
    assert list(plan.malformed) == [3] and "not valid JSON" in plan.malformed[3]
    assert plan.lines == 5 and plan.spans() == [[1, 1], [4, 4]]


def test_ids_are_deterministic_valid_tokens_and_carry_the_job_reply_subject():
    data = jsonl({"prompt": "a"}, {"prompt": "b"})
    first, again = plan_batch(data, "t1"), plan_batch(data, "t1")
    assert [r.id for _, r in first.requests] == [r.id for _, r in again.requests]
    _, req = first.requests[1]
    assert req.id == request_id(first.id, 2, "t1") and ID_PATTERN.match(req.id)
    assert in_scope("t1", req.id) and not in_scope("t2", req.id) and unscoped(req.id) == f"{first.id}-2"
    assert req.reply == S.outcome("t1", first.id, req.id) and req.cls == "batch" and req.tenant == "t1"


def test_other_tenant_class_or_bytes_make_another_batch():
    data = jsonl({"prompt": "a"})
    ids = {batch_id("t1", "batch", data), batch_id("t2", "batch", data), batch_id("t1", "offline", data),
           batch_id("t1", "batch", data + b"\n")}
    assert len(ids) == 4


def test_hostile_tenant_is_refused_before_anything_is_built():
    with pytest.raises(ValueError):
        plan_batch(jsonl({"prompt": "a"}), "t1.>")


def test_attempt_ids_are_fresh_valid_tokens():
    assert attempt_id("job", 1) == "job" and attempt_id("job", 3) == "job-r3"
    long = "x" * 128
    assert ID_PATTERN.match(attempt_id(long, 2)) and attempt_id(long, 2) != attempt_id(long, 3)


def test_spans_round_trip():
    lines = [1, 2, 3, 7, 9, 10]
    assert to_spans(lines) == [[1, 3], [7, 7], [9, 10]]
    assert list(span_lines(to_spans(lines))) == lines
