"""API keys -> tenants. Pure: the file is read once at start; lookups need no I/O.

The keys file is JSON: ``{"KEY": {"tenant": "T", "class": "online"}}``; ``"status": true`` lets
a key read ``/status`` and ``/status.json`` (which show every tenant's usage: on a keyed gateway
no other key may). A key may be written
as ``"sha256:<hex digest of the key>"`` so the file need not hold the secret itself. The class
is the highest the key may use (``online`` > ``batch`` > ``offline``); a request may ask for a
lower one with the ``x-natsched-class`` header, never a higher one.

Keys are looked up by their SHA-256 digest, so the time a lookup takes says nothing about how
much of a guessed key was right.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from natsched.wire import subjects as S
from natsched.gateway.errors import BadRequest, ConfigError, Forbidden, Unauthorized

log = logging.getLogger(__name__)

#: classes from the most to the least urgent; a header may only move down this list
CLASS_RANK = {S.ONLINE: 0, S.BATCH: 1, S.OFFLINE: 2}
CLASS_HEADER = "x-natsched-class"
_FIELDS = {"tenant", "class", "status"}


@dataclass(frozen=True)
class Principal:
    """Who is asking: the tenant a key maps to and the highest class it may use."""

    tenant: str
    cls: str
    key: str = field(default="", compare=False)  # which key (a digest prefix): the per-key limits count by it
    status: bool = field(default=False, compare=False)  # may read /status (every tenant's usage)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    def __init__(self, by_digest: dict[str, Principal], open_principal: Principal | None = None) -> None:
        self._by_digest = by_digest
        self.open_principal = open_principal  # --insecure-open: everyone is this tenant

    @property
    def is_open(self) -> bool:
        return self.open_principal is not None

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def tenants(self) -> set[str]:
        """Every tenant a key maps to (the open tenant when open): the gateway publishes for these."""
        found = {p.tenant for p in self._by_digest.values()}
        return found | {self.open_principal.tenant} if self.open_principal else found

    @classmethod
    def open(cls, tenant: str = "open", klass: str = S.ONLINE) -> "KeyRing":
        """No keys: every request runs as ``tenant`` (``--insecure-open``)."""
        return cls({}, Principal(_check_tenant(tenant, "--open-tenant"), _check_class(klass, "open class"),
                                 key="open", status=True))

    @classmethod
    def from_file(cls, path: str | Path) -> "KeyRing":
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the keys file {path}: {exc.strerror or exc}") from None
        return cls.from_json(raw, str(path))

    @classmethod
    def from_json(cls, raw: bytes, where: str = "keys") -> "KeyRing":
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f'{where}: must be an object like {{"KEY": {{"tenant": "T", "class": "online"}}}}')
        entries: dict[str, Principal] = {}
        for key, entry in data.items():
            who = f"{where}: key {key[:6]}…"
            if not key or not key.strip():
                raise ConfigError(f"{where}: an empty key")
            if not isinstance(entry, dict):
                raise ConfigError(f'{who}: must map to {{"tenant": "T", "class": "online"}}')
            unknown = sorted(set(entry) - _FIELDS)
            if unknown:
                raise ConfigError(f"{who}: unknown field(s) {', '.join(unknown)}")
            digest = key[len("sha256:"):].lower() if key.startswith("sha256:") else _digest(key)
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ConfigError(f"{who}: a sha256: key needs 64 hex digits")
            status = entry.get("status", False)
            if not isinstance(status, bool):
                raise ConfigError(f"{who}: 'status' must be true or false")
            principal = Principal(_check_tenant(entry.get("tenant"), who),
                                  _check_class(entry.get("class", S.ONLINE), who), key=digest[:16], status=status)
            if digest in entries:
                raise ConfigError(f"{who}: listed twice")
            entries[digest] = principal
        if not entries:
            log.warning("%s lists no keys: every request will be refused", where)
        return cls(entries)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an ``Authorization: Bearer KEY`` header (401 when missing or unknown)."""
        if self.open_principal is not None:
            return self.open_principal
        if not authorization:
            raise Unauthorized("missing API key: send 'Authorization: Bearer YOUR_KEY'", code="missing_api_key")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("malformed Authorization header: expected 'Bearer YOUR_KEY'", code="invalid_api_key")
        principal = self._by_digest.get(_digest(key))
        if principal is None:
            raise Unauthorized("incorrect API key provided", code="invalid_api_key")
        return principal


def status_credentials(authorization: str | None) -> str | None:
    """The ``Authorization`` header of a ``/status`` request as a Bearer header: a browser
    (asked by ``WWW-Authenticate: Basic``) sends the key as the password of Basic credentials."""
    if not authorization:
        return authorization
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return authorization
    try:
        _, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return "Basic"  # malformed: refused as such
    return f"Bearer {password}"


def effective_class(principal: Principal, requested: str | None) -> str:
    """The class a request runs in: the key's, or a lower one the header asks for."""
    if requested is None or not requested.strip():
        return principal.cls
    wanted = requested.strip().lower()
    if wanted not in CLASS_RANK:
        raise BadRequest(f"{CLASS_HEADER} must be one of {', '.join(CLASS_RANK)}, got {requested!r}",
                         code="invalid_class", param=CLASS_HEADER)
    if CLASS_RANK[wanted] < CLASS_RANK[principal.cls]:
        raise Forbidden(f"class {wanted} is above this key's class {principal.cls}: a request may only lower it",
                        code="class_not_allowed", param=CLASS_HEADER)
    return wanted


def _check_tenant(tenant: object, who: str) -> str:
    if not isinstance(tenant, str):
        raise ConfigError(f"{who}: 'tenant' must be a string")
    try:
        return S.token(tenant, "tenant")
    except ValueError as exc:
        raise ConfigError(f"{who}: {exc}") from None


def _check_class(klass: object, who: str) -> str:
    if klass not in CLASS_RANK:
        raise ConfigError(f"{who}: 'class' must be one of {', '.join(CLASS_RANK)}, got {klass!r}")
    return str(klass)
