"""The shared in-flight aggregate: runtime tokens reserved, in total, per tenant, per model, and
how many of them are held by *long* requests (the long reserve needs that; pass ``long=True`` to
:meth:`Usage.plus` / :meth:`Usage.minus` for requests whose cost reaches the long threshold —
``AdmitterCore.is_long(tokens)``).

Every admitter replica decides against the same :class:`Usage`, which the service keeps in the
``inflight`` KV bucket and changes only by compare-and-swap. It is a *value*: :meth:`Usage.plus`
and :meth:`Usage.minus` return a new object, so a decision evaluated on one revision can be
retried on the next without undoing anything. Keys whose count falls to zero are dropped, so
two usages that describe the same reservations compare (and serialise) equal.

Pure module: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from admitter.errors import UsageError


@dataclass
class Usage:
    used: int = 0
    tenants: dict[str, int] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)
    long: int = 0  # part of ``used`` held by long requests

    def tenant(self, tenant: str) -> int:
        return self.tenants.get(tenant, 0)

    def model(self, model: str) -> int:
        return self.models.get(model, 0)

    def plus(self, tenant: str, model: str, tokens: int, long: bool = False) -> "Usage":
        """A new usage with ``tokens`` more reserved for ``tenant`` / ``model`` (by a long request)."""
        if tokens < 0:
            raise ValueError(f"cannot reserve a negative number of runtime tokens ({tokens}); use minus()")
        return Usage(self.used + tokens, _add(self.tenants, tenant, tokens), _add(self.models, model, tokens),
                     self.long + (tokens if long else 0))

    def minus(self, tenant: str, model: str, tokens: int, long: bool = False) -> "Usage":
        """A new usage with ``tokens`` released; every count clamps at 0 (a release may be late)."""
        tokens = max(0, tokens)
        return Usage(max(0, self.used - tokens), _add(self.tenants, tenant, -tokens),
                     _add(self.models, model, -tokens), max(0, self.long - tokens) if long else self.long)

    def to_json(self) -> bytes:
        return orjson.dumps({"used": self.used, "tenants": self.tenants, "models": self.models, "long": self.long},
                            option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes) -> "Usage":
        """Decode; anything that is not a usage raises :class:`UsageError` naming what is wrong."""
        try:
            data = orjson.loads(raw)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise UsageError(f"usage is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise UsageError(f"usage must be a JSON object, got {type(data).__name__}")
        used = _count(data.get("used", 0), "used")
        tenants = _counts(data.get("tenants", {}), "tenants")
        models = _counts(data.get("models", {}), "models")
        return cls(used, tenants, models, _count(data.get("long", 0), "long"))


def _add(counts: dict[str, int], key: str, delta: int) -> dict[str, int]:
    out = dict(counts)
    value = out.get(key, 0) + delta
    if value > 0:
        out[key] = value
    else:
        out.pop(key, None)
    return out


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"usage field '{where}' must be a non-negative integer, got {value!r}")
    return value


def _counts(value: Any, where: str) -> dict[str, int]:
    if not isinstance(value, dict):
        raise UsageError(f"usage field '{where}' must be an object, got {type(value).__name__}")
    return {str(k): _count(v, f"{where}.{k}") for k, v in value.items() if v != 0}
