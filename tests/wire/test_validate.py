"""The validation engine (natsched.wire.validate) on a message declared here, apart from the real ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

import msgpack
import pytest

from natsched.wire.errors import DecodeError, SchemaError
from natsched.wire.validate import Schema, _unwrap, wire

Name = NewType("Name", str)


@dataclass
class Inner(Schema):
    n: int


@dataclass
class Probe(Schema):
    name: Name
    cls: str = wire("class", "x")
    weight: float = 1.0
    ids: list[int] = field(default_factory=list)
    inner: Inner | None = None
    inners: list[Inner] = field(default_factory=list)
    note: Name | None = None


def test_unwrap_sees_through_optional_and_newtype():
    assert _unwrap(Name | None) is str and _unwrap(list[int] | None) == list[int]
    assert _unwrap(int | str) == int | str  # a real union is left alone


def test_round_trip_with_renamed_nested_and_listed_fields():
    p = Probe(Name("a"), cls="y", weight=2, ids=[1, 2], inner=Inner(3), inners=[Inner(4)])
    wire_map = p.to_wire()
    assert wire_map["class"] == "y" and wire_map["inner"] == {"n": 3} and wire_map["inners"] == [{"n": 4}]
    assert "note" not in wire_map  # None costs nothing
    assert Probe.decode(p.encode()) == p


@pytest.mark.parametrize(("data", "where"), [
    ({}, "name"),
    ({"name": 5}, "name"),
    ({"name": "a", "weight": True}, "weight"),  # a bool is never taken for a number
    ({"name": "a", "ids": [1, "2"]}, "ids"),
    ({"name": "a", "ids": [1, False]}, "ids"),
    ({"name": "a", "inner": {"n": "3"}}, "inner.n"),
    ({"name": "a", "inners": [{"n": 1}, {}]}, "inners[1].n"),
    ({"name": "a", "note": ["x"]}, "note"),
])
def test_a_bad_field_is_named(data, where):
    with pytest.raises(SchemaError) as err:
        Probe.from_wire(data)
    assert err.value.field == where


def test_unknown_fields_are_ignored_and_ints_are_numbers():
    p = Probe.from_wire({"name": "a", "weight": 3, "future": {"x": 1}})
    assert p.weight == 3 and not hasattr(p, "future")


def test_a_nil_is_an_absent_field_and_a_nil_required_field_is_missing():
    """msgspec refuses a nil for a field with a default; the contract reads it as absent."""
    p = Probe.decode(msgpack.packb({"name": "a", "class": None, "weight": None, "ids": None, "inner": {"n": 1}}))
    assert p == Probe(Name("a"), inner=Inner(1))
    with pytest.raises(SchemaError, match="missing required field 'inner.n' in Inner") as err:
        Probe.decode(msgpack.packb({"name": "a", "inner": {"n": None}}))
    assert err.value.field == "inner.n"


def test_a_non_string_key_is_an_unknown_field():
    data = msgpack.packb({"name": "a", 7: "x", "inner": {"n": 2, b"k": 1}}, use_bin_type=True)
    assert Probe.decode(data) == Probe(Name("a"), inner=Inner(2))
    assert Probe.from_wire({"name": "a", 7: "x"}) == Probe(Name("a"))


def test_from_wire_leaves_the_callers_map_alone_when_it_repairs_one():
    data = {"name": "a", "weight": None, 3: 4}
    Probe.from_wire(data)
    assert data == {"name": "a", "weight": None, 3: 4}


@pytest.mark.parametrize(("data", "words"), [
    ({"name": 5}, "field 'name' must be a string, got int"),
    ({"name": "a", "weight": True}, "field 'weight' must be a number, got bool"),
    ({"name": "a", "ids": [1, None]}, "field 'ids' must be a list of int"),
    ({"name": "a", "ids": 3}, "field 'ids' must be a list, got int"),
    ({"name": "a", "inner": [1]}, "inner must be a map, got list"),
])
def test_a_refusal_keeps_the_old_words(data, words):
    with pytest.raises(SchemaError) as err:
        Probe.decode(msgpack.packb(data))
    assert str(err.value) == words


def test_a_message_nested_too_deeply_is_a_decode_error():
    deep = b"\x82\xa4name\xa1a\xa5inner" + b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(DecodeError):
        Probe.decode(deep)


@pytest.mark.parametrize("ids", [[1, -1], [1, 2**31], [2**64 - 1]])
def test_prompt_token_ids_outside_the_vocabulary_are_refused_as_a_whole(ids):
    from natsched.wire.schema import Admitted, Request

    req = {"id": "r", "tenant": "t", "class": "c", "prompt_token_ids": ids}
    with pytest.raises(SchemaError, match="holds a token id outside 0..2147483647") as err:
        Request.decode(msgpack.packb(req))
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(SchemaError) as err:
        Admitted.decode(msgpack.packb({"request": req, "runtime_tokens": 1, "admitted_at": 0}))
    assert err.value.field == "request.prompt_token_ids"


@dataclass
class WithPostInit(Schema):
    n: int
    doubled: int = 0

    def __post_init__(self) -> None:
        self.doubled = 2 * self.n


def test_a_message_with_a_post_init_is_built_through_it():
    assert WithPostInit.decode(msgpack.packb({"n": 3})).doubled == 6


@pytest.mark.parametrize("ids, why", [([], "got 0"), (list(range(8)), "got 8"), ([1, 2**31], "outside")])
def test_resume_token_ids_must_leave_a_token_to_generate_and_be_in_the_vocabulary(ids, why):
    """A migrated stream's output so far (natsched.client.producer): empty, as long as
    ``max_tokens`` (nothing left to generate) or out of range is refused, naming the field."""
    from natsched.wire.schema import Request

    req = {"id": "r", "tenant": "t", "class": "c", "prompt": "p", "max_tokens": 8, "resume_token_ids": ids}
    with pytest.raises(SchemaError, match=why) as err:
        Request.decode(msgpack.packb(req))
    assert err.value.field == "resume_token_ids"
    ok = Request.decode(msgpack.packb({**req, "resume_token_ids": [5, 6, 7]}))
    assert ok.resume_token_ids == [5, 6, 7] and Request.decode(ok.encode()) == ok
