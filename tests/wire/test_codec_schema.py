import msgpack
import pytest
from hypothesis import given, strategies as st

from natsched.wire import codec
from natsched.wire.errors import DecodeError, SchemaError
from natsched.wire.schema import Admitted, Completion, Heartbeat, Reply, Request
from tests.factories.core import make_request


def test_round_trip_keeps_every_field():
    req = make_request("hi", system_prompt="sys", kb_version="kb7", expected_output_tokens=3, deadline=5.5,
                       reply="resp.x", stream=True, degradable=True)
    assert Request.decode(req.encode()) == req


def test_wire_uses_class_key_and_omits_none():
    wire = make_request("hi").to_wire()
    assert wire["class"] == "online" and "cls" not in wire
    assert "prompt_token_ids" not in wire and "deadline" not in wire


def test_unknown_fields_are_ignored():
    wire = make_request("hi").to_wire() | {"future_field": [1, 2], "v": 9}
    req = Request.from_wire(wire)
    assert req.prompt == "hi" and req.v == 9


@pytest.mark.parametrize("field", ["id", "tenant", "class"])
def test_missing_required_field_is_named(field):
    wire = make_request("hi").to_wire()
    del wire[field]
    with pytest.raises(SchemaError) as err:
        Request.from_wire(wire)
    assert err.value.field == field and field in str(err.value)


def test_prompt_or_token_ids_required():
    wire = make_request("hi").to_wire()
    del wire["prompt"]
    with pytest.raises(SchemaError, match="prompt"):
        Request.from_wire(wire)


@pytest.mark.parametrize(
    "field,value",
    [("max_tokens", "5"), ("max_tokens", True), ("prompt", 5), ("prompt_token_ids", ["a"]), ("stream", 1)],
)
def test_mistyped_field_is_named(field, value):
    wire = make_request("hi").to_wire() | {field: value}
    with pytest.raises(SchemaError) as err:
        Request.from_wire(wire)
    assert err.value.field == field


@pytest.mark.parametrize("bad_id", ["a.b", "x>", "", "with space", "*"])
def test_ids_must_be_subject_tokens(bad_id):
    with pytest.raises(SchemaError, match="id"):
        Request.from_wire(make_request("hi").to_wire() | {"id": bad_id})


def test_nested_error_names_the_path():
    with pytest.raises(SchemaError) as err:
        Admitted.from_wire({"request": {"id": "a", "tenant": "t"}, "runtime_tokens": 1, "admitted_at": 0})
    assert err.value.field == "request.class"


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb("str"), b"\x81\xa1a"])
def test_codec_rejects_non_maps_and_garbage(data):
    with pytest.raises(DecodeError):
        codec.decode(data)


def test_codec_rejects_oversize():
    with pytest.raises(DecodeError, match="exceeds"):
        codec.decode(b"\x80" * 100, max_bytes=10)


@given(st.binary(max_size=256))
def test_random_bytes_raise_only_typed_errors(data):
    try:
        Request.decode(data)
    except (DecodeError, SchemaError):
        pass


@given(st.dictionaries(st.sampled_from(["id", "tenant", "class", "prompt", "max_tokens", "stream", "x"]),
                       st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans(),
                                 st.lists(st.integers(), max_size=3))))
def test_random_maps_raise_only_schema_errors(wire):
    try:
        Request.from_wire(wire)
    except SchemaError:
        pass


def test_other_messages_round_trip():
    for msg in (Completion(request_id="a", tenant="t", status="ok", runtime_tokens=3, cls="batch"),
                Heartbeat(worker="w", seq=1, ts=1.0, inflight=["a", "b"]),
                Reply(request_id="a", kind="token", text="x", token_ids=[1], index=0)):
        assert type(msg).decode(msg.encode()) == msg


@pytest.mark.parametrize("message, field", [
    (Completion(request_id="r1", tenant="t1", status="ok", runtime_tokens=10, expected_cached_tokens=-5),
     "expected_cached_tokens"),
    (Completion(request_id="r1", tenant="t1", status="ok", runtime_tokens=10, cached_tokens=-1), "cached_tokens"),
    (Admitted(request=make_request(), runtime_tokens=-1, admitted_at=1.0), "runtime_tokens"),
    (Admitted(request=make_request(), runtime_tokens=1, admitted_at=1.0, attempt=-2), "attempt"),
])
def test_negative_counts_are_refused_and_named(message, field):
    """A negative count from a hostile producer would reach a Prometheus counter (which raises)
    or make a worker look better than idle: the message is invalid instead."""
    with pytest.raises(SchemaError, match=f"'{field}' must be >= 0"):
        type(message).decode(message.encode())


@pytest.mark.parametrize("reply,tenant,allowed", [
    ("resp.r1", "t", True), ("resp.t.r1", "t", True), ("resp.t.r1", None, True), ("resp.u.r1", "t", False),
    ("outcome.t.b.j", "t", True), ("outcome.u.b.j", "t", False), ("outcome.t.b", "t", False),
    ("bench.resp.run", "t", True), ("bench.other.run", "t", False), ("resp.a.b.c", None, False),
    ("resp", None, False), ("resp.", None, False), ("resp.*", None, False), ("resp.r1\n", None, False),
    ("work.w1", None, False), ("$KV.inflight.usage", None, False), ("", None, False),
])
def test_reply_subjects_a_request_may_name(reply, tenant, allowed):
    """One regular expression decides it (it runs on every request decoded): the same table as
    the rule in subjects.md, including a trailing newline, which a per-token ``match`` let through."""
    from natsched.wire.subjects import reply_allowed

    assert reply_allowed(reply, tenant) is allowed


def test_a_number_field_keeps_an_int_and_a_bool_is_never_an_int():
    """Decoding takes a value of the declared type as it is and sends anything else to the
    field's checker: an int where a float is declared stays an int, a bool is refused for an int."""
    wire = Completion(request_id="r", tenant="t", status="ok", runtime_tokens=3, ttft=1).to_wire()
    assert type(Completion.from_wire(wire).ttft) is int
    with pytest.raises(SchemaError) as err:
        Completion.from_wire(wire | {"runtime_tokens": False})
    assert err.value.field == "runtime_tokens" and "bool" in str(err.value)


class _Msg:
    def __init__(self, reply):
        self.reply, self.subject, self.data, self.headers = reply, "s", b"", None

    @property
    def metadata(self):
        from nats.aio.msg import Msg

        return Msg.Metadata._from_reply(self.reply)


@pytest.mark.parametrize("reply,delivered", [
    ("$JS.ACK.WORK.worker-w1.3.17.9.1700000000000000000.0", 3),  # the form a server without a domain sends
    ("$JS.ACK.hub.ACCHASH.WORK.worker-w1.4.17.9.1700000000000000000.2.xyz", 4),  # with a domain: nats-py's parser
])
def test_a_deliverys_count_is_read_off_its_ack_subject(reply, delivered):
    from natsched.bus.connection import Delivery

    assert Delivery(_Msg(reply)).num_delivered == delivered


def test_a_message_without_an_ack_subject_is_no_delivery():
    from nats.errors import Error

    from natsched.bus.connection import Delivery

    with pytest.raises(Error):
        Delivery(_Msg("")).num_delivered


def test_a_routing_record_unfolds_into_the_admission_record_it_carries():
    from natsched.wire.schema import Decision

    admission = Decision(request_id="r1", tenant="t", stage="admission", decision="allow", ts=1.0,
                         budget={"total": 10})
    routing = Decision(request_id="r1", tenant="t", stage="routing", decision="assign", ts=2.0, worker="w1",
                       admission=admission.to_wire())
    assert Decision.decode(routing.encode()).unfolded() == [admission, routing]
    assert admission.unfolded() == [admission]
    broken = Decision(request_id="r1", tenant="t", stage="routing", decision="assign", ts=2.0, admission={"ts": 1})
    assert broken.unfolded() == [broken]  # an unreadable inner record is left out, the outer one kept


@pytest.mark.parametrize("token", ["é" * 16, "\x00", ""])
def test_a_fence_that_is_not_hex_is_refused_not_a_crash(token):
    """A hostile worker's completion may carry any text as its fence; compare_digest raises on
    non-ASCII text, which crashed the completion handlers (found by the services' fuzz test)."""
    from natsched.wire import fence

    assert fence.verify(None, token, "r1", "w1", 0) is False
    assert fence.verify(None, fence.sign(None, "r1", "w1", 0), "r1", "w1", 0) is True


def test_heartbeat_decode_progress_is_optional_and_checked():
    """An older worker's heartbeat (no progress) stays valid; a hostile one's bad progress is refused, named."""
    old = {"worker": "w", "seq": 1, "ts": 1.0}
    hb = Heartbeat.decode(msgpack.packb(old))
    assert (hb.decode_tokens, hb.decode_s) == (0, 0.0)
    new = Heartbeat(worker="w", seq=1, ts=1.0, decode_tokens=40, decode_s=0.5)
    assert Heartbeat.decode(new.encode()) == new
    for bad, field in (({"decode_tokens": -1}, "decode_tokens"), ({"decode_s": -0.5}, "decode_s"),
                       ({"decode_s": float("inf")}, "decode_s"), ({"decode_s": "fast"}, "decode_s")):
        with pytest.raises(SchemaError, match=field):
            Heartbeat.decode(msgpack.packb(old | bad))
