"""Quotas: what each tenant, model and class may hold, and how they live in the ``quotas`` KV bucket.

Units are *runtime tokens* (ARCHITECTURE.md). Per tenant:

- ``floor``: a guaranteed share of the cluster total (0..1). Floors of all tenants (plus the
  default tenant's, counted once) may not sum over 1.0, so every floor can be honoured at once.
- ``weight``: the tenant's share of *idle* capacity (beyond the floors), relative to the other
  tenants that are asking for more at the same time.
- ``cap``: an absolute hard limit in runtime tokens (None: none).

KV layout (one entry per key, JSON values; :meth:`Quotas.to_kv` / :meth:`Quotas.from_kv`)::

    cluster.total        400000
    cluster.hard_cap     null | 800000
    tenant.<t>           {"floor": 0.5, "weight": 1.0, "cap": null}
    model.<m>            200000
    class.<c>.queue      1000
    class.<c>.limit      300000   (runtime tokens all requests of the class hold together; natsched.admitter.classes)
    default.tenant       {"floor": 0.0, "weight": 1.0, "cap": null}
    unknown_tenant       "default" | "reject"

``from_kv`` gets the bucket's whole content. A corrupted entry is skipped and its previous value
kept (or the default, when there is none), and described in the returned error list, so the
service can log and count it. A floor edit that would push the floors over 100 % is refused the
same way: the previous floor stays. Pure module: no I/O.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from natsched.admitter.errors import QuotaError
from natsched.wire import subjects as S

log = logging.getLogger(__name__)

UNKNOWN_DEFAULT, UNKNOWN_REJECT = "default", "reject"
FLOOR_EPSILON = 1e-9  # floors are floats: 0.1 + 0.2 + 0.7 must pass
KEY_TOTAL, KEY_HARD_CAP = "cluster.total", "cluster.hard_cap"
KEY_DEFAULT_TENANT, KEY_UNKNOWN = "default.tenant", "unknown_tenant"
#: keys other writers keep in the bucket; from_kv leaves them alone
FOREIGN_KEYS = frozenset({S.KEY_DYNAMIC_TOTAL, S.KEY_QUOTA_CHANGE})


def _default_queue_limits() -> dict[str, int]:
    return {S.ONLINE: 1000, S.BATCH: 10000}


@dataclass
class TenantQuota:
    floor: float = 0.0  # guaranteed share of the total, 0..1
    weight: float = 1.0  # elastic share of idle capacity
    cap: int | None = None  # absolute hard cap in runtime tokens

    def check(self, who: str) -> None:
        if not _is_number(self.floor) or not 0.0 <= self.floor <= 1.0:
            raise QuotaError(f"{who}: floor must be a share between 0 and 1, got {self.floor!r}")
        if not _is_number(self.weight) or self.weight < 0:
            raise QuotaError(f"{who}: weight must be a number >= 0, got {self.weight!r}")
        if self.cap is not None and (not _is_int(self.cap) or self.cap < 0):
            raise QuotaError(f"{who}: cap must be an integer >= 0 runtime tokens (or null), got {self.cap!r}")

    def to_json(self) -> bytes:
        return orjson.dumps({"floor": self.floor, "weight": self.weight, "cap": self.cap}, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes, who: str) -> "TenantQuota":
        data = _loads(raw, who)
        if not isinstance(data, dict):
            raise QuotaError(f"{who}: must be an object like {{\"floor\": 0.2, \"weight\": 1, \"cap\": null}}")
        unknown = sorted(set(data) - {"floor", "weight", "cap"})
        if unknown:
            raise QuotaError(f"{who}: unknown field(s) {', '.join(unknown)}")
        quota = cls(floor=data.get("floor", 0.0), weight=data.get("weight", 1.0), cap=data.get("cap"))
        quota.check(who)
        return quota


@dataclass
class Quotas:
    total: int = 400_000  # cluster total (runtime tokens)
    hard_cap: int | None = None  # the dynamic total never goes above it
    tenants: dict[str, TenantQuota] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)  # per-model runtime-token limit
    queue_limits: dict[str, int] = field(default_factory=_default_queue_limits)  # per class, max queued
    class_limits: dict[str, int] = field(default_factory=dict)  # per class, runtime tokens held (none: no limit)
    unknown_tenant: str = UNKNOWN_DEFAULT  # "default": default_tenant applies; "reject": reason unknown_tenant
    default_tenant: TenantQuota = field(default_factory=TenantQuota)

    # ------------------------------------------------------------------ lookups
    def tenant_quota(self, tenant: str) -> TenantQuota | None:
        """The tenant's quota; the default one for unknown tenants, or None when they are rejected."""
        quota = self.tenants.get(tenant)
        if quota is not None:
            return quota
        return self.default_tenant if self.unknown_tenant == UNKNOWN_DEFAULT else None

    def model_limit(self, model: str) -> int | None:
        return self.models.get(model)

    def queue_limit(self, cls: str) -> int:
        return self.queue_limits.get(cls, 0)

    def class_limit(self, cls: str) -> int | None:
        return self.class_limits.get(cls)

    def ceiling(self) -> int:
        """The configured total, never above the hard cap."""
        return self.total if self.hard_cap is None else min(self.total, self.hard_cap)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`QuotaError` with a message naming the bad value; return None when usable."""
        if not _is_int(self.total) or self.total < 0:
            raise QuotaError(f"cluster total must be an integer >= 0 runtime tokens, got {self.total!r}")
        if self.hard_cap is not None and (not _is_int(self.hard_cap) or self.hard_cap < 0):
            raise QuotaError(f"cluster hard cap must be an integer >= 0 runtime tokens (or null), "
                             f"got {self.hard_cap!r}")
        if self.unknown_tenant not in (UNKNOWN_DEFAULT, UNKNOWN_REJECT):
            raise QuotaError(f"unknown_tenant must be 'default' or 'reject', got {self.unknown_tenant!r}")
        self.default_tenant.check("default tenant")
        for name, quota in self.tenants.items():
            _check_token(name, "tenant")
            quota.check(f"tenant {name!r}")
        for name, limit in self.models.items():
            if not _is_int(limit) or limit < 0:
                raise QuotaError(f"model {name!r}: limit must be an integer >= 0 runtime tokens, got {limit!r}")
        for cls, limit in self.queue_limits.items():
            if cls not in S.CLASSES:
                raise QuotaError(f"queue limit for unknown class {cls!r}; classes: {', '.join(S.CLASSES)}")
            if not _is_int(limit) or limit < 0:
                raise QuotaError(f"class {cls!r}: queue limit must be an integer >= 0, got {limit!r}")
        for cls, limit in self.class_limits.items():
            if cls not in S.CLASSES:
                raise QuotaError(f"class limit for unknown class {cls!r}; classes: {', '.join(S.CLASSES)}")
            if not _is_int(limit) or limit < 0:
                raise QuotaError(f"class {cls!r}: limit must be an integer >= 0 runtime tokens, got {limit!r}")
        floors = self.floor_sum()
        if floors > 1.0 + FLOOR_EPSILON:
            raise QuotaError(f"tenant floors sum to {floors:.3f} (> 1.0: they could not all be guaranteed at once); "
                             f"{self._floor_list()}")

    def floor_sum(self) -> float:
        """Floors of every tenant, plus the default tenant's once when unknown tenants are let in."""
        extra = self.default_tenant.floor if self.unknown_tenant == UNKNOWN_DEFAULT else 0.0
        return sum(q.floor for q in self.tenants.values()) + extra

    def _floor_list(self) -> str:
        parts = [f"{n}={q.floor:g}" for n, q in sorted(self.tenants.items()) if q.floor]
        if self.unknown_tenant == UNKNOWN_DEFAULT and self.default_tenant.floor:
            parts.append(f"(default)={self.default_tenant.floor:g}")
        return "floors: " + (", ".join(parts) or "none")

    # ------------------------------------------------------------------ KV
    def to_kv(self) -> dict[str, bytes]:
        """Every entry of the bucket, deterministic bytes (equal quotas give equal values)."""
        out = {KEY_TOTAL: orjson.dumps(self.total), KEY_HARD_CAP: orjson.dumps(self.hard_cap),
               KEY_DEFAULT_TENANT: self.default_tenant.to_json(), KEY_UNKNOWN: orjson.dumps(self.unknown_tenant)}
        for name, quota in sorted(self.tenants.items()):
            out[f"tenant.{name}"] = quota.to_json()
        for name, limit in sorted(self.models.items()):
            out[f"model.{name}"] = orjson.dumps(limit)
        for cls, limit in sorted(self.queue_limits.items()):
            out[f"class.{cls}.queue"] = orjson.dumps(limit)
        for cls, limit in sorted(self.class_limits.items()):
            out[f"class.{cls}.limit"] = orjson.dumps(limit)
        return out

    @classmethod
    def from_kv(cls, entries: dict[str, bytes], previous: "Quotas | None" = None) -> tuple["Quotas", list[str]]:
        """Quotas from the bucket's whole content, plus a description of every entry not used."""
        return _KvReader(entries, previous).read()


class _KvReader:
    """One pass of :meth:`Quotas.from_kv`; keeps the previous value of every entry it rejects."""

    def __init__(self, entries: dict[str, bytes], previous: Quotas | None) -> None:
        self.entries = entries
        self.previous = previous
        self.errors: list[str] = []
        self.quotas = Quotas(tenants={}, models={})

    def read(self) -> tuple[Quotas, list[str]]:
        for key in sorted(self.entries):
            if key in FOREIGN_KEYS or key.startswith(S.SETTING_PREFIX):
                continue  # (settings: natsched.admitter.knobs)
            try:
                known = self._entry(key, self.entries[key])
            except QuotaError as exc:
                self.errors.append(f"{key}: {exc} (previous value kept)")
                self._keep_previous(key)
                continue
            if not known:
                self.errors.append(f"{key}: unknown quota key, ignored")
        self._refuse_floor_overflow()
        try:
            self.quotas.validate()
        except QuotaError as exc:
            self.errors.append(str(exc))
        return self.quotas, self.errors

    def _entry(self, key: str, raw: bytes) -> bool:
        """Apply one entry; False when the key is not a quota key at all."""
        q = self.quotas
        if key == KEY_TOTAL:
            q.total = _int(raw, key)
        elif key == KEY_HARD_CAP:
            q.hard_cap = _int(raw, key, nullable=True)
        elif key == KEY_DEFAULT_TENANT:
            q.default_tenant = TenantQuota.from_json(raw, key)
        elif key == KEY_UNKNOWN:
            value = _loads(raw, key)
            if value not in (UNKNOWN_DEFAULT, UNKNOWN_REJECT):
                raise QuotaError(f"must be \"default\" or \"reject\", got {value!r}")
            q.unknown_tenant = value
        elif key.startswith("tenant."):
            name = _check_token(key[len("tenant."):], "tenant")
            q.tenants[name] = TenantQuota.from_json(raw, key)
        elif key.startswith("model."):
            q.models[_check_token(key[len("model."):], "model")] = _int(raw, key)
        elif key.startswith("class.") and key.endswith(".queue"):
            name = key[len("class."):-len(".queue")]
            if name not in S.CLASSES:
                raise QuotaError(f"unknown class {name!r}; classes: {', '.join(S.CLASSES)}")
            q.queue_limits[name] = _int(raw, key)
        elif key.startswith("class.") and key.endswith(".limit"):
            q.class_limits[_class_name(key, ".limit")] = _int(raw, key)
        else:
            return False
        return True

    def _keep_previous(self, key: str) -> None:
        prev, q = self.previous, self.quotas
        if prev is None:
            return
        if key == KEY_TOTAL:
            q.total = prev.total
        elif key == KEY_HARD_CAP:
            q.hard_cap = prev.hard_cap
        elif key == KEY_DEFAULT_TENANT:
            q.default_tenant = replace(prev.default_tenant)
        elif key == KEY_UNKNOWN:
            q.unknown_tenant = prev.unknown_tenant
        elif key.startswith("tenant.") and key[len("tenant."):] in prev.tenants:
            q.tenants[key[len("tenant."):]] = replace(prev.tenants[key[len("tenant."):]])
        elif key.startswith("model.") and key[len("model."):] in prev.models:
            q.models[key[len("model."):]] = prev.models[key[len("model."):]]
        elif key.startswith("class.") and key.endswith(".queue"):
            name = key[len("class."):-len(".queue")]
            if name in prev.queue_limits:
                q.queue_limits[name] = prev.queue_limits[name]
        elif key.startswith("class.") and key.endswith(".limit"):
            name = key[len("class."):-len(".limit")]
            if name in prev.class_limits:
                q.class_limits[name] = prev.class_limits[name]

    def _refuse_floor_overflow(self) -> None:
        """Floors over 100 %: undo the floor edits (new or changed since ``previous``), one by one."""
        q, prev = self.quotas, self.previous
        if prev is None or q.floor_sum() <= 1.0 + FLOOR_EPSILON:
            return
        before = q.floor_sum()
        for name in sorted(q.tenants):
            if q.floor_sum() <= 1.0 + FLOOR_EPSILON:
                break
            old = prev.tenants.get(name)
            if old is not None and old.floor == q.tenants[name].floor:
                continue
            q.tenants[name].floor = old.floor if old is not None else 0.0
            self.errors.append(f"tenant.{name}: floor edit refused: floors would sum to {before:.3f} > 1.0 "
                               f"(floor kept at {q.tenants[name].floor:g})")
        if q.default_tenant.floor != prev.default_tenant.floor and q.floor_sum() > 1.0 + FLOOR_EPSILON:
            q.default_tenant.floor = prev.default_tenant.floor
            self.errors.append(f"{KEY_DEFAULT_TENANT}: floor edit refused: floors would sum over 1.0")


# ---------------------------------------------------------------------- value helpers

def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _loads(raw: bytes, key: str) -> Any:
    try:
        return orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        raise QuotaError(f"value {bytes(raw[:40])!r} is not JSON") from None


def _int(raw: bytes, key: str, nullable: bool = False) -> int | None:
    value = _loads(raw, key)
    if value is None and nullable:
        return None
    if not _is_int(value) or value < 0:
        raise QuotaError(f"must be an integer >= 0{' or null' if nullable else ''}, got {value!r}")
    return value


def _class_name(key: str, suffix: str) -> str:
    name = key[len("class."):-len(suffix)]
    if name not in S.CLASSES:
        raise QuotaError(f"unknown class {name!r}; classes: {', '.join(S.CLASSES)}")
    return name


def _check_token(name: str, what: str) -> str:
    try:
        return S.token(name, what)
    except ValueError as exc:
        raise QuotaError(str(exc)) from None
