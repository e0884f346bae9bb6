"""Ids and the one rule they follow: every id is a single subject token.

Ids end up inside subjects (``resp.<id>``, ``work.<worker>``, ``req.<class>.<tenant>``) and KV
keys (``res.<request_id>``, ``job.<tenant>.<batch>.<job_id>``), so a dot, a wildcard or a space
in one would change which messages a subject or a permission matches. The same rule checks a
decoded message's ids (:mod:`natsched.wire.schema`, as a ``SchemaError`` naming the field) and
every subject a builder writes (:mod:`natsched.wire.subjects`, as an :class:`IdError`).

Pure module: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from typing import NewType

from natsched.wire.errors import IdError

RequestId = NewType("RequestId", str)
WorkerId = NewType("WorkerId", str)
TenantId = NewType("TenantId", str)
BlockHash = NewType("BlockHash", int)  # a prefix block's chained hash (natsched.wire.blocks)

#: one subject token: letters, digits, ``_`` and ``-``, 1 to 128 characters
TOKEN = r"[A-Za-z0-9_-]{1,128}"
ID_PATTERN = re.compile(rf"\A{TOKEN}\Z")  # \Z, not $: "$" also matches before a final newline
MAX_LEN = 128


def is_token(value: object) -> bool:
    """Whether ``value`` is a string usable as one subject token."""
    return isinstance(value, str) and ID_PATTERN.match(value) is not None


def token(value: str, what: str = "token") -> str:
    """``value`` if it is one subject token, else :class:`IdError` saying which ``what`` was bad."""
    if not is_token(value):
        raise IdError(f"{what} {value!r} is not a valid subject token ([A-Za-z0-9_-], 1-{MAX_LEN} chars)", what)
    return value


def attempt_id(job_id: str, attempt: int) -> str:
    """The id attempt ``attempt`` (1-based) runs under: every stage dedups on the request id, so a
    retry within the dedup window needs a fresh one."""
    if attempt <= 1:
        return job_id
    suffix = f"-r{attempt}"
    if len(job_id) + len(suffix) <= 128:
        return job_id + suffix
    return "j" + hashlib.sha256(job_id.encode()).hexdigest()[:40] + suffix


# --- request ids scoped by tenant ------------------------------------------------------------
#
# Why: a request id is the key of everything downstream (reservation, hand-off and completion
# message ids, the services' in-memory state), so two tenants choosing the same id ("req-1")
# collided, and a tenant that could predict another's id could take it first: the victim's request
# was refused as a duplicate. natsched's producers (the client, the gateway through it) therefore
# put the tenant into the id itself: ``_<tag>_<id>``, ``<tag>`` the first 8 hex digits of the
# tenant's digest. The admitter refuses an id scoped for another tenant than its subject's, so no
# tenant can take an id in another's scope; ids of no scope (legacy publishers) are taken as they
# are. The id stays one token, is computed by anyone from (tenant, id), and scoping is idempotent.

_SCOPE_TAG_HEX = 8
_SCOPED = re.compile(rf"\A_([0-9a-f]{{{_SCOPE_TAG_HEX}}})_(.+)\Z", re.S)
_SCOPE_ROOM = MAX_LEN - _SCOPE_TAG_HEX - 2


def tenant_tag(tenant: str) -> str:
    """The tag of ``tenant``'s id scope."""
    return hashlib.sha256(b"natsched-tenant\0" + tenant.encode()).hexdigest()[:_SCOPE_TAG_HEX]


def scope_of(request_id: str) -> str | None:
    """The tenant tag a scoped id carries, or None for an id of no scope."""
    m = _SCOPED.match(request_id)
    return m.group(1) if m else None


def scoped(tenant: str, request_id: str) -> RequestId:
    """``request_id`` in ``tenant``'s scope (unchanged when it is already; an id too long to keep
    beside the tag is replaced by its digest)."""
    tag = tenant_tag(tenant)
    if scope_of(request_id) == tag:
        return RequestId(request_id)
    if len(request_id) > _SCOPE_ROOM:
        request_id = "h" + hashlib.sha256(request_id.encode()).hexdigest()[:40]
    return RequestId(f"_{tag}_{request_id}")


def in_scope(tenant: str, request_id: str) -> bool:
    """Whether ``tenant`` may use ``request_id``: an id of no scope, or one of its own scope."""
    tag = scope_of(request_id)
    return tag is None or tag == tenant_tag(tenant)


def unscoped(request_id: str) -> str:
    """The id as its producer chose it (the part after the tag), or ``request_id`` itself."""
    m = _SCOPED.match(request_id)
    return m.group(2) if m else request_id
