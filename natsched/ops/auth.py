"""``natsched auth init``: lock each role and tenant to its own subjects with NATS's own auth.

Why the server and not our code: a permission in the server's config is checked before any
natsched process sees the message, so a compromised producer or worker cannot spoof a tenant,
read another tenant's results or edit quotas, whatever code it runs. The generated config has
the services' account (``NATSCHED``, JetStream enabled: the services share the streams), one
account per tenant (``TENANT_<t>``: its producer and batch producer) and one for the gateway
(``GATEWAY``), which reach the services only through what ``NATSCHED`` exports to them: a reply
subject or header they choose is mapped back into their own account by the server, so it cannot
name the scheduler's KV or streams. One user per role, each with allow-lists for publish and
subscribe (anything not listed is refused). With ``--partitions N`` and ``--router-pools SPEC``
it adds the users of partitioned admission (one admitter user per partition, confined to that
partition, for any P up to N, and the budget coordinator) and of router pools (one router user
per pool): why one user per partition and not wildcards is in :func:`natsched.wire.roles.roles`.
The roles, their allow-lists and why each may do what it may are pure data in :mod:`natsched.wire.roles`;
this module writes them as a server config and credentials files.

Passwords, not nkeys: the server config then needs no extra package on either side (nkeys
need the ``nkeys`` package in every client). The config holds the passwords in clear, so it is
written with mode 0600 like the credentials files; ``--tls`` adds a self-signed CA and server
certificate (made with ``openssl``) and the CA goes into every credentials file.

Errors::

    AuthError               the config could not be generated, or an auth directory not used
    ├── AuthExistsError     the output directory already has a config (``--force`` replaces it)
    ├── TlsError            no certificate could be made (openssl missing or failing)
    └── MissingCredentialsError  ``natsched up --auth-dir``: a component's credentials file is missing
"""

from __future__ import annotations

from natsched.errors import NatschedError

import logging
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from natsched.wire.pools import PoolMap
from natsched.wire.roles import SERVICES_ACCOUNT, Role, local_subject, roles
from natsched.wire.fence import reply_key

log = logging.getLogger(__name__)

ACCOUNT = SERVICES_ACCOUNT  # (the name older callers import)
CONFIG_NAME = "nats-auth.conf"
CREDS_DIR = "creds"
TLS_DIR = "tls"


class AuthError(NatschedError):
    """Root of the auth errors (tree in the module docstring)."""


class AuthExistsError(AuthError):
    """The output directory already holds a generated config."""


class TlsError(AuthError):
    """No certificate could be made."""


class MissingCredentialsError(AuthError):
    """An auth directory lacks the credentials file of a role someone needs."""


# --- generation ---------------------------------------------------------------------------
@dataclass
class AuthSettings:
    out: Path
    tenants: list[str] = field(default_factory=lambda: ["demo"])
    workers: list[str] = field(default_factory=lambda: ["w1", "w2"])
    gateway_tenants: list[str] | None = None  # None: every tenant; []: no gateway user
    batch_tenants: list[str] | None = None  # None: every tenant; []: no batch users
    offline: bool = True  # the offline runner's user (natsched up runs one)
    #: partitioned admission for any P up to this (natsched.wire.roles.roles): admitter-p<k> per
    #: partition, the coordinator, partition rights for the offline runner and gateway; 1: none
    partitions: int = 1
    router_pools: str = ""  # natsched up --router-pools' spec: one router-<pool> user per pool
    tls: bool = False
    force: bool = False
    password_bytes: int = 24


@dataclass
class AuthFiles:
    """What :func:`init` wrote: the server config and each role's credentials file."""

    config: Path
    credentials: dict[str, Path]  # user -> file
    tls_ca: Path | None = None

    def creds(self, user: str) -> Path:
        return self.credentials[user]


@dataclass
class AuthDir:
    """A directory :func:`init` wrote, as ``natsched up --auth-dir`` uses it: the server runs with
    its config, and every component connects with its own role's credentials file."""

    root: Path

    @classmethod
    def open(cls, root: Path | str) -> "AuthDir":
        found = cls(Path(root))
        if not found.config.is_file():
            raise AuthError(f"{found.config} not found: write it with natsched auth init --out {root}")
        return found

    @property
    def config(self) -> Path:
        return self.root / CONFIG_NAME

    def creds(self, user: str) -> Path:
        return self.root / CREDS_DIR / f"{user}.json"

    def require(self, needs: dict[str, str], hint: str = "") -> None:
        """Every user in ``needs`` (user -> who connects as it) has a credentials file, or one
        error names each missing one: better than a component failing to connect later."""
        missing = [f"{user} (for {who})" for user, who in needs.items() if not self.creds(user).is_file()]
        if missing:
            raise MissingCredentialsError(f"{self.root / CREDS_DIR} has no credentials for {', '.join(missing)}; "
                                          f"regenerate it with natsched auth init --out {self.root} --force"
                                          + (f" {hint}" if hint else ""))

    def tenants(self, user: str) -> list[str]:
        """The tenants a producer, batch or gateway user may publish for (as :func:`init` recorded them)."""
        try:
            record = orjson.loads(self.creds(user).read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise AuthError(f"cannot read {self.creds(user)}: {exc}") from None
        return [str(t) for t in record.get("tenants") or []] if isinstance(record, dict) else []


def server_config(users: list[tuple[Role, str]], tls: dict | None) -> dict:
    """The server config: the services' account (JetStream) with the services' users, and one
    account per tenant (its producer and batch producer) and one for the gateway, each
    reaching the services only through what the services' account exports to it
    (:meth:`natsched.wire.roles.Role.imports`)."""
    accounts: dict[str, dict] = {SERVICES_ACCOUNT: {"jetstream": "enabled", "users": []}}
    exports: dict[tuple[str, str], list[str]] = {}  # (kind, subject) -> importing accounts
    for role, password in users:
        account = accounts.setdefault(role.account, {"users": [], "imports": []})
        account["users"].append({"user": role.user, "password": password, "permissions": role.permissions()})
        services, streams = role.imports()
        for kind, subjects in (("service", services), ("stream", streams)):
            for subj in subjects:
                importers = exports.setdefault((kind, subj), [])
                if role.account not in importers:
                    importers.append(role.account)
                    entry: dict = {kind: {"account": SERVICES_ACCOUNT, "subject": subj}}
                    if local_subject(subj) != subj:
                        entry["to"] = local_subject(subj)
                    account["imports"].append(entry)
    accounts[SERVICES_ACCOUNT]["exports"] = [{kind: subj, "accounts": importers}
                                             for (kind, subj), importers in exports.items()]
    config: dict = {"accounts": accounts}
    if tls:
        config["tls"] = tls
    return config


def _write_secret(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def init(settings: AuthSettings) -> AuthFiles:
    """Write ``nats-auth.conf`` (for ``nats-server -c``) and ``creds/<user>.json`` per role."""
    out = settings.out
    config_path = out / CONFIG_NAME
    if config_path.exists() and not settings.force:
        raise AuthExistsError(f"{config_path} exists: running servers and services use it; pass --force to replace "
                              "it (every password changes)")
    try:
        pools = sorted(PoolMap.parse(settings.router_pools).pools)  # (PoolError is a ValueError)
        all_roles = roles(settings.tenants, settings.workers, settings.gateway_tenants, settings.batch_tenants,
                          settings.offline, settings.partitions, pools)
    except ValueError as exc:
        raise AuthError(str(exc)) from None
    tls_block, ca = None, None
    if settings.tls:
        ca, cert, key = make_tls(out / TLS_DIR)
        tls_block = {"cert_file": str(cert.resolve()), "key_file": str(key.resolve()), "timeout": 5}
    users = [(role, secrets.token_urlsafe(settings.password_bytes)) for role in all_roles]
    fence_key = secrets.token_urlsafe(32)  # natsched.wire.fence: the services' alone
    header = (f"# natsched auth config, generated by `natsched auth init` on {time.strftime('%Y-%m-%d %H:%M:%S')}.\n"
              "# Passwords in clear: keep this file private (mode 0600). Start: nats-server -c THIS_FILE ...\n")
    body = orjson.dumps(server_config(users, tls_block), option=orjson.OPT_INDENT_2)
    _write_secret(config_path, header.encode() + body + b"\n")
    creds: dict[str, Path] = {}
    for role, password in users:
        record = {"user": role.user, "password": password, "inbox_prefix": role.inbox, "role": role.kind}
        if role.tenants:
            record["tenants"] = role.tenants
        if role.js_prefix:
            record["js_prefix"] = role.js_prefix
        if role.fenced:
            record["fence_key"] = fence_key
        elif role.tenants:  # it checks its tenants' workers' replies, and signs nothing
            record["reply_keys"] = {t: reply_key(fence_key, t) for t in role.tenants}
        if ca is not None:
            record["tls_ca"] = os.path.relpath(ca, out / CREDS_DIR)
        path = out / CREDS_DIR / f"{role.user}.json"
        _write_secret(path, orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
        creds[role.user] = path
    _remove_stale(out / CREDS_DIR, set(creds))
    log.info("wrote %s and %d credentials files", config_path, len(creds))
    return AuthFiles(config_path, creds, ca)


def _remove_stale(directory: Path, users: set[str]) -> None:
    """Remove the credentials files of users the new config no longer has (a replaced config
    changes every password, so an old file would only fail later, and ``natsched up --auth-dir``
    takes a file's presence for the role's: an ``admitter-p3.json`` left from ``--partitions 4``
    must not pass for a partition the new config does not have)."""
    for path in directory.glob("*.json"):
        if path.stem not in users:
            path.unlink()
            log.info("removed %s: the new config has no user %s", path, path.stem)


def make_tls(directory: Path, days: int = 825) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 / localhost: (ca, cert, key).

    For tests and loopback deployments; a real deployment brings its own certificates and
    names them in the server config's ``tls`` block and in each credentials file's ``tls_ca``.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TlsError("openssl not found: install it, or write the tls block and tls_ca yourself")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca-key.pem", "ca.pem", "server-key.pem", "server.csr",
                                                           "server.pem"))
    ext = directory / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    steps = [
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
         "-days", str(days), "-subj", "/CN=natsched test CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        [openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
         "-subj", "/CN=localhost"],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
         "-out", str(cert), "-days", str(days), "-extfile", str(ext)],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise TlsError(f"openssl {step[1]} failed: {done.stderr.strip()[-400:]}")
    for path in (ca_key, key):
        path.chmod(0o600)
    return ca, cert, key
