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
