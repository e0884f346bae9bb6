"""Idempotent provisioning of every stream and KV bucket, with explicit retention and limits.

Run by every service at start (cheap when all exists) and by ``natsched up``. An existing
stream is updated to the configured limits; one whose retention cannot be changed in place
raises :class:`ProvisionError` with what differs, rather than running on a surprise config.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field

from nats.js import api
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError, ServerError

from natsched.wire import subjects as S
from natsched.bus.errors import ProvisionError

log = logging.getLogger(__name__)

DAY = 24 * 3600.0
MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass
class StreamLimits:
    """Retention of one stream: messages older than ``max_age_s`` or beyond ``max_bytes`` go first."""

    max_age_s: float
    max_bytes: int


@dataclass
class ProvisionSettings:
    """Replicas and limits; the defaults keep a week of audit data within a few GiB of disk."""

    #: None: 3 on a cluster of 3 or more nodes, else 1 (:func:`auto_replicas`); automatic
    #: replicas never scale an existing stream down
    replicas: int | None = None
    dedup_window_s: float = 120.0
    max_msg_bytes: int = 1 * MiB
    limits: dict[str, StreamLimits] = field(
        default_factory=lambda: {
            S.STREAM_REQUESTS: StreamLimits(7 * DAY, 1 * GiB),
            S.STREAM_ADMITTED: StreamLimits(1 * DAY, 256 * MiB),
            S.STREAM_WORK: StreamLimits(1 * DAY, 256 * MiB),
            S.STREAM_DECISIONS: StreamLimits(7 * DAY, 1 * GiB),
            S.STREAM_COMPLETIONS: StreamLimits(7 * DAY, 1 * GiB),
            S.STREAM_OFFLINE: StreamLimits(30 * DAY, 1 * GiB),
            S.STREAM_DEADLETTER: StreamLimits(30 * DAY, 256 * MiB),
        }
    )


# stream -> (subjects, retention, why)
_STREAMS: dict[str, tuple[list[str], api.RetentionPolicy]] = {
    # LIMITS: the request log is kept for audit and replay; the admitter's durable consumer
    # tracks what it has handled.
    S.STREAM_REQUESTS: ([S.REQUESTS_ALL], api.RetentionPolicy.LIMITS),
    # WORK_QUEUE: a hand-off between stages; deleted once a router/worker acks it.
    S.STREAM_ADMITTED: ([S.ADMITTED_ALL], api.RetentionPolicy.WORK_QUEUE),
    S.STREAM_WORK: ([S.WORK_ALL], api.RetentionPolicy.WORK_QUEUE),
    S.STREAM_DECISIONS: ([S.DECISIONS_ALL], api.RetentionPolicy.LIMITS),
    S.STREAM_COMPLETIONS: ([S.COMPLETIONS_ALL], api.RetentionPolicy.LIMITS),
    S.STREAM_OFFLINE: ([S.OFFLINE_ALL], api.RetentionPolicy.WORK_QUEUE),
    S.STREAM_DEADLETTER: ([S.DEADLETTER_ALL], api.RetentionPolicy.LIMITS),
}

# bucket -> (history, ttl seconds or None)
_BUCKETS: dict[str, tuple[int, float | None]] = {
    S.BUCKET_QUOTAS: (10, None),  # quota edits keep 10 revisions for rollback/audit
    S.BUCKET_WORKERS: (1, None),  # calibrated capacities per model/deployment
    S.BUCKET_CONFIG: (10, None),  # routing policy and weights, switchable live
    S.BUCKET_INFLIGHT: (1, None),  # shared usage + one key per reservation (admitter replicas)
    S.BUCKET_BUDGET: (1, None),  # partitioned admission only (set_partitions): plan, lease, reports
}


_PARTITION_BUCKET = re.compile(r"-p[0-9]+$")


def bucket_history(bucket: str) -> int:
    """Revisions kept per key in ``bucket`` (what a rollback can reach)."""
    return _BUCKETS[bucket][0]


def stream_config(name: str, settings: ProvisionSettings) -> api.StreamConfig:
    subjects, retention = _STREAMS[name]
    limits = settings.limits[name]
    return api.StreamConfig(
        name=name,
        subjects=subjects,
        retention=retention,
        storage=api.StorageType.FILE,
        max_age=limits.max_age_s,
        max_bytes=limits.max_bytes,
        max_msg_size=settings.max_msg_bytes,
        discard=api.DiscardPolicy.OLD,
        duplicate_window=settings.dedup_window_s,
        num_replicas=settings.replicas,
    )


#: what provisioning sets on a stream; when an existing stream already has all of it, nothing is
#: written (a service whose credentials may only read stream info starts without a refusal)
_MANAGED = ("subjects", "retention", "storage", "max_age", "max_bytes", "max_msg_size", "discard",
            "duplicate_window", "num_replicas")


def cluster_nodes(js) -> int:
    """How many servers the connected cluster has (1 when not clustered).

    From the server's INFO (``cluster`` set, ``connect_urls`` = every node's client URL) and the
    client's server pool, which later INFO updates extend.
    """
    nc = getattr(js, "_nc", None)
    info = getattr(nc, "_server_info", None) or {}
    if not info.get("cluster"):
        return 1
    urls = {str(u) for u in info.get("connect_urls") or []}
    urls |= {u.netloc for u in getattr(nc, "servers", [])}
    return max(1, len(urls))


def auto_replicas(js) -> int:
    """3 on a cluster of 3 or more nodes (a majority survives one node lost), else 1."""
    return 3 if cluster_nodes(js) >= 3 else 1


#: JetStream's err_code when a stream's max_bytes does not fit in what the server may still reserve
JS_INSUFFICIENT_STORAGE = 10047


def _no_room(name: str, max_bytes: int) -> ProvisionError:
    return ProvisionError(
        f"stream {name} needs {max_bytes / GiB:.2f} GiB of JetStream file storage and the server has no room "
        f"left for it (natsched's streams and buckets reserve {total_reserved() / GiB:.1f} GiB): free disk, give "
        f"nats-server a larger max_file_store, or lower the limits (natsched retention set)")


async def _add_stream(js, config: api.StreamConfig, attempts: int = 5) -> None:
    """Create a stream; the server may briefly refuse ("error creating store") right after a
    stream of the same name was deleted, while it still removes the old files."""
    for attempt in range(attempts):
        try:
            await js.add_stream(config)
            return
        except ServerError as exc:
            if exc.err_code == JS_INSUFFICIENT_STORAGE:
                raise _no_room(config.name, config.max_bytes) from None
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))


async def ensure_stream(js, config: api.StreamConfig) -> None:
    auto = config.num_replicas is None
    if auto:
        config.num_replicas = auto_replicas(js)
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await _add_stream(js, config)
        log.info("created stream %s (replicas %d)", config.name, config.num_replicas)
        return
    if info.config.retention != config.retention:
        raise ProvisionError(
            f"stream {config.name} exists with retention {info.config.retention}, expected "
            f"{config.retention}; delete it (data loss) or point natsched at another server"
        )
    if auto and (info.config.num_replicas or 1) > config.num_replicas:
        config.num_replicas = info.config.num_replicas
    if all(getattr(info.config, k) == getattr(config, k) for k in _MANAGED):
        return
    # the partition transform is set by set_partitions alone: a service provisioning with its
    # defaults keeps it (or it would undo a partitioned deployment's routing on every start)
    config.subject_transform = info.config.subject_transform
    try:
        await js.update_stream(config)
    except BadRequestError as exc:
        raise ProvisionError(f"stream {config.name} cannot be updated to natsched's config: {exc}") from exc
    except ServerError as exc:
        if exc.err_code == JS_INSUFFICIENT_STORAGE:
            raise _no_room(config.name, config.max_bytes) from None
        raise


async def ensure_bucket(js, bucket: str, replicas: int | None) -> None:
    """Create the bucket; an existing one is only ever scaled up (``replicas`` None: automatic)."""
    history, ttl = _BUCKETS[_PARTITION_BUCKET.sub("", bucket)]  # inflight-p<k>: as inflight
    replicas = auto_replicas(js) if replicas is None else replicas
    try:
        await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    else:
        info = await js.stream_info(f"KV_{bucket}")
        if not info.config.allow_msg_ttl:  # made by an older client: needed for expiring tombstones
            info.config.allow_msg_ttl = True
            await js.update_stream(info.config)
            log.info("bucket %s now allows per-message TTLs", bucket)
        if replicas > 1:
            if (info.config.num_replicas or 1) < replicas:
                info.config.num_replicas = replicas
                await js.update_stream(info.config)
                log.info("bucket %s scaled to %d replicas", bucket, replicas)
        return
    try:
        await js.create_key_value(api.KeyValueConfig(bucket=bucket, history=history, ttl=ttl, replicas=replicas))
    except ServerError as exc:
        if exc.err_code == JS_INSUFFICIENT_STORAGE:
            raise _no_room(f"KV_{bucket}", 0) from None
        raise
    log.info("created bucket %s", bucket)


async def provision(js, settings: ProvisionSettings | None = None) -> None:
    """Create or update every stream and bucket natsched uses. Safe to run concurrently."""
    settings = settings or ProvisionSettings()
    for name in S.STREAMS:
        await ensure_stream(js, stream_config(name, settings))
    for bucket in S.BUCKETS:
        await ensure_bucket(js, bucket, settings.replicas)


# --- batch / offline jobs, retention overrides (issue 7) ------------------------------------
# Not in S.STREAMS / ProvisionSettings.limits (yet): provision_jobs() below creates them, and the
# batch producer and the offline runner call it at start.

#: OUTCOMES: work queue, deleted once the offline runner folded a reply into the job store; the
#: limits only matter while no runner runs (a week of replies, at most 1 GiB).
_STREAMS[S.STREAM_OUTCOMES] = ([S.OUTCOMES_ALL], api.RetentionPolicy.WORK_QUEUE)
JOB_STREAM_LIMITS: dict[str, StreamLimits] = {S.STREAM_OUTCOMES: StreamLimits(7 * DAY, 1 * GiB)}


@dataclass
class JobStoreLimits:
    """Bucket ``jobs``: a record lives ``max_age_s`` after its last change (results stay
    retrievable a month after the producer left); beyond ``max_bytes`` new writes are refused
    (KV buckets discard new), never old results silently dropped."""

    max_age_s: float = 30 * DAY
    max_bytes: int = 4 * GiB
    max_value_bytes: int = 1 * MiB


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` -> seconds (> 0); ValueError otherwise."""
    units = {"s": 1, "m": 60, "h": 3600, "d": DAY, "w": 7 * DAY}
    raw = text.strip().lower()
    scale = units.get(raw[-1:], None)
    number = raw[:-1] if scale else raw
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise ValueError(f"duration {text!r} is not a number with an optional unit s, m, h, d or w") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"duration {text!r} must be > 0")
    return value


def parse_size(text: str) -> int:
    """``1073741824``, ``512MiB``, ``4GiB``, ``1TiB`` (also KB/MB/GB, powers of 10) -> bytes (> 0)."""
    units = {"kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024 * GiB, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    raw = text.strip().lower().replace(" ", "")
    for suffix, scale in units.items():
        if raw.endswith(suffix):
            raw, unit = raw[: -len(suffix)], scale
            break
    else:
        unit = 1
    try:
        value = int(float(raw) * unit)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with an optional unit (KiB, MiB, GiB, TiB)") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be > 0")
    return value


def fmt_age(seconds: float) -> str:
    """The inverse of :func:`parse_duration` for whole units: ``604800`` -> ``7d`` (0: ``ever``)."""
    if not seconds:
        return "ever"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def fmt_size(n: int | None) -> str:
    """The inverse of :func:`parse_size`: ``1073741824`` -> ``1 GiB`` (None or < 0: unlimited)."""
    if n is None or n < 0:
        return "unlimited bytes"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def retention_targets() -> tuple[str, ...]:
    """Every stream whose limits an operator may set, and the ``jobs`` bucket."""
    return (*S.STREAMS, S.STREAM_OUTCOMES, S.BUCKET_JOBS)


def default_limits(target: str) -> StreamLimits:
    limits = ProvisionSettings().limits
    if target == S.BUCKET_JOBS:
        jobs = JobStoreLimits()
        return StreamLimits(jobs.max_age_s, jobs.max_bytes)
    return limits[target] if target in limits else JOB_STREAM_LIMITS[target]


def overrides_from_json(raw: bytes) -> dict[str, StreamLimits]:
    """The ``config``/``retention`` value: ``{"STREAM": {"max_age_s": s, "max_bytes": n}}``.
    Unknown streams and unusable values raise ValueError naming them."""
    import orjson

    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"retention overrides are not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("retention overrides must be a JSON object keyed by stream")
    out: dict[str, StreamLimits] = {}
    for stream, value in data.items():
        if stream not in retention_targets():
            raise ValueError(f"unknown stream {stream!r} in retention overrides")
        if not isinstance(value, dict):
            raise ValueError(f"retention of {stream} must be an object with max_age_s and max_bytes")
        age, size = value.get("max_age_s"), value.get("max_bytes")
        if not isinstance(age, (int, float)) or isinstance(age, bool) or age <= 0:
            raise ValueError(f"{stream}.max_age_s must be a number of seconds > 0, got {age!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"{stream}.max_bytes must be an integer > 0, got {size!r}")
        out[stream] = StreamLimits(float(age), size)
    return out


def overrides_to_json(overrides: dict[str, StreamLimits]) -> bytes:
    import orjson

    return orjson.dumps({k: {"max_age_s": v.max_age_s, "max_bytes": v.max_bytes} for k, v in sorted(overrides.items())})


async def stored_overrides(js) -> dict[str, StreamLimits]:
    """What ``natsched retention set`` stored (empty when nothing, or when the value is unusable:
    a broken override must not stop a service from starting; it is logged)."""
    try:
        kv = await js.key_value(S.BUCKET_CONFIG)
        entry = await kv.get(S.KEY_RETENTION)
    except Exception:  # no bucket yet, no key: defaults
        return {}
    try:
        return overrides_from_json(entry.value or b"{}")
    except ValueError as exc:
        log.error("ignoring stored retention overrides: %s", exc)
        return {}


async def stored_settings(js, base: ProvisionSettings | None = None) -> ProvisionSettings:
    """``base`` (defaults) with the stored overrides applied: what every provisioner should use,
    so a service restart does not undo ``natsched retention set``."""
    settings = base or ProvisionSettings()
    for stream, limits in (await stored_overrides(js)).items():
        if stream in settings.limits:
            settings.limits[stream] = limits
    return settings


def job_stream_config(name: str, settings: ProvisionSettings, limits: StreamLimits) -> api.StreamConfig:
    subjects, retention = _STREAMS[name]
    return api.StreamConfig(
        name=name, subjects=subjects, retention=retention, storage=api.StorageType.FILE,
        max_age=limits.max_age_s, max_bytes=limits.max_bytes, max_msg_size=settings.max_msg_bytes,
        discard=api.DiscardPolicy.OLD, duplicate_window=settings.dedup_window_s, num_replicas=settings.replicas,
    )


async def ensure_jobs_bucket(js, limits: JobStoreLimits, replicas: int | None) -> None:
    """Create bucket ``jobs`` (history 1) or bring its limits to ``limits`` (replicas None: automatic).

    With direct gets allowed: a direct get names the key in its subject
    (``$JS.API.DIRECT.GET.KV_jobs.$KV.jobs.<key>``), so a permission can let a tenant's batch role
    read its own job records and no others (a plain get carries the key in the body).
    """
    replicas = auto_replicas(js) if replicas is None else replicas
    try:
        await js.key_value(S.BUCKET_JOBS)
    except BucketNotFoundError:
        try:
            await js.create_key_value(api.KeyValueConfig(
                bucket=S.BUCKET_JOBS, history=1, ttl=limits.max_age_s, max_bytes=limits.max_bytes,
                max_value_size=limits.max_value_bytes, replicas=replicas, direct=True))
        except ServerError as exc:
            if exc.err_code == JS_INSUFFICIENT_STORAGE:
                raise _no_room(f"KV_{S.BUCKET_JOBS}", limits.max_bytes) from None
            raise
        log.info("created bucket %s", S.BUCKET_JOBS)
        return
    info = await js.stream_info(f"KV_{S.BUCKET_JOBS}")
    config = info.config
    if (config.max_age, config.max_bytes, bool(config.allow_direct)) != (limits.max_age_s, limits.max_bytes, True):
        config.max_age, config.max_bytes, config.allow_direct = limits.max_age_s, limits.max_bytes, True
        await js.update_stream(config)


async def apply_retention(js, target: str, limits: StreamLimits) -> None:
    """Bring ``target`` (a stream, or bucket ``jobs``) to ``limits`` now, other settings as stored."""
    settings = await stored_settings(js)
    if target == S.BUCKET_JOBS:
        await ensure_jobs_bucket(js, JobStoreLimits(limits.max_age_s, limits.max_bytes), settings.replicas)
    elif target in settings.limits:
        await ensure_stream(js, stream_config(target, settings))
    else:
        await ensure_stream(js, job_stream_config(target, settings, limits))


async def provision_jobs(js, settings: ProvisionSettings | None = None, jobs: JobStoreLimits | None = None) -> None:
    """Create or update OUTCOMES and bucket ``jobs`` (idempotent, safe to run concurrently)."""
    settings = settings or ProvisionSettings()
    overrides = await stored_overrides(js)
    for name, limits in JOB_STREAM_LIMITS.items():
        await ensure_stream(js, job_stream_config(name, settings, overrides.get(name, limits)))
    await ensure_bucket(js, S.BUCKET_CONFIG, settings.replicas)
    if jobs is None and S.BUCKET_JOBS in overrides:
        stored = overrides[S.BUCKET_JOBS]
        jobs = JobStoreLimits(max_age_s=stored.max_age_s, max_bytes=stored.max_bytes)
    await ensure_jobs_bucket(js, jobs or JobStoreLimits(), settings.replicas)


# --- sized to the disk (natsched up's embedded server) -----------------------------------------

#: nats-server's default max_file_store is 75% of the free disk at its start
SERVER_STORE_SHARE = 0.75
#: natsched's limits take at most this share of what the server may store (room for the KV
#: buckets without limits, other accounts and what an operator adds)
DISK_SHARE = 0.5
#: below this in all, a system would keep minutes of audit data: refused instead of shrunk further
MIN_TOTAL_BYTES = 256 * MiB


def total_reserved(overrides: dict[str, StreamLimits] | None = None) -> int:
    """What every stream's and the ``jobs`` bucket's max_bytes add up to (with ``overrides``)."""
    overrides = overrides or {}
    return sum(overrides.get(t, default_limits(t)).max_bytes for t in retention_targets())


def fit_to_disk(free_bytes: int, overrides: dict[str, StreamLimits] | None = None) -> dict[str, StreamLimits]:
    """Retention overrides that make natsched's limits fit a disk with ``free_bytes`` free: empty
    when the configured ones fit already, else every limit scaled down alike (ages kept), the
    operator's own overrides included. A disk too small for :data:`MIN_TOTAL_BYTES` raises
    :class:`ProvisionError` with one line saying what is needed.

    Why: each stream's ``max_bytes`` is reserved by the server at creation; on a small disk the
    first stream past the server's store limit is refused and nothing starts."""
    overrides = dict(overrides or {})
    need = total_reserved(overrides)
    budget = int(free_bytes * SERVER_STORE_SHARE * DISK_SHARE)
    if need <= budget:
        return {}
    if budget < MIN_TOTAL_BYTES:
        raise ProvisionError(
            f"the disk has {free_bytes / GiB:.2f} GiB free: natsched's streams need at least "
            f"{MIN_TOTAL_BYTES / MiB / SERVER_STORE_SHARE / DISK_SHARE / 1024:.2f} GiB free "
            f"({need / GiB:.1f} GiB for the default retention); free disk or use another --data-dir")
    scale = budget / need
    out = {}
    for target in retention_targets():
        limits = overrides.get(target, default_limits(target))
        out[target] = StreamLimits(limits.max_age_s, max(MiB, int(limits.max_bytes * scale)))
    return out


async def fit_stored_limits(js, free_bytes: int, replicas: int | None = None) -> dict[str, StreamLimits]:
    """Size natsched's limits to a disk with ``free_bytes`` free (plus what its streams store
    already, which a restart must not count against them): the overrides :func:`fit_to_disk`
    computes are stored where ``natsched retention set`` stores them, so every service's own
    provisioning uses them too. Returns what was stored (empty: the limits fit)."""
    stored = 0
    for name in retention_targets():
        try:
            info = await js.stream_info(f"KV_{name}" if name == S.BUCKET_JOBS else name)
        except NotFoundError:
            continue
        stored += info.state.bytes or 0
    current = await stored_overrides(js)
    fitted = fit_to_disk(free_bytes + stored, current)
    if fitted:
        await ensure_bucket(js, S.BUCKET_CONFIG, replicas)
        kv = await js.key_value(S.BUCKET_CONFIG)
        await kv.put(S.KEY_RETENTION, overrides_to_json(fitted))
        log.warning("the disk has %.2f GiB free: natsched's streams are sized to %.2f GiB in all (stored as "
                    "retention overrides; natsched retention set changes them)", free_bytes / GiB,
                    total_reserved(fitted) / GiB)
    return fitted


# --- partitioned admission (issue 27) -------------------------------------------------------
def partition_transform(partitions: int) -> api.SubjectTransform | None:
    """REQUESTS' subject transform for ``partitions`` (None: one partition, stored as published).

    A stream transform rather than a server ``mappings`` entry (``natsched.admitter.budget.
    partition_mapping``, the same ``partition()`` function): it lives in the stream's config, so
    provisioning sets it on any server or cluster without a server config file, and producers
    keep publishing ``req.<class>.<tenant>`` (their permissions unchanged)."""
    if partitions < 1:
        raise ProvisionError(f"partitions must be >= 1, got {partitions}")
    if partitions == 1:
        return None
    return api.SubjectTransform(src="req.*.*", dest=f"{S.PARTITIONED_PREFIX}.{{{{partition({partitions},2)}}}}"
                                                    ".{{wildcard(1)}}.{{wildcard(2)}}")


def stream_partitions(config: api.StreamConfig) -> int:
    """How many partitions a REQUESTS config stores requests in (1: not partitioned)."""
    t = config.subject_transform
    dest = (t.dest if isinstance(t, api.SubjectTransform) else (t or {}).get("dest", "")) or ""
    marker = "{{partition("
    if marker not in dest:
        return 1
    return int(dest.split(marker, 1)[1].split(",", 1)[0])


async def set_partitions(js, partitions: int) -> bool:
    """Partition REQUESTS into ``partitions`` (1: undo it) and create bucket ``budget`` and each
    partition's ``inflight-p<k>``; True when the stream changed. Requests stored before keep their
    subject: change P on a drained system (docs/fleet.md)."""
    info = await js.stream_info(S.STREAM_REQUESTS)
    wanted = partition_transform(partitions)
    if partitions > 1:
        await ensure_bucket(js, S.BUCKET_BUDGET, None)
        for k in range(partitions):
            await ensure_bucket(js, S.partition_bucket(k), None)
    if stream_partitions(info.config) == partitions:
        return False
    info.config.subject_transform = wanted
    await js.update_stream(info.config)
    log.info("stream %s now stores requests in %d partition(s)", S.STREAM_REQUESTS, partitions)
    return True
