"""Every subject, stream, consumer and bucket name on the bus — built here and nowhere else.

``subjects.md`` documents each name below; ``tests/wire/test_subjects_doc.py`` keeps the two equal.
"""

from __future__ import annotations

import re

from natsched.wire.ids import TOKEN as _T
from natsched.wire.ids import RequestId, TenantId, WorkerId, is_token, token

# --- request classes (priority subjects) -------------------------------------------------
ONLINE = "online"
BATCH = "batch"
OFFLINE = "offline"
CLASSES = (ONLINE, BATCH, OFFLINE)

# --- streams -----------------------------------------------------------------------------
STREAM_REQUESTS = "REQUESTS"
STREAM_ADMITTED = "ADMITTED"
STREAM_WORK = "WORK"
STREAM_DECISIONS = "DECISIONS"
STREAM_COMPLETIONS = "COMPLETIONS"
STREAM_OFFLINE = "OFFLINE"
STREAM_DEADLETTER = "DEADLETTER"
STREAMS = (
    STREAM_REQUESTS,
    STREAM_ADMITTED,
    STREAM_WORK,
    STREAM_DECISIONS,
    STREAM_COMPLETIONS,
    STREAM_OFFLINE,
    STREAM_DEADLETTER,
)

# --- subject patterns each stream captures ------------------------------------------------
REQUESTS_ALL = "req.>"
ADMITTED_ALL = "adm.>"
WORK_ALL = "work.>"
DECISIONS_ALL = "decision.>"
COMPLETIONS_ALL = "done.>"
OFFLINE_ALL = "offline.>"
DEADLETTER_ALL = "dead.>"
HEARTBEATS_ALL = "worker.*.hb"
CACHE_EVENTS_ALL = "worker.*.kv"
SCALE_ALL = "scale.*"

# --- benchmark-only names (natsched bench pipeline) ---------------------------------------
STREAM_BENCH = "BENCH"  # reference JetStream publish round trips, deleted after the run
BENCH_JS_ALL = "bench.js.>"
BENCH_ECHO = "bench.echo"  # reference core request/reply round trips


def bench_reply(run: str) -> str:
    """Where the pipeline benchmark asks for replies: ``bench.resp.<run>`` (one subscription)."""
    return f"bench.resp.{token(run, 'run id')}"


# --- durable consumers --------------------------------------------------------------------
CONSUMER_ADMITTER = "admitter"
CONSUMER_ADMITTER_COMPLETIONS = "admitter-completions"
CONSUMER_ROUTER = "router"
CONSUMER_WORKER_PREFIX = "worker-"  # + worker id

# --- KV buckets ---------------------------------------------------------------------------
BUCKET_QUOTAS = "quotas"
BUCKET_WORKERS = "workers"
BUCKET_CONFIG = "config"
BUCKET_INFLIGHT = "inflight"
BUCKETS = (BUCKET_QUOTAS, BUCKET_WORKERS, BUCKET_CONFIG, BUCKET_INFLIGHT)

#: key in ``quotas`` holding the cluster total of runtime tokens
KEY_CLUSTER_TOTAL = "cluster.total"
#: key in ``inflight`` holding the shared aggregate usage (updated by compare-and-swap)
KEY_USAGE = "usage"
#: key in ``quotas`` holding the capacity-following total the admitters computed
KEY_DYNAMIC_TOTAL = "cluster.dynamic_total"

#: key in ``config`` holding the routing policy, its weights and the canary (JSON)
KEY_ROUTER_CONFIG = "router"
#: key in ``quotas`` written last by every ``natsched quota set`` / ``rollback``: what changed (JSON),
#: so ``natsched quota rollback`` can undo one edit of several keys
KEY_QUOTA_CHANGE = "change"
#: keys in ``quotas`` holding admission settings set live (``natsched.admitter.knobs``)
SETTING_PREFIX = "setting."


def setting_key(group: str, name: str) -> str:
    """A live admission setting in ``quotas``: ``setting.<group>.<name>`` (JSON value)."""
    return f"{SETTING_PREFIX}{token(group, 'setting group')}.{token(name, 'setting name')}"


#: key in ``config`` holding the latest scaling signal (a ScaleEvent, msgpack), for ``natsched status``
KEY_SCALE = "scale"

# --- headers ------------------------------------------------------------------------------
HDR_MSG_ID = "Nats-Msg-Id"  # JetStream dedup: the request id
HDR_REPLY = "Natsched-Reply"  # reply subject, readable even when the body is not

#: the reply subjects a request may name (``reply_allowed``); groups 1 and 2 capture the tenant
_REPLY = re.compile(rf"resp\.(?:{_T}|({_T})\.{_T})|outcome\.({_T})\.{_T}\.{_T}|bench\.resp\.{_T}")


def request(cls: str, tenant: TenantId) -> str:
    """Where a producer publishes a request: ``req.<class>.<tenant>``."""
    return f"req.{token(cls, 'class')}.{token(tenant, 'tenant')}"


#: the router pool of a deployment with no pool map (``natsched.wire.pools``): every model
DEFAULT_POOL = "all"
#: key in ``config`` holding the router pool map (JSON ``{"<pool>": ["<model>", ...]}``)
KEY_POOLS = "pools"


def admitted(pool: str, cls: str, tenant: TenantId) -> str:
    """Where the admitter forwards an allowed request: ``adm.<pool>.<class>.<tenant>`` (the pool
    routing its model, ``natsched.wire.pools``; :data:`DEFAULT_POOL` without a pool map)."""
    return f"adm.{token(pool, 'pool')}.{token(cls, 'class')}.{token(tenant, 'tenant')}"


def pool_admitted(pool: str) -> str:
    """What router pool ``pool`` consumes from ADMITTED: ``adm.<pool>.>``."""
    return f"adm.{token(pool, 'pool')}.>"


def pool_router(pool: str) -> str:
    """Router pool ``pool``'s durable consumer: ``router-<pool>``; the default pool's is ``router``."""
    return CONSUMER_ROUTER if pool == DEFAULT_POOL else f"{CONSUMER_ROUTER}-{token(pool, 'pool')}"


def work(worker: WorkerId) -> str:
    """A worker's own input subject: ``work.<worker>``."""
    return f"work.{token(worker, 'worker id')}"


def work_owner(subject: str) -> WorkerId | None:
    """The worker whose input ``subject`` is (``work.<worker>``), or None for any other subject."""
    prefix, _, worker = subject.partition(".")
    return WorkerId(worker) if prefix == "work" and is_token(worker) else None


def scale(kind: str) -> str:
    """Where an admitter publishes a scaling signal: ``scale.out`` / ``scale.in`` (core NATS)."""
    return f"scale.{token(kind, 'scale kind')}"


def reply(request_id: RequestId) -> str:
    """The default reply subject for a request: ``resp.<request_id>``."""
    return f"resp.{token(request_id, 'request id')}"


def tenant_reply(tenant: TenantId, request_id: RequestId) -> str:
    """A producer's reply subject under its tenant: ``resp.<tenant>.<request_id>`` (with auth, a
    producer may subscribe to its own tenant's replies only)."""
    return f"resp.{token(tenant, 'tenant')}.{token(request_id, 'request id')}"


def worker_reply(reply: str, worker: WorkerId) -> str:
    """Where a worker answers a request whose reply subject is ``reply``: its own sub-subject
    ``<reply>.<worker>`` of a ``resp.`` reply (``resp.<tenant>.<request_id>.<worker>``), so that a
    per-worker permission (``resp.*.*.<worker>``) makes the server vouch for which worker sent it
    and the producer can take output only from the worker its request was assigned to
    (``natsched.wire.fence.reply_problem``). A job's outcome subject gets the same sub-subject
    (``outcome.<tenant>.<batch>.<job_id>.<worker>``: the offline runner checks it alike, issue 26);
    benchmark replies are kept as they are."""
    if reply.startswith(("resp.", "outcome.")):
        return f"{reply}.{token(worker, 'worker id')}"
    return reply


def tenant_worker_reply(tenant: TenantId, request_id: RequestId, worker: WorkerId) -> str:
    """A worker's answers to a producer's request: ``resp.<tenant>.<request_id>.<worker>``
    (:func:`worker_reply` of :func:`tenant_reply`)."""
    return worker_reply(tenant_reply(tenant, request_id), worker)


def reply_source(subject: str, reply: str) -> str | None:
    """The worker a message on ``subject`` came from when ``reply`` is the request's reply subject
    (``<reply>.<worker>``), or None for the reply subject itself (the services' channel)."""
    if subject == reply or not subject.startswith(reply + "."):
        return None
    worker = subject[len(reply) + 1:]
    return worker if is_token(worker) else None


def replies_of(tenant: TenantId) -> str:
    """Every reply to one tenant: ``resp.<tenant>.>``."""
    return f"resp.{token(tenant, 'tenant')}.>"


def reply_allowed(reply: str, tenant: str | None = None) -> bool:
    """Whether a request of ``tenant`` may name ``reply`` as its reply subject.

    Services publish replies with their own (broad) rights, so a reply subject is a capability:
    only ``resp.<id>``, ``resp.<tenant>.<id>``, ``outcome.<tenant>.<batch>.<job>`` and
    ``bench.resp.<run>`` are accepted, never another tenant's, a KV key or a stream subject.
    ``tenant=None`` accepts any tenant's.
    """
    m = _REPLY.fullmatch(reply)  # one match: it runs on every request decoded
    if m is None:
        return False
    owner = m.group(1) or m.group(2)  # resp.<id> and bench.resp.<run> belong to no tenant
    return tenant is None or owner is None or owner == tenant


def decision(stage: str, tenant: TenantId) -> str:
    """An audit record: ``decision.<stage>.<tenant>`` (stage = admission | routing)."""
    return f"decision.{token(stage, 'stage')}.{token(tenant, 'tenant')}"


#: the ``<worker>`` of a completion the router publishes itself (no worker could take it);
#: ``natsched auth init`` refuses it as a worker id
ROUTER_SOURCE = "_router"


def completion(tenant: TenantId, worker: WorkerId) -> str:
    """A completion record: ``done.<tenant>.<worker>`` (the worker that ran it, or
    :data:`ROUTER_SOURCE`). The worker is in the subject so that a per-worker permission
    (``done.*.<worker>``) makes the server vouch for who published it."""
    return f"done.{token(tenant, 'tenant')}.{token(worker, 'worker id')}"


def completions_of(tenant: TenantId) -> str:
    """A filter over one tenant's completions from any worker: ``done.<tenant>.*``."""
    return f"done.{token(tenant, 'tenant')}.*"


def completion_source(subject: str) -> str | None:
    """The worker a ``done.<tenant>.<worker>`` subject names, or None for any other subject."""
    parts = subject.split(".")
    return parts[2] if len(parts) == 3 and parts[0] == "done" and is_token(parts[2]) else None


def offline(tenant: TenantId) -> str:
    """Degraded / offline work: ``offline.<tenant>``."""
    return f"offline.{token(tenant, 'tenant')}"


def deadletter(source: str) -> str:
    """A message no handler could use: ``dead.<source>`` (source = the service that gave up)."""
    return f"dead.{token(source, 'source')}"


def heartbeat(worker: WorkerId) -> str:
    return f"worker.{token(worker, 'worker id')}.hb"


def cache_events(worker: WorkerId) -> str:
    return f"worker.{token(worker, 'worker id')}.kv"


def control(worker: WorkerId) -> str:
    """Control messages to one worker (drain, snapshot): ``worker.<id>.ctl``."""
    return f"worker.{token(worker, 'worker id')}.ctl"


#: every cancel, whoever's: what the admitters, routers and workers listen to
CANCELS_ALL = "cancel.>"


def cancel(tenant: TenantId, request_id: RequestId) -> str:
    """A producer gave up on its request: ``cancel.<tenant>.<request_id>`` (core NATS).

    Per tenant, so the server can let a producer (or the gateway) cancel its own tenant's
    requests and nothing else: the services act on a cancel only for a request whose tenant is
    the subject's, and the subject, not the body, says who may (``natsched.wire.roles``).
    """
    return f"cancel.{token(tenant, 'tenant')}.{token(request_id, 'request id')}"


def cancels_of(tenant: TenantId) -> str:
    """Every cancel of one tenant: ``cancel.<tenant>.*`` (what its producer may publish)."""
    return f"cancel.{token(tenant, 'tenant')}.*"


def parse_cancel_subject(subject: str) -> tuple[TenantId, RequestId] | None:
    """``cancel.<tenant>.<request_id>`` -> (tenant, request id), or None if it is not one."""
    parts = subject.split(".")
    if len(parts) != 3 or parts[0] != "cancel" or not (is_token(parts[1]) and is_token(parts[2])):
        return None
    return TenantId(parts[1]), RequestId(parts[2])


def worker_consumer(worker: WorkerId) -> str:
    return CONSUMER_WORKER_PREFIX + token(worker, "worker id")


def tenant_quota_key(tenant: TenantId) -> str:
    return f"tenant.{token(tenant, 'tenant')}"


#: NATS KV's own naming: bucket ``B`` is stream ``KV_B``, its key ``K`` is stored on ``$KV.B.K``
KV_STREAM_PREFIX = "KV_"
KV_SUBJECT_PREFIX = "$KV"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a KV bucket stores ``key`` on (a put is a JetStream publish there); ``key``
    may be a filter (``>``, ``job.A.*.*``)."""
    return f"{KV_SUBJECT_PREFIX}.{bucket}.{key}"


def kv_stream(bucket: str) -> str:
    """The stream that holds a KV bucket: ``KV_<bucket>``."""
    return KV_STREAM_PREFIX + bucket


def reservation_key(request_id: RequestId) -> str:
    """One in-flight reservation in the ``inflight`` bucket: ``res.<request_id>``."""
    return f"res.{token(request_id, 'request id')}"


#: every subject builder's shape, as written in subjects.md (the doc test renders each one)
PATTERNS = {
    "request": "req.<class>.<tenant>",
    "admitted": "adm.<pool>.<class>.<tenant>",
    "pool_admitted": "adm.<pool>.>",
    "pool_router": "router-<pool>",
    "work": "work.<worker>",
    "reply": "resp.<request_id>",
    "decision": "decision.<stage>.<tenant>",
    "completion": "done.<tenant>.<worker>",
    "completions_of": "done.<tenant>.*",
    "offline": "offline.<tenant>",
    "deadletter": "dead.<source>",
    "heartbeat": "worker.<worker>.hb",
    "cache_events": "worker.<worker>.kv",
    "control": "worker.<worker>.ctl",
    "cancel": "cancel.<tenant>.<request_id>",
    "cancels_of": "cancel.<tenant>.*",
    "worker_consumer": "worker-<worker>",
    "tenant_quota_key": "tenant.<tenant>",
    "reservation_key": "res.<request_id>",
    "tenant_reply": "resp.<tenant>.<request_id>",
    "replies_of": "resp.<tenant>.>",
    "tenant_worker_reply": "resp.<tenant>.<request_id>.<worker>",
    "bench_reply": "bench.resp.<run>",
    "calibration_key": "capacity.<model>.<deployment>",
    "scale": "scale.<kind>",
    "setting_key": "setting.<group>.<name>",
}


_KV_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def _kv_part(value: str) -> str:
    """A reversible, KV-key-safe spelling (``.`` and ``/`` in model names become ``=2E``, ``=2F``)."""
    return _KV_UNSAFE.sub(lambda m: "".join(f"={b:02X}" for b in m.group().encode()), value) or "=00"


#: a router replica's learned statistics of one worker (natsched.router.learned): ``cost.<worker>.<replica>``
COST_KEYS = "cost.>"


def cost_key(worker: str, replica: str) -> str:
    """Bucket ``workers`` key of ``replica``'s cost statistics of ``worker`` (both single tokens)."""
    return f"cost.{worker}.{replica}"


def parse_cost_key(key: str) -> tuple[str, str] | None:
    """``cost.<worker>.<replica>`` -> (worker, replica), or None."""
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "cost" or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def calibration_key(model: str, deployment: str) -> str:
    """A calibrated capacity in bucket ``workers``: ``capacity.<model>.<deployment>`` (parts escaped)."""
    return f"capacity.{_kv_part(model)}.{_kv_part(deployment)}"


def parse_request_subject(subject: str) -> tuple[str, str] | None:
    """``req.<class>.<tenant>`` -> (class, tenant), or None if it is not one."""
    parts = subject.split(".")
    if len(parts) != 3 or parts[0] != "req":
        return None
    return parts[1], parts[2]


# --- batch producers, the offline runner, jobs (issue 7) ----------------------------------
#: replies to batch and offline jobs: core publishes that JetStream keeps until the offline
#: runner has folded them into the job store, so no result is lost while it restarts
STREAM_OUTCOMES = "OUTCOMES"
OUTCOMES_ALL = "outcome.>"
CONSUMER_OFFLINE = "offline-runner"  # OFFLINE -> the offline runner replicas
CONSUMER_OFFLINE_OUTCOMES = "offline-outcomes"  # OUTCOMES -> the offline runner replicas
#: job records (``job.<tenant>.<batch>.<job_id>``) and batch manifests (``batch.<batch>``)
BUCKET_JOBS = "jobs"
#: key in ``config`` holding operator overrides of stream limits (``natsched retention set``)
KEY_RETENTION = "retention"
#: the ``<batch>`` token of jobs that belong to no batch (offline work from single requests)
NO_BATCH = "-"
#: the decision stage the offline runner records (``decision.offline.<tenant>``)
STAGE_OFFLINE = "offline"


def outcome(tenant: TenantId, batch: str, job_id: RequestId) -> str:
    """Where a batch or offline job's replies go: ``outcome.<tenant>.<batch>.<job_id>``."""
    return f"outcome.{token(tenant, 'tenant')}.{token(batch, 'batch id')}.{token(job_id, 'job id')}"


def parse_outcome_subject(subject: str) -> tuple[str, str, str] | None:
    """``outcome.<tenant>.<batch>.<job_id>`` -> (tenant, batch, job id), or None if it is not one."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != "outcome" or not all(is_token(p) for p in parts[1:]):
        return None
    return parts[1], parts[2], parts[3]


def worker_outcome(tenant: TenantId, batch: str, job_id: RequestId, worker: WorkerId) -> str:
    """A worker's replies to a job: ``outcome.<tenant>.<batch>.<job_id>.<worker>`` (:func:`worker_reply`
    of :func:`outcome`)."""
    return worker_reply(outcome(tenant, batch, job_id), worker)


def parse_stored_outcome(subject: str) -> tuple[tuple[str, str, str], str | None] | None:
    """An OUTCOMES subject -> ((tenant, batch, job id), the worker that sent it or None), or None:
    ``outcome.<tenant>.<batch>.<job_id>`` is the services' (statuses, refusals), and
    ``outcome.<tenant>.<batch>.<job_id>.<worker>`` a worker's own (:func:`worker_reply`)."""
    parts = subject.split(".")
    if len(parts) not in (4, 5) or parts[0] != "outcome" or not all(is_token(p) for p in parts[1:]):
        return None
    return (parts[1], parts[2], parts[3]), (parts[4] if len(parts) == 5 else None)


def job_key(tenant: TenantId, batch: str, job_id: RequestId) -> str:
    """A job record in bucket ``jobs``: ``job.<tenant>.<batch>.<job_id>``."""
    return f"job.{token(tenant, 'tenant')}.{token(batch, 'batch id')}.{token(job_id, 'job id')}"


def batch_key(batch: str) -> str:
    """A batch manifest in bucket ``jobs``: ``batch.<batch>``."""
    return f"batch.{token(batch, 'batch id')}"


PATTERNS.update({
    "outcome": "outcome.<tenant>.<batch>.<job_id>",
    "worker_outcome": "outcome.<tenant>.<batch>.<job_id>.<worker>",
    "job_key": "job.<tenant>.<batch>.<job_id>",
    "batch_key": "batch.<batch>",
})


def requests_of(tenant: TenantId) -> str:
    """A filter over one tenant's requests of every class: ``req.*.<tenant>`` (audit, replay)."""
    return f"req.*.{token(tenant, 'tenant')}"


def decisions_of(tenant: TenantId) -> str:
    """A filter over one tenant's decisions of every stage: ``decision.*.<tenant>`` (audit)."""
    return f"decision.*.{token(tenant, 'tenant')}"


PATTERNS.update({"requests_of": "req.*.<tenant>", "decisions_of": "decision.*.<tenant>"})



def job_filter(tenant: str = "*", batch: str = "*", job_id: str = "*") -> str:
    """A key filter over job records (``job.<tenant>.<batch>.<job_id>``), ``*`` where any will do."""
    parts = [p if p == "*" else token(p, what) for p, what in ((tenant, "tenant"), (batch, "batch id"),
                                                                (job_id, "job id"))]
    return "job." + ".".join(parts)


# --- partitioned admission (issue 27: natsched.admitter.budget, natsched.admitter.coordinator) --
#: the subjects REQUESTS stores requests under once it is partitioned: the stream's subject
#: transform (``natsched.bus.provision.set_partitions``) rewrites ``req.<class>.<tenant>`` to
#: ``reqp.<partition>.<class>.<tenant>`` with nats-server's own ``partition()`` hash of the tenant
PARTITIONED_PREFIX = "reqp"
#: hierarchical budget: the coordinator's plan, its lease, and each partition replica's report
BUCKET_BUDGET = "budget"
#: key in ``budget``: the plan in force (JSON ``{"epoch", "total", "grants": {"<partition>": tokens}}``)
KEY_PLAN = "plan"
#: key in ``budget``: the coordinator lease (JSON ``{"holder", "until"}``, renewed by compare-and-swap)
KEY_COORDINATOR = "coordinator"
#: every partition report in ``budget`` (``report.<partition>.<replica>``)
REPORTS_ALL = "report.>"


def _partition(partition: int | str) -> str:
    return token(str(partition), "partition")


def partition_requests(partition: int | str) -> str:
    """What partition ``partition``'s admitters consume from REQUESTS: ``reqp.<partition>.>``."""
    return f"{PARTITIONED_PREFIX}.{_partition(partition)}.>"


def partition_admitter(partition: int | str) -> str:
    """Partition ``partition``'s durable consumer of its requests: ``admitter-p<partition>``."""
    return f"{CONSUMER_ADMITTER}-p{_partition(partition)}"


def partition_completions(partition: int | str) -> str:
    """Partition ``partition``'s durable consumer of completions: ``admitter-completions-p<partition>``."""
    return f"{CONSUMER_ADMITTER_COMPLETIONS}-p{_partition(partition)}"


def partition_bucket(partition: int | str) -> str:
    """Partition ``partition``'s own in-flight bucket, ``inflight-p<partition>``: its ``usage`` key and
    its requests' ``res.`` records, as ``inflight`` holds them unpartitioned. A bucket of its own,
    not a key of ``inflight``: a bucket is one stream, which orders all its writes (and has one
    leader in a cluster), so partitions sharing one would still queue behind each other."""
    return f"{BUCKET_INFLIGHT}-p{_partition(partition)}"


def partition_report_key(partition: int | str, replica: str) -> str:
    """What one replica of a partition reports to the coordinator: ``report.<partition>.<replica>``."""
    return f"report.{_partition(partition)}.{token(replica, 'replica name')}"


def parse_partitioned_subject(subject: str) -> tuple[int, str] | None:
    """``reqp.<partition>.<class>.<tenant>`` -> (partition, ``req.<class>.<tenant>``), or None."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != PARTITIONED_PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1]), f"req.{parts[2]}.{parts[3]}"


PATTERNS.update({
    "partition_requests": "reqp.<partition>.>",
    "partition_admitter": "admitter-p<partition>",
    "partition_completions": "admitter-completions-p<partition>",
    "partition_bucket": "inflight-p<partition>",
    "partition_report_key": "report.<partition>.<replica>",
})


def partitioned_requests_of(tenant: TenantId, cls: str = "*") -> str:
    """A filter over one tenant's requests as a partitioned REQUESTS stores them, in whichever
    partition and under whichever partition count: ``reqp.*.<class>.<tenant>`` (the partition
    token wildcarded, so a reader needs neither P nor the hash, and requests stored before P
    changed are still found)."""
    return f"{PARTITIONED_PREFIX}.*.{_class_filter(cls)}.{token(tenant, 'tenant')}"


def stored_requests_of(tenant: TenantId, cls: str = "*") -> tuple[str, str]:
    """Every filter a reader of REQUESTS needs for one tenant's requests (of class ``cls``, ``*``:
    all), whatever the partitioning: ``req.<class>.<tenant>`` as stored unpartitioned and
    ``reqp.*.<class>.<tenant>`` as stored partitioned. Both, always: the stream may hold either
    (P changed on a drained system keeps the older subjects for the retention's days), and the
    two never overlap, so one consumer may take both (``filter_subjects``). Not what a producer
    publishes to (:func:`requests_of`: its permission)."""
    return f"req.{_class_filter(cls)}.{token(tenant, 'tenant')}", partitioned_requests_of(tenant, cls)


def _class_filter(cls: str) -> str:
    return cls if cls == "*" else token(cls, "class")


PATTERNS.update({"partitioned_requests_of": "reqp.*.*.<tenant>"})
