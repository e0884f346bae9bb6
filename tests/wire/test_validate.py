"""The validation engine (natsched.wire.validate) on a message declared here, apart from the real ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

import pytest

from natsched.wire.errors import SchemaError
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
