"""``natsched auth init``: lock each role and tenant to its own subjects with NATS's own auth.

Why the server and not our code: a permission in the server's config is checked before any
natsched process sees the message, so a compromised producer or worker cannot spoof a tenant,
read another tenant's results or edit quotas, whatever code it runs. The generated config has
one account (``NATSCHED``, JetStream enabled: every role shares the streams) and one user per
role, each with allow-lists for publish and subscribe (anything not listed is refused):

- ``producer-<tenant>``: publishes ``req.*.<tenant>`` only (the subject names the tenant, and the
  admitter refuses a body whose tenant differs); subscribes to its replies ``resp.<tenant>.>``
  and its own inbox. Nothing else: no JetStream API, no KV, no other tenant's replies.
- ``worker-<id>``: its own consumer on ``work.<id>``, its heartbeat/cache subjects and control
  subject, completions and replies; it cannot publish admission (``adm.>``) or decisions.
- ``admitter`` / ``router``: their consumers, the subjects they hand off to, their KV keys.
- ``offline`` (the offline runner): consumes OFFLINE and OUTCOMES, hands taken work to ADMITTED
  (``adm.>``), re-queues on ``offline.>``, records ``decision.offline.*`` (never an admission or
  routing decision), reserves in ``inflight`` (``usage``, ``res.*``) like an admitter, reads quotas
  and writes job records (``job.*.*.*``), never quotas or batch manifests.
- ``gateway``: a producer for the tenants its API keys map to (``req.*.<tenant>``,
  ``resp.<tenant>.>``, ``--gateway-tenants``), ``cancel`` on ``worker.*.ctl``, and what
  ``/v1/models`` and ``/status`` show: heartbeats, the DECISIONS and COMPLETIONS records (no
  prompts or outputs), quotas and the ``inflight`` usage. No other tenant's requests or replies.
- ``batch-<tenant>`` (``natsched batch``/``jobs``): publishes ``req.*.<tenant>``; reads and writes
  its own job records ``job.<tenant>.*.*`` and batch manifests ``batch.<batch>`` (by id: a
  manifest names no tenant in its key), reads its own ``req.*.<tenant>`` in REQUESTS for
  ``--resume``. Its reads are confined to those keys and subjects because each names them in its
  subject: direct gets (bucket ``jobs`` allows direct access) and named consumers whose create
  subject carries the filter (:func:`natsched.audit.records.read_filtered`); a plain get, a watch, a fetch
  (``CONSUMER.MSG.NEXT``) or a consumer info would not, and are not granted.
- ``admin``: everything (provisioning, ``quota set``, ``route set``, audit, calibration).

Every role gets its own inbox prefix (``_INBOX.<user>``) and may subscribe only below it:
JetStream acks, pulled messages and KV reads travel on inboxes, so a shared ``_INBOX.>`` would
let a producer read the prompts the workers pull.

Passwords, not nkeys: the server config then needs no extra package on either side (nkeys
need the ``nkeys`` package in every client). The config holds the passwords in clear, so it is
written with mode 0600 like the credentials files; ``--tls`` adds a self-signed CA and server
certificate (made with ``openssl``) and the CA goes into every credentials file.

Permission subjects are rendered from :data:`natsched.wire.subjects.PATTERNS` (a placeholder left open
becomes ``*``) and the stream/consumer/bucket names in :mod:`natsched.wire.subjects`; the ``$JS``/``$KV``
names are NATS's own API.

Errors::

    AuthError               the config could not be generated, or an auth directory not used
    ├── AuthExistsError     the output directory already has a config (``--force`` replaces it)
    ├── TlsError            no certificate could be made (openssl missing or failing)
    └── MissingCredentialsError  ``natsched up --auth-dir``: a component's credentials file is missing
"""

from __future__ import annotations

from natsched.errors import NatschedError

import argparse
import logging
import os
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from natsched.wire import subjects as S

log = logging.getLogger(__name__)

ACCOUNT = "NATSCHED"
CONFIG_NAME = "nats-auth.conf"
CREDS_DIR = "creds"
TLS_DIR = "tls"

# --- NATS's own subject names (JetStream API, KV, inboxes) -----------------------------------
JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
JS_FC = "$JS.FC"  # flow-control replies of push consumers (KV watches)
KV_PREFIX = "$KV"
KV_STREAM_PREFIX = "KV_"
INBOX_ROOT = "_INBOX"

#: proposed for bus/subjects.py (subjects.md, "Roles and permissions"): replies under the
#: producer's tenant, so that a permission can confine a producer to its own
TENANT_REPLY = S.PATTERNS.get("tenant_reply", "resp.<tenant>.<request_id>")


class AuthError(NatschedError):
    """Root of the auth errors (tree in the module docstring)."""


class AuthExistsError(AuthError):
    """The output directory already holds a generated config."""


class TlsError(AuthError):
    """No certificate could be made."""


class MissingCredentialsError(AuthError):
    """An auth directory lacks the credentials file of a role someone needs."""


# --- subjects -------------------------------------------------------------------------------
def render(pattern: str, **values: str) -> str:
    """A ``PATTERNS`` shape with the given placeholders filled (each checked to be one token)
    and the others ``*``: ``render("decision.<stage>.<tenant>", stage="admission")`` ->
    ``decision.admission.*``."""
    def fill(m: re.Match) -> str:
        name = m.group(1)
        return S.token(values[name], name) if name in values else "*"

    return re.sub(r"<([a-z_]+)>", fill, pattern)


def subject(builder: str, **values: str) -> str:
    """``render`` of the shape of one :mod:`natsched.wire.subjects` builder."""
    return render(S.PATTERNS[builder], **values)


def tenant_reply(tenant: str, request_id: str) -> str:
    """A producer's reply subject ``resp.<tenant>.<request_id>`` (``S.tenant_reply`` once it exists)."""
    builder = getattr(S, "tenant_reply", None)
    return builder(tenant, request_id) if builder else render(TENANT_REPLY, tenant=tenant, request_id=request_id)


def replies_of(tenant: str) -> str:
    """Every reply subject of one tenant: ``resp.<tenant>.>``."""
    return render(TENANT_REPLY, tenant=tenant).rsplit(".", 1)[0] + ".>"


def inbox_prefix(user: str) -> str:
    return f"{INBOX_ROOT}.{S.token(user, 'user')}"


def _js(*parts: str) -> str:
    return ".".join((JS_API, *parts))


def _kv_stream(bucket: str) -> str:
    return KV_STREAM_PREFIX + bucket


def _kv_key(bucket: str, key: str = ">") -> str:
    return f"{KV_PREFIX}.{bucket}.{key}"


def consumer_permissions(stream: str, durable: str, filter_subject: str) -> list[str]:
    """Pull one durable consumer: create it *with this filter only* (the filter is part of the
    create subject, so a worker cannot re-point its consumer at another worker's subject),
    read its info, fetch, and ack/nak/in-progress its messages."""
    return [
        _js("CONSUMER", "CREATE", stream, durable, filter_subject),
        _js("CONSUMER", "INFO", stream, durable),
        _js("CONSUMER", "MSG", "NEXT", stream, durable),
        f"{JS_ACK}.{stream}.{durable}.>",
    ]


def kv_read_permissions(bucket: str, key: str = ">") -> list[str]:
    """Read (get, watch) ``key`` (a key, or ``>`` for all) of one bucket.

    Only direct gets carry the key in the subject; a plain get and a watch do not, so a role
    that may read one key of a bucket can in fact read all of it (writes are per key).
    """
    stream = _kv_stream(bucket)
    return [
        _js("STREAM", "INFO", stream),
        _js("DIRECT", "GET", stream, _kv_key(bucket, key)),
        _js("STREAM", "MSG", "GET", stream),  # a get without direct access: the key is in the body
        # a watch is an ordered consumer: nats-py creates it without a name, so the filter is not
        # in the subject and cannot be pinned (a reader of one key can read the bucket)
        _js("CONSUMER", "CREATE", stream),
        _js("CONSUMER", "CREATE", stream, "*", _kv_key(bucket, key)),
        _js("CONSUMER", "INFO", stream, "*"),
        _js("CONSUMER", "DELETE", stream, "*"),
        f"{JS_FC}.{stream}.>",
    ]


def kv_snapshot_permissions(bucket: str) -> list[str]:
    """Read the whole bucket in acknowledged windows (``natsched.bus.snapshot``): a read of it, and the
    acks of the reader's own consumers (they confirm a read, nothing else: the role can read and
    write this bucket already)."""
    return [*kv_read_permissions(bucket), f"{JS_ACK}.{_kv_stream(bucket)}.>"]


def kv_write_permissions(bucket: str, key: str = ">") -> list[str]:
    """Put, create, update and delete ``key`` of one bucket (the ack comes on the inbox)."""
    return [_kv_key(bucket, key)]


def kv_get_permissions(bucket: str, key: str) -> list[str]:
    """Get ``key`` of one bucket, and no watch: a watch needs consumer info and delete on the
    bucket's stream, which reach other roles' watches too.

    Without direct access the get names the key in its body: the role can get any key.
    """
    stream = _kv_stream(bucket)
    return [_js("STREAM", "INFO", stream), _js("DIRECT", "GET", stream, _kv_key(bucket, key)),
            _js("STREAM", "MSG", "GET", stream)]


def filtered_read_permissions(stream: str, filter_subject: str) -> list[str]:
    """Read the messages of ``stream`` on ``filter_subject`` and nothing else of it.

    Only through :func:`natsched.audit.records.read_filtered`: a named ephemeral push consumer, whose create
    subject carries the filter (the server refuses a body that asks for another), delivering to
    the role's own inbox. No fetch (``CONSUMER.MSG.NEXT`` names no filter: it would let the role
    pull from the services' consumers), no consumer info or delete.
    """
    return [_js("CONSUMER", "CREATE", stream, "*", filter_subject), f"{JS_FC}.{stream}.>"]


def kv_pinned_read_permissions(bucket: str, key: str) -> list[str]:
    """Read the keys matching ``key`` of a bucket with direct access (``jobs``) and no other key:
    direct gets name the key in their subject, snapshots go through :func:`filtered_read_permissions`."""
    stream = _kv_stream(bucket)
    return [_js("STREAM", "INFO", stream), _js("DIRECT", "GET", stream, _kv_key(bucket, key)),
            *filtered_read_permissions(stream, _kv_key(bucket, key))]


# --- roles ----------------------------------------------------------------------------------
@dataclass
class Role:
    """One NATS user: what it may publish and subscribe to."""

    user: str
    kind: str  # admin | admitter | router | scheduler | worker | offline | gateway | batch | producer
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)  # whose requests it may publish (producer, batch, gateway)

    @property
    def inbox(self) -> str:
        return inbox_prefix(self.user)

    def permissions(self) -> dict:
        return {"publish": {"allow": _unique(self.publish)},
                "subscribe": {"allow": _unique([f"{self.inbox}.>", *self.subscribe])}}


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


#: what every service needs: read stream info and the stored retention limits (services run
#: the idempotent provisioning at start, which only reads when the admin has provisioned), and
#: reply to producers
def _service_base() -> list[str]:
    return [_js("STREAM", "INFO", "*"), *kv_read_permissions(S.BUCKET_CONFIG, S.KEY_RETENTION),
            subject("reply"), render(TENANT_REPLY), S.OUTCOMES_ALL]


def admin_role() -> Role:
    return Role("admin", "admin", publish=[">"], subscribe=[">"])


def admitter_role() -> Role:
    pub = _service_base() + [
        S.ADMITTED_ALL, S.OFFLINE_ALL, subject("decision", stage="admission"), S.deadletter("admitter"),
        # rescue (admitter/rescue.py): read and remove what a dead worker left on WORK
        _js("STREAM", "MSG", "GET", S.STREAM_WORK), _js("STREAM", "MSG", "DELETE", S.STREAM_WORK),
        *consumer_permissions(S.STREAM_REQUESTS, S.CONSUMER_ADMITTER, S.REQUESTS_ALL),
        *consumer_permissions(S.STREAM_COMPLETIONS, S.CONSUMER_ADMITTER_COMPLETIONS, S.COMPLETIONS_ALL),
        *kv_snapshot_permissions(S.BUCKET_INFLIGHT), *kv_write_permissions(S.BUCKET_INFLIGHT),
        *kv_read_permissions(S.BUCKET_QUOTAS), *kv_write_permissions(S.BUCKET_QUOTAS, S.KEY_DYNAMIC_TOTAL),
        *kv_read_permissions(S.BUCKET_WORKERS),
    ]
    return Role("admitter", "admitter", publish=pub, subscribe=[S.HEARTBEATS_ALL])


def router_role() -> Role:
    pub = _service_base() + [
        S.WORK_ALL, S.COMPLETIONS_ALL, subject("decision", stage="routing"), subject("control"),
        S.deadletter("router"),
        *consumer_permissions(S.STREAM_ADMITTED, S.CONSUMER_ROUTER, S.ADMITTED_ALL),
        *kv_read_permissions(S.BUCKET_CONFIG, S.KEY_ROUTER_CONFIG),
        # learned cost statistics shared between replicas, and the calibrations they start from
        *kv_read_permissions(S.BUCKET_WORKERS), *kv_write_permissions(S.BUCKET_WORKERS, S.COST_KEYS),
    ]
    return Role("router", "router", publish=pub, subscribe=[S.HEARTBEATS_ALL, S.CACHE_EVENTS_ALL, S.COMPLETIONS_ALL])


def scheduler_role() -> Role:
    """An admitter with inline routing (``natsched admitter --route``): both services' rights in
    one process, no more (the union of :func:`admitter_role` and :func:`router_role`)."""
    adm, rtr = admitter_role(), router_role()
    return Role("scheduler", "scheduler", publish=_unique(adm.publish + rtr.publish),
                subscribe=_unique(adm.subscribe + rtr.subscribe))


def worker_role(worker: str) -> Role:
    S.token(worker, "worker id")
    pub = _service_base() + [
        S.COMPLETIONS_ALL, S.heartbeat(worker), S.cache_events(worker), S.deadletter("worker"),
        *consumer_permissions(S.STREAM_WORK, S.worker_consumer(worker), S.work(worker)),
        *kv_read_permissions(S.BUCKET_WORKERS),
    ]
    return Role(f"worker-{worker}", "worker", publish=pub, subscribe=[S.control(worker)])


def offline_role() -> Role:
    """The offline runner (admitter/offline.py): takes OFFLINE work when the cluster is idle,
    reserves it in ``inflight`` as an admitter does, hands it to ADMITTED, folds OUTCOMES into
    the job records. It records ``decision.offline.*`` only: admission decisions are the admitter's."""
    pub = _service_base() + [
        S.ADMITTED_ALL, S.OFFLINE_ALL, subject("decision", stage=S.STAGE_OFFLINE), S.deadletter("offline"),
        *consumer_permissions(S.STREAM_OFFLINE, S.CONSUMER_OFFLINE, S.OFFLINE_ALL),
        *consumer_permissions(S.STREAM_OUTCOMES, S.CONSUMER_OFFLINE_OUTCOMES, S.OUTCOMES_ALL),
        *kv_read_permissions(S.BUCKET_INFLIGHT), *kv_write_permissions(S.BUCKET_INFLIGHT, S.KEY_USAGE),
        *kv_write_permissions(S.BUCKET_INFLIGHT, render(S.PATTERNS["reservation_key"])),
        *kv_read_permissions(S.BUCKET_QUOTAS),
        *kv_pinned_read_permissions(S.BUCKET_JOBS, render(S.PATTERNS["job_key"])),
        *kv_write_permissions(S.BUCKET_JOBS, render(S.PATTERNS["job_key"])),
    ]
    return Role("offline", "offline", publish=pub, subscribe=[S.HEARTBEATS_ALL])


def gateway_role(tenants: list[str]) -> Role:
    """The HTTP gateway: a producer for the tenants its API keys map to (requests, their replies,
    cancels on the workers' control subjects), plus what ``/v1/models`` and ``/status`` show:
    heartbeats, admission records and completions (no prompts or outputs), quotas and usage."""
    if not tenants:
        raise ValueError("the gateway role needs at least one tenant")
    records = (S.STREAM_DECISIONS, S.STREAM_COMPLETIONS)
    pub = [*(S.requests_of(t) for t in tenants), subject("control"),
           *(_js("STREAM", "INFO", st) for st in records), *(_js("STREAM", "MSG", "GET", st) for st in records),
           *filtered_read_permissions(_kv_stream(S.BUCKET_QUOTAS), _kv_key(S.BUCKET_QUOTAS)),
           # the routers' verdicts on workers (half-open, learned rates) for its status page
           *filtered_read_permissions(_kv_stream(S.BUCKET_WORKERS), _kv_key(S.BUCKET_WORKERS, S.COST_KEYS)),
           *kv_get_permissions(S.BUCKET_INFLIGHT, S.KEY_USAGE)]
    sub = [*(replies_of(t) for t in tenants), S.HEARTBEATS_ALL, S.DECISIONS_ALL, S.COMPLETIONS_ALL]
    return Role("gateway", "gateway", publish=pub, subscribe=sub, tenants=list(tenants))


def batch_role(tenant: str) -> Role:
    """``natsched batch`` for one tenant: publishes its requests, writes its job records and batch
    manifests, reads its own records (status, results) and its own REQUESTS (``--resume``).

    Manifests are keyed ``batch.<batch>`` (no tenant): the role may get or put a manifest whose id
    it knows (ids are digests of the tenant and the file), never list them.
    """
    S.token(tenant, "tenant")
    own = render(S.PATTERNS["job_key"], tenant=tenant)
    manifests = render(S.PATTERNS["batch_key"])
    pub = [S.requests_of(tenant),
           _js("STREAM", "INFO", "*"),  # provisioning reads: limits and counts, never a message
           *kv_get_permissions(S.BUCKET_CONFIG, S.KEY_RETENTION),
           *kv_pinned_read_permissions(S.BUCKET_JOBS, own), *kv_write_permissions(S.BUCKET_JOBS, own),
           _js("DIRECT", "GET", _kv_stream(S.BUCKET_JOBS), _kv_key(S.BUCKET_JOBS, manifests)),
           *kv_write_permissions(S.BUCKET_JOBS, manifests),
           *filtered_read_permissions(S.STREAM_REQUESTS, S.requests_of(tenant))]
    return Role(f"batch-{tenant}", "batch", publish=pub, tenants=[tenant])


def producer_role(tenant: str) -> Role:
    return Role(f"producer-{S.token(tenant, 'tenant')}", "producer", publish=[S.requests_of(tenant)],
                subscribe=[replies_of(tenant)], tenants=[tenant])


def roles(tenants: list[str], workers: list[str], gateway_tenants: list[str] | None = None,
          batch_tenants: list[str] | None = None, offline: bool = True) -> list[Role]:
    """Every role to generate; ``gateway_tenants`` / ``batch_tenants`` None: the same as ``tenants``
    (empty: no gateway user / no batch users)."""
    gateway_tenants = tenants if gateway_tenants is None else gateway_tenants
    batch_tenants = tenants if batch_tenants is None else batch_tenants
    return [admin_role(), admitter_role(), router_role(), scheduler_role(), *([offline_role()] if offline else []),
            *(worker_role(w) for w in workers), *([gateway_role(gateway_tenants)] if gateway_tenants else []),
            *(batch_role(t) for t in batch_tenants), *(producer_role(t) for t in tenants)]


# --- generation ---------------------------------------------------------------------------
@dataclass
class AuthSettings:
    out: Path
    tenants: list[str] = field(default_factory=lambda: ["demo"])
    workers: list[str] = field(default_factory=lambda: ["w1", "w2"])
    gateway_tenants: list[str] | None = None  # None: every tenant; []: no gateway user
    batch_tenants: list[str] | None = None  # None: every tenant; []: no batch users
    offline: bool = True  # the offline runner's user (natsched up runs one)
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
    config: dict = {"accounts": {ACCOUNT: {"jetstream": "enabled", "users": [
        {"user": role.user, "password": password, "permissions": role.permissions()} for role, password in users
    ]}}}
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
        all_roles = roles(settings.tenants, settings.workers, settings.gateway_tenants, settings.batch_tenants,
                          settings.offline)
    except ValueError as exc:
        raise AuthError(str(exc)) from None
    tls_block, ca = None, None
    if settings.tls:
        ca, cert, key = make_tls(out / TLS_DIR)
        tls_block = {"cert_file": str(cert.resolve()), "key_file": str(key.resolve()), "timeout": 5}
    users = [(role, secrets.token_urlsafe(settings.password_bytes)) for role in all_roles]
    header = (f"# natsched auth config, generated by `natsched auth init` on {time.strftime('%Y-%m-%d %H:%M:%S')}.\n"
              "# Passwords in clear: keep this file private (mode 0600). Start: nats-server -c THIS_FILE ...\n")
    body = orjson.dumps(server_config(users, tls_block), option=orjson.OPT_INDENT_2)
    _write_secret(config_path, header.encode() + body + b"\n")
    creds: dict[str, Path] = {}
    for role, password in users:
        record = {"user": role.user, "password": password, "inbox_prefix": role.inbox, "role": role.kind}
        if role.tenants:
            record["tenants"] = role.tenants
        if ca is not None:
            record["tls_ca"] = os.path.relpath(ca, out / CREDS_DIR)
        path = out / CREDS_DIR / f"{role.user}.json"
        _write_secret(path, orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
        creds[role.user] = path
    log.info("wrote %s and %d credentials files", config_path, len(creds))
    return AuthFiles(config_path, creds, ca)


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


def parse_list(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def add_auth_parser(sub) -> None:
    """``natsched auth init`` (for cli.build_parser)."""
    au = sub.add_parser("auth", help="lock roles and tenants to their subjects (NATS accounts and permissions)",
                        description="Generate a NATS server config with one user per role and per-role "
                                    "permissions, and a credentials file per role.")
    au_sub = au.add_subparsers(dest="action", required=True, metavar="ACTION")
    init_p = au_sub.add_parser("init", help="write nats-auth.conf and creds/<user>.json",
                               description="Write DIR/nats-auth.conf (nats-server -c) and DIR/creds/<user>.json "
                                           "for admin, admitter, router, the offline runner, each worker, the "
                                           "gateway, and each tenant's producer and batch producer.")
    init_p.add_argument("--out", default="natsched-auth", help="output directory (default ./natsched-auth)")
    init_p.add_argument("--tenants", default="demo", help="comma-separated tenants, one producer user each "
                                                          "(default demo)")
    init_p.add_argument("--workers", default="w1,w2", help="comma-separated worker ids, one worker user each "
                                                           "(default w1,w2, as natsched up names them)")
    init_p.add_argument("--gateway-tenants", default=None, metavar="TENANTS",
                        help="comma-separated tenants the gateway user may publish for: the tenants its API keys "
                             "name (default: every --tenants; '' for no gateway user)")
    init_p.add_argument("--batch-tenants", default=None, metavar="TENANTS",
                        help="comma-separated tenants with a batch-<tenant> user for natsched batch/jobs "
                             "(default: every --tenants; '' for none)")
    init_p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                        help="the offline runner's user (default: yes; natsched up runs the runner)")
    init_p.add_argument("--tls", action="store_true", help="also make a self-signed CA and a server certificate "
                                                           "for 127.0.0.1/localhost (openssl)")
    init_p.add_argument("--force", action="store_true", help="replace an existing config (every password changes)")


def cmd_auth(args) -> int:
    """``natsched auth init``: prints where everything went and how to use it."""
    settings = AuthSettings(out=Path(args.out), tenants=parse_list(args.tenants), workers=parse_list(args.workers),
                            gateway_tenants=_optional_list(args.gateway_tenants),
                            batch_tenants=_optional_list(args.batch_tenants), offline=args.offline,
                            tls=args.tls, force=args.force)
    files = init(settings)
    print(f"server config: {files.config}")
    print(f"  start a server with it: nats-server -js -c {files.config}  (or: natsched cluster up --auth-config ...)")
    for user, path in files.credentials.items():
        print(f"credentials {user:<24} {path}")
    if files.tls_ca:
        print(f"TLS CA: {files.tls_ca} (named in every credentials file)")
    print("provision streams and buckets with the admin credentials first; services and producers then "
          "connect with --credentials FILE")
    print(f"  or run everything on these credentials: natsched up --auth-dir {settings.out}")
    return 0


def _optional_list(text: str | None) -> list[str] | None:
    """A list flag whose absence means "the default" and whose empty value means "none"."""
    return None if text is None else parse_list(text)
