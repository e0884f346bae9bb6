"""The validation engine under every wire message: a dataclass's annotations become checks.

:class:`Schema` compiles each message class once (lazily: type hints need the whole module
defined) into one :class:`_Spec` per field: the wire key, whether it is required, the value
types taken as they are (the fast path: most fields of most messages are a scalar of the
declared type) and a checker for everything else, which converts or raises a
:class:`~natsched.wire.errors.SchemaError` naming the field. ``X | None`` and ``NewType`` of X are
checked as X (:func:`_unwrap`); an ``enum`` field takes only its members' values, decoded to
the member (:func:`_enum_check`); lists of ints, strs or floats (token ids) are checked in one pass.

The messages themselves are in :mod:`natsched.wire.schema`. Pure module: no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from natsched.wire import codec
from natsched.wire.errors import SchemaError

T = TypeVar("T", bound="Schema")


def wire(name: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A field whose wire key differs from its Python name (``class`` is a keyword)."""
    if default is dataclasses.MISSING and "default_factory" not in kw:
        return field(metadata={"wire": name}, **kw)
    return field(default=default, metadata={"wire": name}, **kw)


@dataclass(frozen=True)
class _Spec:
    name: str
    key: str
    required: bool
    check: Any  # callable(value, path) -> value
    exact: frozenset = frozenset()  # value types taken as they are, without calling ``check``
    nested: bool = False  # a Schema or a list of them: ``to_wire`` converts it


def _scalar_check(types_: tuple[type, ...], label: str):
    def check(value: Any, path: str) -> Any:
        if isinstance(value, bool) and bool not in types_:
            raise SchemaError(f"field '{path}' must be {label}, got bool", path)
        if not isinstance(value, types_):
            raise SchemaError(f"field '{path}' must be {label}, got {type(value).__name__}", path)
        return value

    return check


def _unwrap(tp: Any) -> Any:
    """The annotation a field's values are checked against: ``X | None`` and ``NewType`` of X are X."""
    while True:
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(inner) != 1:
                return tp  # a real union: any value goes (decoders of such fields check themselves)
            tp = inner[0]
        elif getattr(tp, "__supertype__", None) is not None:  # NewType
            tp = tp.__supertype__
        else:
            return tp


def _checker(tp: Any):
    """Build a validator for one annotation (Optional, list, dict, nested Schema, scalars)."""
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        item_check = _checker(item)

        def check_list(value: Any, path: str) -> Any:
            if not isinstance(value, (list, tuple)):
                raise SchemaError(f"field '{path}' must be a list, got {type(value).__name__}", path)
            if item in (int, str, float):  # fast path for token-id lists
                wanted = (int, float) if item is float else (item,)
                if not all(isinstance(x, wanted) and not isinstance(x, bool) for x in value):
                    raise SchemaError(f"field '{path}' must be a list of {item.__name__}", path)
                return list(value)
            return [item_check(x, f"{path}[{i}]") for i, x in enumerate(value)]

        return check_list
    if origin is dict:
        return _scalar_check((dict,), "a map")
    if isinstance(tp, type) and issubclass(tp, Schema):
        return lambda v, p: tp.from_wire(v, path=p)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_check(tp)
    if tp is float:
        return _scalar_check((int, float), "a number")
    if tp in (int, str, bool):
        return _scalar_check((tp,), {int: "an integer", str: "a string", bool: "a boolean"}[tp])
    if tp is bytes:
        return _scalar_check((bytes,), "bytes")
    return lambda v, p: v


def _enum_check(tp: type[enum.Enum]):
    """A value of a closed set (a status, a kind): decoded to its member, anything else refused.
    The wire carries the plain value (a ``StrEnum`` member is its string), so adding a member is a
    contract change: readers must know it before a writer sends it."""
    members = {m.value: m for m in tp}
    allowed = ", ".join(repr(v) for v in members)

    def check(value: Any, path: str) -> Any:
        member = members.get(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
        if member is None:
            raise SchemaError(f"field '{path}' must be one of {allowed}, got {value!r}", path)
        return member

    return check


def _exact_types(tp: Any) -> frozenset:
    """The value types a field of annotation ``tp`` accepts with no conversion and no further
    check (``type(v) in ...``: a bool is never taken for an int). Decoding takes these as they
    are, which is most fields of most messages; anything else goes through the field's checker,
    which converts or raises naming the field. Empty where every value needs the checker."""
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return frozenset((tp,))  # a member as it is; a decoded string goes through the check
    if tp is float:
        return frozenset((int, float))
    if tp in (int, str, bool, bytes):
        return frozenset((tp,))
    if typing.get_origin(tp) is dict:
        return frozenset((dict,))
    return frozenset()


def _is_nested(tp: Any) -> bool:
    """Could a value of this annotation hold a Schema (itself, in a list, or in a union)?"""
    if isinstance(tp, type) and issubclass(tp, Schema):
        return True
    return any(_is_nested(a) for a in typing.get_args(tp))


class Schema:
    """Base of every wire message: versioned, tolerant of unknown fields, strict on known ones."""

    _specs: ClassVar[tuple[_Spec, ...]]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._specs = ()  # filled lazily: type hints need the whole module defined

    @classmethod
    def _compile(cls) -> tuple[_Spec, ...]:
        if not cls.__dict__.get("_specs"):
            hints = typing.get_type_hints(cls)
            specs = []
            for f in dataclasses.fields(cls):  # type: ignore[arg-type]
                required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                tp = hints[f.name]
                specs.append(_Spec(f.name, f.metadata.get("wire", f.name), required, _checker(tp),
                                   _exact_types(tp), _is_nested(tp)))
            cls._specs = tuple(specs)
        return cls._specs

    @classmethod
    def from_wire(cls: type[T], data: Any, path: str = "") -> T:
        """Build from a decoded map; unknown keys are ignored, missing/mistyped ones raise."""
        if not isinstance(data, dict):
            raise SchemaError(f"{path or cls.__name__} must be a map, got {type(data).__name__}", path or None)
        kwargs = {}
        get = data.get
        for spec in cls._specs or cls._compile():
            value = get(spec.key)
            if value is None:
                if spec.required:
                    where = f"{path}.{spec.key}" if path else spec.key
                    raise SchemaError(f"missing required field '{where}' in {cls.__name__}", where)
                continue
            if type(value) in spec.exact:  # the common case: a scalar of the declared type
                kwargs[spec.name] = value
            else:
                kwargs[spec.name] = spec.check(value, f"{path}.{spec.key}" if path else spec.key)
        obj = cls(**kwargs)
        obj.__post_init_check__()
        return obj

    def __post_init_check__(self) -> None:
        """Cross-field checks after decoding; subclasses raise SchemaError."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        cls = type(self)
        for spec in cls._specs or cls._compile():
            value = getattr(self, spec.name)
            if value is None:
                continue
            if spec.nested:
                if isinstance(value, Schema):
                    value = value.to_wire()
                elif isinstance(value, list) and value and isinstance(value[0], Schema):
                    value = [v.to_wire() for v in value]
            out[spec.key] = value
        return out

    def encode(self) -> bytes:
        return codec.encode(self.to_wire())

    @classmethod
    def decode(cls: type[T], data: bytes, max_bytes: int = codec.MAX_MESSAGE_BYTES) -> T:
        return cls.from_wire(codec.decode(data, max_bytes))
