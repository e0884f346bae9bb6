"""The role permission model: which natsched role may publish and subscribe to which subjects.

Pure: roles and their allow-lists as data, rendered from :mod:`natsched.wire.subjects` (a
``PATTERNS`` placeholder left open becomes ``*``) and NATS's own API names (``$JS``, ``$KV``,
inboxes). :mod:`natsched.ops.auth` (``natsched auth init``) writes them as a nats-server config
and credentials files; ``subjects.md`` ("Roles and permissions") summarises them. The roles:

- ``producer-<tenant>``: publishes ``req.*.<tenant>`` and ``cancel.<tenant>.*`` only (the subject
  names the tenant: the admitter refuses a request body whose tenant differs, and every service
  acts on a cancel only for a request of the subject's tenant); subscribes to its replies ``resp.<tenant>.>``
  and its own inbox. Nothing else: no JetStream API, no KV, no other tenant's replies.
- ``worker-<id>``: its own consumer on ``work.<id>``, its heartbeat/cache subjects and control
  subject, completions and replies; it cannot publish admission (``adm.>``) or decisions.
- ``admitter`` / ``router``: their consumers, the subjects they hand off to, their KV keys.
- ``admitter-p<k>`` (partitioned admission, ``auth init --partitions N``, k < N): an admitter
  confined to partition ``k``: consumers ``admitter-p<k>`` (``reqp.<k>.>``) and
  ``admitter-completions-p<k>``, bucket ``inflight-p<k>``, reports ``budget/report.<k>.*``, and a
  coordinator candidate's plan and lease; ``coordinator``: the candidate alone (``natsched
  coordinator``). Enumerated per partition, not wildcards: see :func:`roles`.
- ``router-<pool>`` (``auth init --router-pools SPEC``): a router of one pool, its own consumer
  ``router-<pool>`` created with filter ``adm.<pool>.>`` only.
- ``offline`` (the offline runner): consumes OFFLINE and OUTCOMES, hands taken work to ADMITTED
  (``adm.>``), re-queues on ``offline.>``, records ``decision.offline.*`` (never an admission or
  routing decision), reserves in ``inflight`` (``usage``, ``res.*``) like an admitter, reads quotas
  and writes job records (``job.*.*.*``), never quotas or batch manifests.
- ``gateway``: a producer for the tenants its API keys map to (``req.*.<tenant>``,
  ``resp.<tenant>.>``, ``cancel.<tenant>.*``, ``--gateway-tenants``), nothing on the workers'
  control subjects (it can neither drain a worker nor cancel another tenant's request), and what
  ``/v1/models`` and ``/status`` show: heartbeats, the DECISIONS and COMPLETIONS records (no
  prompts or outputs), quotas and the ``inflight`` usage; and, for ``/v1/natsched/jobs/{id}``, a
  read of its tenants' job records (``job.<tenant>.*.*``, pinned like the batch role's; no write).
  No other tenant's requests, replies or jobs.
- ``batch-<tenant>`` (``natsched batch``/``jobs``): publishes ``req.*.<tenant>``; reads and writes
  its own job records ``job.<tenant>.*.*`` and batch manifests ``batch.<batch>`` (by id: a
  manifest names no tenant in its key), reads its own ``req.*.<tenant>`` (and, as a partitioned
  REQUESTS stores them, ``reqp.*.*.<tenant>``) in REQUESTS for ``--resume``. Its reads are confined to those keys and subjects because each names them in its
  subject: direct gets (bucket ``jobs`` allows direct access) and named consumers whose create
  subject carries the filter (:func:`natsched.audit.records.read_filtered`); a plain get, a watch, a fetch
  (``CONSUMER.MSG.NEXT``) or a consumer info would not, and are not granted.
- ``admin``: everything (provisioning, ``quota set``, ``route set``, audit, calibration).

Every role gets its own inbox prefix (``_INBOX.<user>``) and may subscribe only below it:
JetStream acks, pulled messages and KV reads travel on inboxes, so a shared ``_INBOX.>`` would
let a producer read the prompts the workers pull.

Pure module: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from natsched.wire import subjects as S

# --- NATS's own subject names (JetStream API, KV, inboxes) -----------------------------------
JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
JS_FC = "$JS.FC"  # flow-control replies of push consumers (KV watches)
INBOX_ROOT = "_INBOX"

# --- accounts: who shares a namespace with the scheduler's streams and buckets ---------------
#: the services' account: JetStream, every stream and bucket, admin, admitter, router, workers
SERVICES_ACCOUNT = "NATSCHED"
#: the HTTP gateway's own account
GATEWAY_ACCOUNT = "GATEWAY"
#: kinds of role that run outside the services' account (see :func:`tenant_account`)
OUTSIDE_KINDS = frozenset({"producer", "batch", "gateway"})
#: kinds of role given the key that signs assignments (routers) and checks completions
#: (admitters, the audit): never a worker, producer or gateway
FENCE_KINDS = frozenset({"admin", "admitter", "router", "scheduler", "offline"})  # offline: checks job outcomes
#: where an outside account sees the services' JetStream API: every account already answers
#: ``$JS.API.>`` itself (with "JetStream not enabled"), so an import under the same name would
#: race it; the client names this prefix instead (its credentials file carries it)
IMPORTED_JS_API = "JS.NATSCHED.API"


def local_subject(subject: str) -> str:
    """What an outside role publishes for ``subject`` of the services' account: the JetStream
    API under :data:`IMPORTED_JS_API`, anything else under its own name."""
    return IMPORTED_JS_API + subject[len(JS_API):] if subject.startswith(JS_API + ".") else subject


def tenant_account(tenant: str) -> str:
    """A tenant's own account (its producer and batch producer): ``TENANT_<tenant>``.

    Why an account and not only permissions: a permission limits the subjects a connection
    names, but a JetStream publish also names a *reply* subject, and the server writes its
    publish ack there with its own rights. In the services' account a reply-to of
    ``$KV.inflight.usage`` made the server overwrite the admitters' usage. In an account of its
    own, a tenant reaches the services only through the imports it is given (its ``req.*.<t>``
    subjects, its JetStream reads), and the server maps every reply back into the tenant's
    account: nothing it names can land in the services' namespace.
    """
    return f"TENANT_{S.token(tenant, 'tenant')}"


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


def inbox_prefix(user: str) -> str:
    return f"{INBOX_ROOT}.{S.token(user, 'user')}"


def _js(*parts: str) -> str:
    return ".".join((JS_API, *parts))


_kv_stream = S.kv_stream


def _kv_key(bucket: str, key: str = ">") -> str:
    return S.kv_subject(bucket, key)


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
    kind: str  # admin | admitter | coordinator | router | scheduler | worker | offline | gateway | batch | producer
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)  # whose requests it may publish (producer, batch, gateway)

    @property
    def inbox(self) -> str:
        return inbox_prefix(self.user)

    @property
    def account(self) -> str:
        """The account the user lives in: producers and batch producers in their tenant's,
        the gateway in its own, everything else in the services' (:func:`tenant_account`)."""
        if self.kind == "gateway":
            return GATEWAY_ACCOUNT
        if self.kind in OUTSIDE_KINDS:
            return tenant_account(self.tenants[0])
        return SERVICES_ACCOUNT

    @property
    def fenced(self) -> bool:
        """Whether the role holds the fence key (signs or checks assignments: natsched.wire.fence)."""
        return self.kind in FENCE_KINDS

    @property
    def outside(self) -> bool:
        return self.account != SERVICES_ACCOUNT

    @property
    def js_prefix(self) -> str | None:
        """The JetStream API prefix the role's client uses (None: the default ``$JS.API``)."""
        return IMPORTED_JS_API if self.outside else None

    def imports(self) -> tuple[list[str], list[str]]:
        """(services, streams) an outside role imports from the services' account: every
        subject it may publish is a service import (the server maps its reply back into the
        role's account; :func:`local_subject` is its name there), every subject it may
        receive a stream import, with its own inbox (push consumers deliver there). Nothing
        for a role inside the services' account."""
        if not self.outside:
            return [], []
        return _unique(self.publish), _unique([*self.subscribe, f"{self.inbox}.>"])

    def permissions(self) -> dict:
        publish = [local_subject(p) for p in self.publish] if self.outside else self.publish
        return {"publish": {"allow": _unique(publish)},
                "subscribe": {"allow": _unique([f"{self.inbox}.>", *self.subscribe])}}


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


#: what every service needs: read stream info and the stored retention limits (services run
#: the idempotent provisioning at start, which only reads when the admin has provisioned), and
#: reply to producers
def _service_base() -> list[str]:
    return [_js("STREAM", "INFO", "*"), *kv_read_permissions(S.BUCKET_CONFIG, S.KEY_RETENTION),
            subject("reply"), subject("tenant_reply"), S.OUTCOMES_ALL]


def admin_role() -> Role:
    return Role("admin", "admin", publish=[">"], subscribe=[">"])


def _admitter_common() -> list[str]:
    """What every admitter publishes, partitioned or not: hand-offs, decisions, the rescue, the
    workers' reports and the pool map, the scaling signal, degraded requests' job records."""
    return _service_base() + [
        S.ADMITTED_ALL, S.OFFLINE_ALL, subject("decision", stage="admission"), S.deadletter("admitter"),
        # rescue (admitter/rescue.py): read and remove what a dead worker left on WORK, read the
        # completions its consumer has not processed yet, and tell a restarted worker which of its
        # predecessor's attempts it must not run (Control handover)
        _js("STREAM", "MSG", "GET", S.STREAM_WORK), _js("STREAM", "MSG", "DELETE", S.STREAM_WORK),
        _js("STREAM", "MSG", "GET", S.STREAM_COMPLETIONS), subject("control"),
        *kv_read_permissions(S.BUCKET_QUOTAS), *kv_read_permissions(S.BUCKET_WORKERS),
        # scaling signals (admitter/scaling.py): the event, and the latest kept for natsched status
        S.SCALE_ALL, _js("STREAM", "INFO", _kv_stream(S.BUCKET_CONFIG)),
        *kv_write_permissions(S.BUCKET_CONFIG, S.KEY_SCALE), *kv_read_permissions(S.BUCKET_CONFIG, S.KEY_POOLS),
        # a degraded request's job record, created before its producer hears the job id (no read)
        *kv_write_permissions(S.BUCKET_JOBS, render(S.PATTERNS["job_key"])),
    ]


def admitter_role() -> Role:
    pub = _admitter_common() + [
        *consumer_permissions(S.STREAM_REQUESTS, S.CONSUMER_ADMITTER, S.REQUESTS_ALL),
        *consumer_permissions(S.STREAM_COMPLETIONS, S.CONSUMER_ADMITTER_COMPLETIONS, S.COMPLETIONS_ALL),
        *kv_snapshot_permissions(S.BUCKET_INFLIGHT), *kv_write_permissions(S.BUCKET_INFLIGHT),
        *kv_write_permissions(S.BUCKET_QUOTAS, S.KEY_DYNAMIC_TOTAL),
    ]
    return Role("admitter", "admitter", publish=pub, subscribe=[S.HEARTBEATS_ALL, S.CANCELS_ALL])


def router_role(pool: str = S.DEFAULT_POOL) -> Role:
    """A router of pool ``pool`` (``natsched.wire.pools``): it may create and pull its own pool's
    consumer only, with its own pool's filter."""
    pub = _service_base() + [
        S.WORK_ALL, subject("completion", worker=S.ROUTER_SOURCE), subject("decision", stage="routing"),
        subject("control"),
        S.deadletter("router"),
        *consumer_permissions(S.STREAM_ADMITTED, S.pool_router(pool), S.pool_admitted(pool)),
        *kv_read_permissions(S.BUCKET_CONFIG, S.KEY_ROUTER_CONFIG), *kv_read_permissions(S.BUCKET_CONFIG, S.KEY_POOLS),
        # learned cost statistics shared between replicas, and the calibrations they start from
        *kv_read_permissions(S.BUCKET_WORKERS), *kv_write_permissions(S.BUCKET_WORKERS, S.COST_KEYS),
    ]
    name = "router" if pool == S.DEFAULT_POOL else S.pool_router(pool)
    return Role(name, "router", publish=pub, subscribe=[S.HEARTBEATS_ALL, S.CACHE_EVENTS_ALL, S.COMPLETIONS_ALL,
                                                                S.CANCELS_ALL])


def scheduler_role() -> Role:
    """An admitter with inline routing (``natsched admitter --route``): both services' rights in
    one process, no more (the union of :func:`admitter_role` and :func:`router_role`)."""
    adm, rtr = admitter_role(), router_role()
    return Role("scheduler", "scheduler", publish=_unique(adm.publish + rtr.publish),
                subscribe=_unique(adm.subscribe + rtr.subscribe))


# --- partitioned admission (issue 27) ----------------------------------------------------------
def partition_admitter_user(partition: int) -> str:
    """The user partition ``partition``'s admitters connect as: ``admitter-p<partition>`` (its
    consumer's name)."""
    return S.partition_admitter(partition)


def coordinator_permissions() -> list[str]:
    """A budget-coordinator candidate (:mod:`natsched.admitter.coordinator`): its lease and the plan
    in bucket ``budget`` (both by compare-and-swap), and reads of the partitions' reports and of
    the quotas in acknowledged windows. Never a report (the partitions'), a quota or a usage key."""
    return [*kv_snapshot_permissions(S.BUCKET_BUDGET), *kv_snapshot_permissions(S.BUCKET_QUOTAS),
            *kv_write_permissions(S.BUCKET_BUDGET, S.KEY_PLAN),
            *kv_write_permissions(S.BUCKET_BUDGET, S.KEY_COORDINATOR)]


def partition_admitter_role(partition: int) -> Role:
    """An admitter of partition ``partition`` (``natsched admitter --partition K --partitions P``):
    the admitter's hand-offs, but only its own partition's consumers (``admitter-p<k>`` created
    with filter ``reqp.<k>.>``, ``admitter-completions-p<k>``), its own bucket ``inflight-p<k>``
    and its own reports ``budget/report.<k>.*``; never ``inflight``, another partition's bucket,
    consumer or report, nor ``cluster.dynamic_total`` (off in a partition).

    Every one is also a coordinator candidate (``natsched up`` runs them so; ``--no-coordinator``
    leaves the rights unused): the plan is no new power, since an admitter that ignored its
    budget could over-admit through its own usage key anyway. Nothing in it depends on P, so the
    same user serves partition ``k`` of any P > k (:func:`roles`)."""
    k = str(partition)
    bucket = S.partition_bucket(k)
    pub = _admitter_common() + [
        *consumer_permissions(S.STREAM_REQUESTS, S.partition_admitter(k), S.partition_requests(k)),
        *consumer_permissions(S.STREAM_COMPLETIONS, S.partition_completions(k), S.COMPLETIONS_ALL),
        *kv_snapshot_permissions(bucket), *kv_write_permissions(bucket),
        *kv_write_permissions(S.BUCKET_BUDGET, render(S.PATTERNS["partition_report_key"], partition=k)),
        *coordinator_permissions(),  # (its plan watch is a read of bucket budget: in there)
    ]
    return Role(partition_admitter_user(partition), "admitter", publish=pub,
                subscribe=[S.HEARTBEATS_ALL, S.CANCELS_ALL])


def coordinator_role() -> Role:
    """``natsched coordinator``: a candidate in a process of its own. Its start-up reads (stream
    infos, the retention key) and :func:`coordinator_permissions`; no request, usage key, report
    or reply. A change of P is the admin's (``natsched up`` provisions it as the admin)."""
    pub = [_js("STREAM", "INFO", "*"), *kv_read_permissions(S.BUCKET_CONFIG, S.KEY_RETENTION),
           *coordinator_permissions()]
    return Role("coordinator", "coordinator", publish=pub)


def partitions_permissions(partitions: int, write: bool) -> list[str]:
    """Every partition's bucket ``inflight-p<k>`` (k < ``partitions``) and the plan in force, for a
    role that admits or reads through every partition: the offline runner (``write``: its
    reservations, ``usage`` and ``res.*``) or the gateway (``usage`` gets only)."""
    out = [*kv_get_permissions(S.BUCKET_BUDGET, S.KEY_PLAN)] if partitions > 1 else []
    for k in range(partitions if partitions > 1 else 0):
        bucket = S.partition_bucket(k)
        if write:
            out += [*kv_read_permissions(bucket), *kv_write_permissions(bucket, S.KEY_USAGE),
                    *kv_write_permissions(bucket, render(S.PATTERNS["reservation_key"]))]
        else:
            out += kv_get_permissions(bucket, S.KEY_USAGE)
    return out


def worker_role(worker: str) -> Role:
    """A worker: completions on its own ``done.*.<worker>`` and replies on its own
    ``resp.*.*.<worker>`` only, so that the server vouches for the worker a completion or a
    reply names (the admitter checks a completion against the assignment's fence, the producer
    a reply against its reply fence: :mod:`natsched.wire.fence`)."""
    S.token(worker, "worker id")
    if worker == S.ROUTER_SOURCE:
        raise ValueError(f"worker id {worker!r} is reserved: the router's own completions use it")
    # replies on its own resp.*.*.<worker> only (not a producer's reply subject itself: that is
    # the services' channel), so a producer can take output from the worker it was assigned to
    # (and a job's outcomes likewise on its own outcome.*.*.*.<worker>: the offline runner checks them)
    base = [p for p in _service_base() if p not in (subject("reply"), subject("tenant_reply"), S.OUTCOMES_ALL)]
    pub = base + [
        subject("tenant_worker_reply", worker=worker), subject("worker_outcome", worker=worker),
        subject("completion", worker=worker), S.heartbeat(worker), S.cache_events(worker), S.deadletter("worker"),
        *consumer_permissions(S.STREAM_WORK, S.worker_consumer(worker), S.work(worker)),
        *kv_read_permissions(S.BUCKET_WORKERS),
    ]
    return Role(f"worker-{worker}", "worker", publish=pub, subscribe=[S.control(worker), S.CANCELS_ALL])


def offline_role(partitions: int = 1) -> Role:
    """The offline runner (admitter/offline.py): takes OFFLINE work when the cluster is idle,
    reserves it in ``inflight`` as an admitter does, hands it to ADMITTED, folds OUTCOMES into
    the job records. It records ``decision.offline.*`` only: admission decisions are the admitter's.
    With ``partitions`` > 1 it admits each job through its tenant's partition: the same rights on
    every ``inflight-p<k>``, and a get of the plan (:func:`partitions_permissions`)."""
    pub = _service_base() + [
        S.ADMITTED_ALL, S.OFFLINE_ALL, subject("decision", stage=S.STAGE_OFFLINE), S.deadletter("offline"),
        *consumer_permissions(S.STREAM_OFFLINE, S.CONSUMER_OFFLINE, S.OFFLINE_ALL),
        *consumer_permissions(S.STREAM_OUTCOMES, S.CONSUMER_OFFLINE_OUTCOMES, S.OUTCOMES_ALL),
        *kv_read_permissions(S.BUCKET_INFLIGHT), *kv_write_permissions(S.BUCKET_INFLIGHT, S.KEY_USAGE),
        *kv_write_permissions(S.BUCKET_INFLIGHT, render(S.PATTERNS["reservation_key"])),
        *kv_read_permissions(S.BUCKET_QUOTAS),
        *kv_pinned_read_permissions(S.BUCKET_JOBS, render(S.PATTERNS["job_key"])),
        *kv_write_permissions(S.BUCKET_JOBS, render(S.PATTERNS["job_key"])),
        *kv_read_permissions(S.BUCKET_CONFIG, S.KEY_POOLS), *partitions_permissions(partitions, write=True),
    ]
    return Role("offline", "offline", publish=pub, subscribe=[S.HEARTBEATS_ALL])


def gateway_role(tenants: list[str], partitions: int = 1) -> Role:
    """The HTTP gateway: a producer for the tenants its API keys map to (requests, their replies,
    their cancels; nothing on the workers' control subjects), plus what ``/v1/models`` and ``/status`` show:
    heartbeats, admission records and completions (no prompts or outputs), quotas and usage (with
    ``partitions`` > 1 every partition's ``usage`` and the plan: :func:`partitions_permissions`)."""
    if not tenants:
        raise ValueError("the gateway role needs at least one tenant")
    records = (S.STREAM_DECISIONS, S.STREAM_COMPLETIONS)
    pub = [*(S.requests_of(t) for t in tenants), *(S.cancels_of(t) for t in tenants),
           *(_js("STREAM", "INFO", st) for st in records), *(_js("STREAM", "MSG", "GET", st) for st in records),
           *filtered_read_permissions(_kv_stream(S.BUCKET_QUOTAS), _kv_key(S.BUCKET_QUOTAS)),
           # the routers' verdicts on workers (half-open, learned rates) for its status page
           *filtered_read_permissions(_kv_stream(S.BUCKET_WORKERS), _kv_key(S.BUCKET_WORKERS, S.COST_KEYS)),
           *kv_get_permissions(S.BUCKET_INFLIGHT, S.KEY_USAGE),
           _js("STREAM", "INFO", S.STREAM_REQUESTS),  # how many partitions (its config; no message)
           *gateway_jobs_permissions(tenants), *partitions_permissions(partitions, write=False)]
    sub = [*(S.replies_of(t) for t in tenants), S.HEARTBEATS_ALL, S.DECISIONS_ALL, S.COMPLETIONS_ALL]
    return Role("gateway", "gateway", publish=pub, subscribe=sub, tenants=list(tenants))


def gateway_jobs_permissions(tenants: list[str]) -> list[str]:
    """What ``GET /v1/natsched/jobs/{id}`` needs: read the job records of the tenants it serves
    (``job.<tenant>.*.*``, pinned: direct gets and filtered consumers name the key), and the reads
    of the job store's idempotent provisioning (the infos of OUTCOMES, ``config`` and ``jobs``,
    and the retention key). Never a write, a manifest (``batch.*``) or another tenant's record;
    a bucket that does not exist yet stays so (creating it is refused: the admin provisions)."""
    streams = (S.STREAM_OUTCOMES, _kv_stream(S.BUCKET_CONFIG), _kv_stream(S.BUCKET_JOBS))
    return [*(_js("STREAM", "INFO", st) for st in streams), *kv_get_permissions(S.BUCKET_CONFIG, S.KEY_RETENTION),
            *(p for t in tenants for p in kv_pinned_read_permissions(
                S.BUCKET_JOBS, render(S.PATTERNS["job_key"], tenant=t)))]


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
           *dict.fromkeys(p for f in S.stored_requests_of(tenant)  # as stored unpartitioned and partitioned
                          for p in filtered_read_permissions(S.STREAM_REQUESTS, f))]
    return Role(f"batch-{tenant}", "batch", publish=pub, tenants=[tenant])


def producer_role(tenant: str) -> Role:
    return Role(f"producer-{S.token(tenant, 'tenant')}", "producer", publish=[S.requests_of(tenant), S.cancels_of(tenant)],
                subscribe=[S.replies_of(tenant)], tenants=[tenant])


def roles(tenants: list[str], workers: list[str], gateway_tenants: list[str] | None = None,
          batch_tenants: list[str] | None = None, offline: bool = True, partitions: int = 1,
          pools: list[str] | tuple[str, ...] = ()) -> list[Role]:
    """Every role to generate; ``gateway_tenants`` / ``batch_tenants`` None: the same as ``tenants``
    (empty: no gateway user / no batch users).

    ``partitions`` (N > 1): the users of partitioned admission for any P <= N: one admitter user
    per partition, ``admitter-p0`` .. ``admitter-p<N-1>`` (each confined to its partition), the
    ``coordinator``, and partition rights for the offline runner and the gateway on
    ``inflight-p0`` .. ``inflight-p<N-1>``. Why enumerated, not wildcards: a NATS wildcard matches
    whole subject tokens, and a partition's names are partial tokens (``inflight-p3``,
    ``admitter-p3``), so a pattern would have to be ``$KV.*.>`` (every bucket, quotas included)
    or a consumer create of any name on ``reqp.*.>`` (any partition's requests, which the
    consumer's acks remove). Why N and not P: partition ``k``'s names do not depend on P, so one
    generated directory serves every P up to N (``natsched up --partitions 2``, later ``4``)
    without new passwords; a P above N is refused by ``natsched up`` (no ``admitter-p<k>`` file).

    ``pools``: one router user per pool, ``router-<pool>`` (:func:`router_role`), besides the
    default pool's ``router``. Producers and workers are the same whatever N and the pools."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    gateway_tenants = tenants if gateway_tenants is None else gateway_tenants
    batch_tenants = tenants if batch_tenants is None else batch_tenants
    split = [*(partition_admitter_role(k) for k in range(partitions)), coordinator_role()] if partitions > 1 else []
    return [admin_role(), admitter_role(), *split, router_role(), *(router_role(p) for p in pools), scheduler_role(),
            *([offline_role(partitions)] if offline else []), *(worker_role(w) for w in workers),
            *([gateway_role(gateway_tenants, partitions)] if gateway_tenants else []),
            *(batch_role(t) for t in batch_tenants), *(producer_role(t) for t in tenants)]
