"""Router pools: which router pool routes a model's requests (issue 27).

A fleet of a thousand workers is routed by several routers, each scoring only its pool's tens of
workers with a prefix index of only their blocks. Nothing in ``req.<class>.<tenant>`` names the
model (a stream transform sees only the subject), so the admitter, which decodes the request,
names the pool: it publishes an admitted request on ``adm.<pool>.<class>.<tenant>``
(:func:`natsched.wire.subjects.admitted`) and router pool ``<pool>`` consumes ``adm.<pool>.>``.

The map lives in bucket ``config`` under ``pools`` (JSON ``{"<pool>": ["<model>", ...]}``), one
source of truth for the admitters (where to publish), the routers (which workers are theirs) and
the offline runner. A model may be ``*``: that pool takes every model no pool names. With no map
every model goes to :data:`natsched.wire.subjects.DEFAULT_POOL`, consumed by the plain ``router``
consumer: today's single-pool deployment. With a map, a model no pool names (and no ``*``) is
served by no router: the admitter refuses it at once (reason ``no_pool``) rather than storing it
where nobody consumes.

Pool names are operator-chosen subject tokens, checked like every id. A pool named after a model
(``natsched up --router-pools 'Qwen/Qwen2.5-0.5B'``, no ``=``) gets :func:`pool_name` of it: a
hostile model name (``a.b``, ``*``, ``>``, a space) becomes one token and can never add a subject
token or a wildcard. Pure module: no I/O.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import orjson

from natsched.wire import subjects as S
from natsched.wire.errors import WireError
from natsched.wire.ids import MAX_LEN, is_token

#: a pool's model list entry that takes every model no pool names
ANY_MODEL = "*"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_HASHED = 100  # a sanitised name is cut here, leaving room for "-" and 8 hex digits


class PoolError(WireError, ValueError):
    """A pool map or pool name that cannot be used (the message says what and why)."""


def pool_name(model: str) -> str:
    """A pool name for ``model``: the model itself when it is one subject token, else its runs of
    other characters turned into ``_`` plus a hash of the original (``Qwen/Qwen2.5`` ->
    ``Qwen_Qwen2_5-<crc32>``), so two models that sanitise alike still get two pools."""
    if not isinstance(model, str) or not model:
        raise PoolError(f"a model name must be a non-empty string, got {model!r}")
    if is_token(model) and model != S.DEFAULT_POOL:
        return model
    base = _UNSAFE.sub("_", model)[:_HASHED].strip("_") or "model"
    return f"{base}-{zlib.crc32(model.encode()):08x}"


def check_pool(pool: str) -> str:
    """``pool`` if it may name a pool: one subject token (``adm.<pool>.>`` and ``router-<pool>``)."""
    if not is_token(pool) or len(S.pool_router(pool)) > MAX_LEN:
        raise PoolError(f"pool name {pool!r} is not a subject token ([A-Za-z0-9_-], 1-{MAX_LEN - 7} chars)")
    return pool


@dataclass(frozen=True)
class PoolMap:
    """Pool -> the models it routes; empty: one pool (:data:`~natsched.wire.subjects.DEFAULT_POOL`) for all."""

    pools: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        owner: dict[str, str] = {}
        for pool, models in self.pools.items():
            check_pool(pool)
            if pool == S.DEFAULT_POOL:
                raise PoolError(f"pool name {S.DEFAULT_POOL!r} is the default pool's (every model, no map); "
                                "name a configured pool otherwise")
            if not models:
                raise PoolError(f"pool {pool!r} names no model")
            for m in models:
                if not isinstance(m, str) or not m:
                    raise PoolError(f"pool {pool!r}: a model must be a non-empty string, got {m!r}")
                if m in owner:
                    raise PoolError(f"model {m!r} is in two pools: {owner[m]!r} and {pool!r}")
                owner[m] = pool
        object.__setattr__(self, "_owner", owner)

    @property
    def configured(self) -> bool:
        return bool(self.pools)

    def pool_of(self, model: str) -> str | None:
        """The pool that routes ``model``; None when a map exists and no pool takes it."""
        if not self.pools:
            return S.DEFAULT_POOL
        owner = self._owner  # type: ignore[attr-defined]
        return owner.get(model) or owner.get(ANY_MODEL)

    def admitted_subject(self, model: str, cls: str, tenant: str) -> str:
        """Where an admitted request for ``model`` goes: ``adm.<pool>.<class>.<tenant>``. A model
        the map no longer routes (edited after the request was admitted: a rescue, a dequeue)
        goes to the default pool, which a plain router consumes (a configured map refuses such
        a model at admission, so only edits race here)."""
        return S.admitted(self.pool_of(model) or S.DEFAULT_POOL, cls, tenant)

    def routes(self, pool: str, models: Iterable[str]) -> bool:
        """Whether pool ``pool`` routes any of ``models`` (a worker's model and served models):
        the default pool routes everything; a configured one, what :meth:`pool_of` sends it."""
        if pool == S.DEFAULT_POOL and not self.pools:
            return True
        return any(self.pool_of(m) == pool for m in models)

    def describe(self) -> str:
        """``a (m1, m2); b (m3)`` for error messages; ``one pool`` without a map."""
        if not self.pools:
            return f"one pool ({S.DEFAULT_POOL})"
        return "; ".join(f"{p} ({', '.join(sorted(ms))})" for p, ms in sorted(self.pools.items()))

    # --- spellings ---------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str) -> "PoolMap":
        """``'a=m1,m2;b=m3,*;Qwen/Qwen2.5'`` (a group without ``=`` is one model in a pool named
        :func:`pool_name` of it); empty: no map."""
        pools: dict[str, set[str]] = {}
        for group in (g.strip() for g in spec.split(";")):
            if not group:
                continue
            name, eq, models = group.partition("=")
            if not eq:
                name, models = pool_name(group), group
            members = {m.strip() for m in models.split(",") if m.strip()}
            pools.setdefault(name.strip(), set()).update(members)
        return cls({p: frozenset(ms) for p, ms in pools.items()})

    @classmethod
    def from_json(cls, raw: bytes | None) -> "PoolMap":
        """The ``config`` bucket's ``pools`` value; None (no key) or ``{}``: no map."""
        if not raw:
            return cls()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise PoolError(f"pool map is not JSON: {exc}") from None
        if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
            raise PoolError('pool map must be a JSON object {"<pool>": ["<model>", ...]}')
        try:
            return cls({str(p): frozenset(ms) for p, ms in data.items()})
        except TypeError:  # an unhashable "model" (a list, an object)
            raise PoolError("pool map: every model must be a string") from None

    def to_json(self) -> bytes:
        return orjson.dumps({p: sorted(ms) for p, ms in sorted(self.pools.items())})
