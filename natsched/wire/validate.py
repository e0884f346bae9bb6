"""The validation engine under every wire message: a dataclass's annotations, decoded by msgspec.

:class:`Schema` compiles each message class once (lazily: type hints need the whole module
defined) into a msgspec ``Struct`` with the same fields, wire names and defaults
(:func:`_struct_for`). msgspec decodes msgpack straight into it in C and checks every type on the
way: strict (a bool is never an int, a string never a number), an ``enum`` field takes only its
members' values, unknown fields are ignored. The struct then becomes the dataclass the services
use (:meth:`Schema._from_struct`) and the message's own cross-field checks run
(``__post_init_check__``: ids, bounds). ``natsched bench codec`` measured it 2-3.5x faster than
the hand-written checks it replaces, on the same bytes with the same refusals.

Refusals keep their old words: a msgspec error only says where it happened (``$.request.class``),
so :func:`_explain` walks the annotations and the offending value to that place and raises the
:class:`~natsched.wire.errors.SchemaError` naming the field, as before. That runs only for a
message being refused. Two things msgspec refuses that the contract accepts are repaired there and
the message decoded again: a nil for a field with a default (read as absent) and a non-string key
(an unknown field). ``X | None`` and ``NewType`` of X are checked as X (:func:`_unwrap`); a number
field keeps an int as an int.

The messages themselves are in :mod:`natsched.wire.schema`. Pure module: no I/O.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypeVar

import msgspec

from natsched.wire import codec
from natsched.wire.errors import DecodeError, SchemaError

T = TypeVar("T", bound="Schema")

#: a message refused this many times over while being repaired (nils, non-string keys) is refused
_MAX_REPAIRS = 64


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
    tp: Any  # the annotation, as written
    nested: bool = False  # a Schema or a list of them: ``to_wire`` converts it


def bounded(tp: type, lo: int, hi: int, what: str) -> Any:
    """``tp`` within ``lo..hi``, checked by msgspec as it decodes (in C: a list of 4k token ids
    costs no Python loop); a value outside is refused as "field 'x' holds {what} outside lo..hi"."""
    return typing.Annotated[tp, msgspec.Meta(ge=lo, le=hi, description=what)]


def _bounds(tp: Any) -> msgspec.Meta | None:
    if typing.get_origin(tp) is typing.Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, msgspec.Meta)), None)
    return None


def _unwrap(tp: Any) -> Any:
    """The annotation a field's values are checked against: ``X | None``, ``NewType`` of X and
    :func:`bounded` X are X."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = tp.__origin__
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(inner) != 1:
                return tp  # a real union: any value goes (decoders of such fields check themselves)
            tp = inner[0]
        elif getattr(tp, "__supertype__", None) is not None:  # NewType
            tp = tp.__supertype__
        else:
            return tp


def _is_schema(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Schema)


def _is_nested(tp: Any) -> bool:
    """Could a value of this annotation hold a Schema (itself, in a list, or in a union)?"""
    return _is_schema(tp) or any(_is_nested(a) for a in typing.get_args(tp))


def _hint(tp: Any) -> Any:
    """The msgspec type of one annotation: what the hand-written checks took, no more, no less."""
    if _bounds(tp) is not None:
        return tp
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return list[_hint(item)]
    if tp is dict or origin is dict:
        return dict  # any map: the message's own check looks inside it where it matters
    if _is_schema(tp):
        return tp._engine().struct
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if tp is float:
        return int | float  # an int stays an int (the wire does not say which the writer meant)
    if tp in (int, str, bool, bytes):
        return tp
    return Any


def _struct_for(cls: type, specs: tuple[_Spec, ...]) -> type:
    """A msgspec struct with the dataclass's fields, wire names and defaults. A field with a
    default takes a nil too (``X | None``) only where the dataclass says ``X | None``; any other
    nil is repaired in :func:`_explain`, so the fast path fills no defaults in Python."""
    fields = []
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for spec in specs:
        f, tp = by_name[spec.name], _hint(spec.tp)
        if spec.required:
            fields.append((spec.name, tp, msgspec.field(name=spec.key)))
            continue
        if f.default is None:
            tp = tp | None if tp is not Any else Any
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            fields.append((spec.name, tp, msgspec.field(name=spec.key, default_factory=f.default_factory)))
        else:
            fields.append((spec.name, tp, msgspec.field(name=spec.key, default=f.default)))
    return msgspec.defstruct(f"{cls.__name__}Wire", fields, kw_only=True, gc=False)


@dataclass(frozen=True)
class _Engine:
    struct: type
    decoder: msgspec.msgpack.Decoder
    nested: tuple[tuple[str, Callable[[Any], Any]], ...]  # field name -> struct-to-dataclass
    direct: bool  # instances are built without ``__init__`` (no ``__post_init__``, no slots)


class Schema:
    """Base of every wire message: versioned, tolerant of unknown fields, strict on known ones."""

    _specs: ClassVar[tuple[_Spec, ...]]
    _wire: ClassVar[_Engine | None]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._specs = ()  # filled lazily: type hints need the whole module defined
        cls._wire = None

    @classmethod
    def _compile(cls) -> tuple[_Spec, ...]:
        if not cls.__dict__.get("_specs"):
            hints = typing.get_type_hints(cls, include_extras=True)
            cls._specs = tuple(
                _Spec(f.name, f.metadata.get("wire", f.name),
                      f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, hints[f.name],
                      _is_nested(hints[f.name]))
                for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        return cls._specs

    @classmethod
    def _engine(cls) -> _Engine:
        engine = cls.__dict__.get("_wire")
        if engine is None:
            specs = cls._compile()
            struct = _struct_for(cls, specs)
            nested = tuple((s.name, _converter(s.tp)) for s in specs if _converter(s.tp) is not None)
            direct = not hasattr(cls, "__post_init__") and "__slots__" not in cls.__dict__
            engine = cls._wire = _Engine(struct, msgspec.msgpack.Decoder(struct), nested, direct)
        return engine

    @classmethod
    def _from_struct(cls: type[T], struct: Any) -> T:
        """The dataclass for a decoded struct (nested messages too), after its own checks. The
        fields are all there and checked, so the instance is built without calling ``__init__``
        (unless the class has a ``__post_init__`` or slots)."""
        engine = cls._wire or cls._engine()
        values = msgspec.structs.asdict(struct)
        for name, convert in engine.nested:
            value = values[name]
            if value is not None:
                values[name] = convert(value)
        if engine.direct:
            obj = object.__new__(cls)
            obj.__dict__ = values
        else:
            obj = cls(**values)
        obj.__post_init_check__()
        return obj

    @classmethod
    def from_wire(cls: type[T], data: Any, path: str = "") -> T:
        """Build from a decoded map; unknown keys are ignored, missing/mistyped ones raise."""
        if not isinstance(data, dict):
            raise SchemaError(f"{path or cls.__name__} must be a map, got {type(data).__name__}", path or None)
        engine = cls._wire or cls._engine()
        try:
            struct = msgspec.convert(data, engine.struct)
        except msgspec.ValidationError as exc:
            struct = _explain(cls, copy.deepcopy(data), exc, path)
        except RecursionError:
            raise SchemaError(f"{path or cls.__name__} is nested too deeply", path or None) from None
        return cls._from_struct(struct)

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
        return _encode(self.to_wire())

    @classmethod
    def decode(cls: type[T], data: bytes, max_bytes: int = codec.MAX_MESSAGE_BYTES) -> T:
        """Decode and check one message, or raise :class:`DecodeError` / :class:`SchemaError`."""
        if len(data) > max_bytes:
            raise DecodeError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
        if not data:
            raise DecodeError("empty message")
        engine = cls._wire or cls._engine()
        try:
            struct = engine.decoder.decode(data)
        except msgspec.ValidationError as exc:
            struct = _explain(cls, _plain(data), exc, "")
        except msgspec.DecodeError as exc:
            raise DecodeError(f"not valid msgpack: {exc}") from None
        except RecursionError:
            raise DecodeError("not valid msgpack: nested too deeply") from None
        return cls._from_struct(struct)


_encode = msgspec.msgpack.Encoder().encode


def _converter(tp: Any) -> Callable[[Any], Any] | None:
    """How a decoded value of this annotation becomes the dataclass's: a nested message (or a
    list of them) from its struct; None where the value is used as msgspec decoded it."""
    tp = _unwrap(tp)
    if _is_schema(tp):
        return tp._from_struct
    if typing.get_origin(tp) is list:
        inner = _converter((typing.get_args(tp) or (Any,))[0])
        if inner is not None:
            return lambda items: [inner(x) for x in items]
    return None


def _plain(data: bytes) -> Any:
    """The message as plain maps and lists, to explain a refusal (the typed decode stopped at it)."""
    try:
        obj = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not valid msgpack: {exc}") from None
    except RecursionError:
        raise DecodeError("not valid msgpack: nested too deeply") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"expected a map, got {type(obj).__name__}")
    return obj


_AT = re.compile(r"^(?P<what>.*?)(?: - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]*)`")


def _explain(cls: type[Schema], data: dict, exc: msgspec.ValidationError, prefix: str) -> Any:
    """Why msgspec refused ``data`` as a ``cls``, as the :class:`SchemaError` naming the field; or,
    where the contract accepts what msgspec refused (a nil for a defaulted field, a non-string
    key), the struct of the repaired message. ``data`` is a copy: it is repaired in place."""
    for _ in range(_MAX_REPAIRS):
        m = _AT.match(str(exc))
        steps = [k if k else int(i) for k, i in _STEP.findall(m["path"] or "")]
        node, parent, value, holder = _walk(cls, steps, data)
        if m["key"] is not None and isinstance(value, dict):  # a non-string key: an unknown field
            for k in [k for k in value if not isinstance(k, str)]:
                del value[k]
        elif value is None and steps and isinstance(steps[-1], str) and isinstance(holder, dict):
            del holder[steps[-1]]  # nil: as if absent (a required field is then named missing)
        else:
            raise _refusal(m["what"], steps, node, parent, value, prefix)
        try:
            return msgspec.convert(data, cls._engine().struct)
        except msgspec.ValidationError as again:
            exc = again
    raise SchemaError(f"{cls.__name__}: too many nil fields or non-string keys", prefix or None)


def _walk(cls: type[Schema], steps: list, data: Any) -> tuple[Any, Any, Any, Any]:
    """Follow a msgspec path: (the annotation there, its parent's, the value there, its holder)."""
    node, parent, value, holder = cls, None, data, None
    for step in steps:
        parent, holder = node, value
        tp = _unwrap(node)
        if isinstance(step, str):
            spec = next((s for s in tp._compile() if s.key == step), None) if _is_schema(tp) else None
            node = spec.tp if spec else Any
            value = holder.get(step) if isinstance(holder, dict) else None
        else:
            node = (typing.get_args(tp) or (Any,))[0] if typing.get_origin(tp) is list else Any
            value = holder[step] if isinstance(holder, list) and step < len(holder) else None
    return node, parent, value, holder


_LABELS = {int: "an integer", str: "a string", bool: "a boolean", bytes: "bytes", float: "a number"}


def _where(prefix: str, steps: list) -> str:
    out = prefix
    for step in steps:
        out = f"{out}[{step}]" if isinstance(step, int) else (f"{out}.{step}" if out else step)
    return out


def _refusal(what: str, steps: list, node: Any, parent: Any, value: Any, prefix: str) -> SchemaError:
    """The old engine's words for one refusal at ``steps`` (see :func:`_explain`)."""
    missing = _MISSING.match(what)
    if missing:
        where = _where(prefix, [*steps, missing["name"]])
        return SchemaError(f"missing required field '{where}' in {_unwrap(node).__name__}", where)
    bounds = _bounds(node)
    if bounds is not None:  # a token id past the vocabulary: the list is named as a whole
        where = _where(prefix, steps[:-1] if steps and isinstance(steps[-1], int) else steps)
        if isinstance(value, int) and not isinstance(value, bool):
            return SchemaError(f"field '{where}' holds {bounds.description} outside {bounds.ge}..{bounds.le}", where)
    if steps and isinstance(steps[-1], int) and _unwrap(node) in (int, str, float):
        where = _where(prefix, steps[:-1])  # a list of scalars (token ids) is named as a whole
        return SchemaError(f"field '{where}' must be a list of {_unwrap(node).__name__}", where)
    where, tp, got = _where(prefix, steps), _unwrap(node), type(value).__name__
    if _is_schema(tp):
        return SchemaError(f"{where or tp.__name__} must be a map, got {got}", where or None)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        allowed = ", ".join(repr(m.value) for m in tp)
        return SchemaError(f"field '{where}' must be one of {allowed}, got {value!r}", where)
    if typing.get_origin(tp) is list:
        return SchemaError(f"field '{where}' must be a list, got {got}", where)
    if tp is dict or typing.get_origin(tp) is dict:
        return SchemaError(f"field '{where}' must be a map, got {got}", where)
    if tp in _LABELS:
        return SchemaError(f"field '{where}' must be {_LABELS[tp]}, got {got}", where)
    return SchemaError(f"field '{where}' is invalid: {what}", where or None)
