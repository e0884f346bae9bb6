"""Idempotent provisioning of every stream and KV bucket, with explicit retention and limits.

Run by every service at start (cheap when all exists) and by ``natsched up``. An existing
stream is updated to the configured limits; one whose retention cannot be changed in place
raises :class:`ProvisionError` with what differs, rather than running on a surprise config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nats.js import api
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from bus import subjects as S
from bus.errors import ProvisionError

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

    replicas: int = 1
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
}


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


async def ensure_stream(js, config: api.StreamConfig) -> None:
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
        log.info("created stream %s", config.name)
        return
    if info.config.retention != config.retention:
        raise ProvisionError(
            f"stream {config.name} exists with retention {info.config.retention}, expected "
            f"{config.retention}; delete it (data loss) or point natsched at another server"
        )
    try:
        await js.update_stream(config)
    except BadRequestError as exc:
        raise ProvisionError(f"stream {config.name} cannot be updated to natsched's config: {exc}") from exc


async def ensure_bucket(js, bucket: str, replicas: int) -> None:
    history, ttl = _BUCKETS[bucket]
    try:
        await js.key_value(bucket)
        return
    except BucketNotFoundError:
        pass
    await js.create_key_value(api.KeyValueConfig(bucket=bucket, history=history, ttl=ttl, replicas=replicas))
    log.info("created bucket %s", bucket)


async def provision(js, settings: ProvisionSettings | None = None) -> None:
    """Create or update every stream and bucket natsched uses. Safe to run concurrently."""
    settings = settings or ProvisionSettings()
    for name in S.STREAMS:
        await ensure_stream(js, stream_config(name, settings))
    for bucket in S.BUCKETS:
        await ensure_bucket(js, bucket, settings.replicas)
