"""Property-based tests of the codec and every wire schema: any bytes, any map, never a crash.

A reader may only fail with the typed :class:`~natsched.bus.errors.MessageError` family (the consumers
dead-letter exactly that and retry anything else), and a message it accepts survives a
re-encode unchanged.
"""

from __future__ import annotations

import copy
import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from natsched.wire import codec, schema
from natsched.wire.errors import DecodeError, MessageError

SCHEMAS = [cls for cls in vars(schema).values()
           if isinstance(cls, type) and issubclass(cls, schema.Schema) and cls is not schema.Schema]

FAST = settings(max_examples=100, deadline=None, database=None)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30), st.binary(max_size=30),
)
#: anything msgpack can carry: nested lists and maps of scalars
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


#: values that are the right shape somewhere and wrong here: subject syntax in ids, extremes
wrong_values = st.one_of(
    st.sampled_from(["", "a.b", "*", ">", "sp ace", "x" * 200, "\x00", "é", "\r\nPUB x 1", "resp.>",
                     -(2**63), -1, 0, 2**31, 2**63 - 1, 2**64 - 1, float("nan"), float("inf"), -0.0, 1e308,
                     True, False, None, b"\xff", [], {}, [None], {"v": 1}]),
    scalars, values,
)


@st.composite
def mutated(draw, base: dict) -> dict:
    """``base`` (a valid wire map) with one to three fields, top-level or one level down, set
    to a wrong value, dropped, or joined by an unknown field."""
    wire = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for _ in range(draw(st.integers(1, 3))):
        paths = [(k,) for k in wire] + [(k, j) for k, v in wire.items() if isinstance(v, dict) for j in v]
        target = draw(st.sampled_from(paths)) if paths else ("extra",)
        holder = wire if len(target) == 1 else wire[target[0]]
        if not isinstance(holder, dict):
            continue
        action = draw(st.sampled_from(["set", "set", "drop", "add"]))
        # (copies: a drawn value may be one of wrong_values' own objects, such as {"v": 1}, which a
        # later mutation one level down would change for every example after — hypothesis then
        # stops with FlakyStrategyDefinition, as it did on a busy machine)
        if action == "set":
            holder[target[-1]] = copy.deepcopy(draw(wrong_values))
        elif action == "drop":
            holder.pop(target[-1], None)
        else:
            holder[draw(st.text(min_size=1, max_size=6))] = copy.deepcopy(draw(wrong_values))
    return wire


def valid_messages(rid: str = "fz1", tenant: str = "fz", worker: str = "w1", reply: str | None = None) -> dict:
    """One valid message of every schema a service reads, by schema name (factory defaults)."""
    req = schema.Request(id=rid, tenant=tenant, cls="online", prompt="fuzz me", max_tokens=2, reply=reply,
                         created=1.0)
    return {
        "Request": req,
        "Admitted": schema.Admitted(request=req, runtime_tokens=10, admitted_at=1.0, admitter="fuzz"),
        "Assignment": schema.Assignment(request=req, worker=worker, runtime_tokens=10, admitted_at=1.0,
                                        routed_at=1.0),
        "Completion": schema.Completion(request_id=rid, tenant=tenant, status="ok", runtime_tokens=10, ts=1.0),
        "Heartbeat": schema.Heartbeat(worker=worker, seq=1, ts=1.0, model="fz-model"),
        "CacheEvent": schema.CacheEvent(worker=worker, seq=1, kind="stored", ts=1.0, hashes=[1, 2]),
        "Control": schema.Control(kind="snapshot", ts=1.0, by="fuzz"),
        "Reply": schema.Reply(request_id=rid, kind="status", status="admitted"),
        "Decision": schema.Decision(request_id=rid, tenant=tenant, stage="admission", decision="allow", ts=1.0),
        "DeadLetter": schema.DeadLetter(subject="x", reason="malformed", error="e", ts=1.0, data=b"\x00"),
    }


def field_names(cls) -> list[str]:
    return [spec.key for spec in cls._compile()]


@st.composite
def near_valid_maps(draw, cls):
    """A map with this schema's field names and random values: structurally plausible, mostly wrong."""
    names = field_names(cls)
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
    out = {name: draw(values) for name in chosen}
    if draw(st.booleans()):
        out[draw(st.text(max_size=6))] = draw(values)  # an unknown field
    return out


@FAST
@given(st.binary(max_size=512))
def test_codec_decodes_a_map_or_raises_decode_error(data):
    try:
        out = codec.decode(data)
    except DecodeError:
        return
    assert isinstance(out, dict)


@FAST
@given(st.dictionaries(st.text(max_size=8), values, max_size=6))
def test_codec_round_trips_every_map(obj):
    again = codec.decode(codec.encode(obj))
    assert msgpack.packb(again, use_bin_type=True) == msgpack.packb(obj, use_bin_type=True)


def test_codec_refuses_oversize_and_non_maps():
    with pytest.raises(DecodeError, match="exceeds"):
        codec.decode(codec.encode({"x": b"0" * 100}), max_bytes=50)
    for not_a_map in ([1, 2], 3, "s", None):
        with pytest.raises(DecodeError, match="expected a map"):
            codec.decode(msgpack.packb(not_a_map))


@pytest.mark.parametrize("cls", SCHEMAS, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None, database=None)
@given(data=st.data())
def test_every_schema_reads_any_bytes_or_raises_a_message_error(cls, data):
    payload = data.draw(st.one_of(st.binary(max_size=200), values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                                  near_valid_maps(cls).map(lambda m: msgpack.packb(m, use_bin_type=True))))
    try:
        msg = cls.decode(payload)
    except MessageError:
        return
    assert isinstance(msg, cls)


def _has_nan(obj) -> bool:
    if isinstance(obj, float):
        return math.isnan(obj)
    if isinstance(obj, dict):
        return any(_has_nan(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_nan(v) for v in obj)
    return False


BASES = valid_messages()


def test_the_valid_bases_are_valid():
    for name, msg in BASES.items():
        assert type(msg).decode(msg.encode()) == msg, name


@pytest.mark.parametrize("name", sorted(BASES))
@settings(max_examples=40, deadline=None, database=None)
@given(data=st.data())
def test_every_accepted_message_survives_a_re_encode(name, data):
    cls = type(BASES[name])
    wire = data.draw(st.one_of(near_valid_maps(cls), mutated(BASES[name].to_wire())))
    try:
        msg = cls.from_wire(wire)
    except MessageError:
        return
    again = cls.decode(msg.encode())
    if not _has_nan(msg.to_wire()):  # NaN != NaN: such a message is accepted, but not comparable
        assert again == msg
