"""Admission, lease, dynamic-total and scaling settings without code: flags at start, KV live.

Every knob is a field of one of the settings dataclasses, named ``<group>.<field>``:

=========  =====================================================  ===========================
group      dataclass                                              e.g.
=========  =====================================================  ===========================
admission  :class:`natsched.admitter.policy.AdmissionSettings`      ``admission.aging_s=5``
dynamic    :class:`natsched.admitter.dynamic.DynamicTotalSettings`  ``dynamic.high=0.9``
scale      :class:`natsched.admitter.scaling.ScaleSettings`         ``scale.out_wait_s=3``
lease      the lease fields of ``AdmitterServiceSettings``        ``lease.missed=5``
=========  =====================================================  ===========================

Where they come from, later winning: the code defaults; ``natsched admitter --set K=V`` (and
``natsched up --set K=V``, passed to every admitter); the ``quotas`` bucket's ``setting.<group>.<field>``
entries (``natsched quota set --set K=V``, applied live by every admitter). A value is JSON
(``5``, ``0.3``, ``true``, ``["batch"]``, ``{"online": 2}``) of the field's type, checked by the dataclass itself:
a bad one is refused with the reason and changes nothing (the CLI writes nothing; an admitter
keeps what it ran with and logs it). Pure module: no I/O.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

import orjson

from natsched.admitter.dynamic import DynamicTotalSettings
from natsched.admitter.errors import SettingsError
from natsched.admitter.policy import AdmissionSettings
from natsched.admitter.scaling import ScaleSettings
from natsched.wire import subjects as S

#: admission fields that are structure, not knobs (the class set and its order are the wire's)
_FIXED = {"classes", "class_rank"}


@dataclass
class LeaseSettings:
    """The lease and reconciliation knobs of ``AdmitterServiceSettings`` (same meaning)."""

    missed: int = 3  # heartbeats a worker may miss before its reservations are reclaimed
    rescue_grace_s: float = 10.0  # 0: workers not heard from are judged at once
    reconcile_interval_s: float = 10.0
    orphan_after_s: float = 120.0
    model_memory_s: float = 60.0

    def __post_init__(self) -> None:
        if type(self.missed) is not int or self.missed < 1:
            raise SettingsError(f"lease missed must be an integer >= 1, got {self.missed!r}")
        for name in ("rescue_grace_s", "reconcile_interval_s", "orphan_after_s", "model_memory_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name != "rescue_grace_s"):
                raise SettingsError(f"lease {name} must be > 0{' (or 0)' if name == 'rescue_grace_s' else ''}, "
                                    f"got {value!r}")


def _check_dynamic(d: DynamicTotalSettings) -> None:
    if not (math.isfinite(d.interval_s) and d.interval_s > 0):
        raise SettingsError(f"dynamic interval_s must be > 0, got {d.interval_s!r}")
    if not 0 < d.low < d.high:
        raise SettingsError(f"dynamic watermarks need 0 < low < high, got low {d.low!r}, high {d.high!r}")
    if not 0 < d.tighten <= 1 or d.loosen < 1:
        raise SettingsError(f"dynamic tighten must be within (0, 1] and loosen >= 1, got {d.tighten!r}, {d.loosen!r}")
    if not 0 < d.min_factor <= 1 <= d.max_factor:
        raise SettingsError(f"dynamic factors need 0 < min_factor <= 1 <= max_factor, got "
                            f"{d.min_factor!r}, {d.max_factor!r}")
    if not (math.isfinite(d.factor_bound) and d.factor_bound >= d.max_factor):
        raise SettingsError(f"dynamic factor_bound must be >= max_factor, got {d.factor_bound!r}")
    if not (math.isfinite(d.share_half_life_s) and d.share_half_life_s > 0):
        raise SettingsError(f"dynamic share_half_life_s must be > 0, got {d.share_half_life_s!r}")


@dataclass
class Knobs:
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    dynamic: DynamicTotalSettings = field(default_factory=DynamicTotalSettings)
    scale: ScaleSettings = field(default_factory=ScaleSettings)
    lease: LeaseSettings = field(default_factory=LeaseSettings)


GROUPS = ("admission", "dynamic", "scale", "lease")


def names() -> list[str]:
    """Every knob, ``group.field``, in a stable order (for help texts and errors)."""
    out = []
    for group in GROUPS:
        out += [f"{group}.{f.name}" for f in fields(getattr(Knobs(), group)) if f.name not in _FIXED]
    return out


def _field_type(group: str, name: str) -> Any:
    cls = type(getattr(Knobs(), group))
    return typing.get_type_hints(cls)[name]


def _coerce(key: str, value: Any, kind: Any) -> Any:
    """``value`` (from JSON) as the field's type, or SettingsError."""
    origin = typing.get_origin(kind)
    if kind is bool:
        if type(value) is not bool:
            raise SettingsError(f"{key} must be true or false, got {value!r}")
        return value
    if kind is int:
        if type(value) is not int:
            raise SettingsError(f"{key} must be an integer, got {value!r}")
        return value
    if kind is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise SettingsError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SettingsError(f"{key} must be a list of strings, got {value!r}")
        return tuple(value)
    if origin is dict:  # per class (admission.slo_ttft_s): {"online": 2.0}
        return _per_class(key, value)
    raise SettingsError(f"{key} cannot be set")


def _per_class(key: str, value: Any) -> dict[str, float]:
    """A JSON object of request class -> finite number (the dataclass checks the range)."""
    if not isinstance(value, dict):
        raise SettingsError(f"{key} must be a JSON object of class -> seconds, e.g. {{\"online\": 2}}, got {value!r}")
    unknown = sorted(set(value) - set(S.CLASSES))
    if unknown:
        raise SettingsError(f"{key} names unknown classes {unknown}; known: {', '.join(S.CLASSES)}")
    for cls, v in value.items():
        if type(v) not in (int, float) or not math.isfinite(v):
            raise SettingsError(f"{key}[{cls!r}] must be a finite number of seconds, got {v!r}")
    return {cls: float(v) for cls, v in value.items()}


def split(key: str) -> tuple[str, str]:
    """``group.field`` checked against the knobs; SettingsError naming the known ones."""
    group, _, name = key.partition(".")
    if group not in GROUPS or name in _FIXED or name not in {f.name for f in fields(getattr(Knobs(), group))}:
        raise SettingsError(f"unknown setting {key!r}; known: {', '.join(names())}")
    return group, name


def parse_assignment(text: str) -> tuple[str, Any]:
    """``group.field=JSON`` from a flag: (key, value); SettingsError when malformed."""
    key, sep, raw = text.partition("=")
    if not sep:
        raise SettingsError(f"--set wants KEY=VALUE, got {text!r}")
    split(key.strip())
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw  # a bare word: a string (then refused by any non-string field)
    return key.strip(), value


def apply(base: Knobs, overrides: Mapping[str, Any]) -> Knobs:
    """``base`` with ``overrides`` ({"group.field": value}); SettingsError, nothing changed, on
    any bad key or value (each dataclass checks its own combination)."""
    changes: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        group, name = split(key)
        changes.setdefault(group, {})[name] = _coerce(key, value, _field_type(group, name))
    out = replace(base)
    for group, values in changes.items():
        try:
            updated = replace(getattr(base, group), **values)
        except (TypeError, ValueError) as exc:
            text = str(exc)
            raise SettingsError(text if text.startswith(group) else f"{group}.{text}") from None
        if group == "dynamic":
            _check_dynamic(updated)
        setattr(out, group, updated)
    return out


def from_kv(entries: Mapping[str, bytes]) -> tuple[dict[str, Any], list[str]]:
    """The ``setting.*`` entries of the quotas bucket as overrides, plus the problems of those
    that cannot be read (skipped: the caller keeps what it had for them)."""
    out, errors = {}, []
    for key, raw in sorted(entries.items()):
        if not key.startswith(S.SETTING_PREFIX):
            continue
        name = key[len(S.SETTING_PREFIX):]
        try:
            split(name)
            out[name] = orjson.loads(raw)
        except (SettingsError, orjson.JSONDecodeError) as exc:
            errors.append(f"{key}: {exc}")
    return out, errors


def resolve(base: Knobs, entries: Mapping[str, bytes], previous: Knobs | None = None) -> tuple[Knobs, list[str]]:
    """``base`` with the bucket's settings. An entry that is unreadable or bad keeps the value in
    force before (``previous``'s; the start value without one), and is described, so one bad
    write cannot undo the good ones."""
    overrides, errors = from_kv(entries)
    bad = {e.split(":", 1)[0][len(S.SETTING_PREFIX):] for e in errors}
    if not bad:
        try:
            return apply(base, overrides), errors
        except SettingsError:
            pass
    kept = flat(previous) if previous is not None else {}
    good: dict[str, Any] = {}
    for key, value in overrides.items():
        try:
            apply(base, {**good, key: value})
            good[key] = value
        except SettingsError as exc:
            errors.append(f"{S.SETTING_PREFIX}{key}: {exc}")
            bad.add(key)
    for key in bad & kept.keys():
        good.setdefault(key, kept[key])
    try:
        return apply(base, good), errors
    except SettingsError:  # the kept values do not combine with the new good ones: those alone
        return apply(base, {k: v for k, v in good.items() if k not in bad}), errors


def to_kv(overrides: Mapping[str, Any]) -> dict[str, bytes]:
    return {S.setting_key(*split(k)): orjson.dumps(v) for k, v in overrides.items()}


def flat(knobs: Knobs) -> dict[str, Any]:
    """Every knob's value, ``group.field`` -> value (``quota show``)."""
    out = {}
    for key in names():
        group, name = key.split(".", 1)
        value = getattr(getattr(knobs, group), name)
        out[key] = list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, dict) else value
    return out
