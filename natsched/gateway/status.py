"""One view of the cluster for operators: ``natsched status`` in the terminal, ``/status`` in the gateway.

What it shows and where each figure comes from (nothing here needs a service's metrics port,
so it works against any cluster it can reach on the bus):

- workers — their own heartbeats (``worker.*.hb``): state, load (runtime tokens in use over
  capacity), KV use, heartbeat age; the hit ratio is cached / prompt tokens of their recent
  completions (``done.>``). A worker silent for three heartbeat intervals shows as ``stale``; one
  that reports healthy but that a router judged much slower than its learned prediction shows as
  ``half_open`` (the routers' records ``cost.<worker>.<router>`` in bucket ``workers``,
  :mod:`natsched.router.health`), with the prefill rate the routers learned for it;
- tenants — the ``quotas`` bucket (floor, cap) and the ``inflight`` bucket's ``usage`` key (with
  partitioned admission every partition's ``inflight-p<k>/usage`` added, and each partition's
  use and budget shown: :mod:`natsched.admitter.inflight`);
- queue depths by class — admission records (``decision.admission.*``): a request whose last
  record is ``queue`` is still held; the class limit is the quotas' ``class.<c>.queue``;
- recent rejections by reason — admission records with decision ``reject`` in the window.

:class:`StatusState` is the pure accumulator (records in, :class:`StatusView` out); the
:class:`StatusCollector` feeds it from the bus, first from the tail of the DECISIONS and
COMPLETIONS streams, then live. The gateway keeps one collector running and renders the same
view as HTML (``natsched.gateway.status_page``); ``natsched status`` renders it as text
(``natsched.ops.status``). It lives with the gateway, its first user (the collector's
heartbeats also tell the gateway which models are live), below the operations package.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import orjson

from natsched.admitter.errors import UsageError
from natsched.admitter.inflight import Inflight, PartitionUsage, read_inflight
from natsched.admitter.quotas import Quotas
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.wire.errors import MessageError
from natsched.wire.schema import Completion, CompletionStatus, Decision, Heartbeat

log = logging.getLogger(__name__)

#: a worker is stale after this many missed heartbeat intervals (the admitter's lease default)
STALE_AFTER_INTERVALS = 3.0
#: the gateway refuses a model at once (503) only when its workers have been silent this long at
#: least: a late heartbeat or two (a loaded host, a GC pause) is the router's to wait out, not a
#: reason to fail a request that a worker would serve a moment later
REFUSE_AFTER_S = 2.0
#: a router's verdict on a worker counts while its record is younger than this (routers publish every second)
ROUTER_VERDICT_S = 30.0


@dataclass
class StatusSettings:
    window_s: float = 300.0  # rejections and hit ratios cover this much recent time
    queue_memory_s: float = 900.0  # a queued record older than this is forgotten (the client gave up)
    forget_worker_s: float = 600.0  # a worker silent this long leaves the view
    backfill: int = 2000  # records read from the tail of DECISIONS and COMPLETIONS at start
    listen_s: float = 2.5  # one-shot status: how long to collect heartbeats before printing


@dataclass
class WorkerRow:
    id: str
    state: str
    model: str
    running: int
    waiting: int
    runtime_tokens: int
    capacity_tokens: int
    kv_used_blocks: int
    kv_total_blocks: int
    heartbeat_age_s: float
    hit_ratio: float | None  # cached / prompt tokens of its completions in the window
    prefill_tps: float | None = None  # prefill tokens/s the routers learned for it (their mean)

    @property
    def load(self) -> float | None:
        return self.runtime_tokens / self.capacity_tokens if self.capacity_tokens else None

    @property
    def kv_use(self) -> float | None:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else None


@dataclass
class TenantRow:
    tenant: str
    floor_share: float
    floor_tokens: int
    used: int
    cap: int | None
    configured: bool  # False: an active tenant running on the default quota


@dataclass
class QueueRow:
    cls: str
    depth: int
    limit: int


@dataclass
class StatusView:
    at: float
    total: int  # the total admissions decide against (capacity-following when known)
    configured_total: int
    used: int
    workers: list[WorkerRow] = field(default_factory=list)
    tenants: list[TenantRow] = field(default_factory=list)
    queues: list[QueueRow] = field(default_factory=list)
    rejections: dict[str, int] = field(default_factory=dict)
    window_s: float = 300.0
    warnings: list[str] = field(default_factory=list)
    partitions: list[PartitionUsage] = field(default_factory=list)  # empty unless admission is partitioned

    def to_json(self) -> bytes:
        data = asdict(self)
        for row, worker in zip(data["workers"], self.workers):
            row["load"], row["kv_use"] = worker.load, worker.kv_use
        return orjson.dumps(data)


class StatusState:
    """The rolling picture: fed heartbeats, admission records and completions; pure, no I/O."""

    def __init__(self, settings: StatusSettings | None = None) -> None:
        self.settings = settings or StatusSettings()
        self.heartbeats: dict[str, tuple[Heartbeat, float]] = {}  # worker -> (last, received at)
        self.queued: dict[str, tuple[str, float]] = {}  # request id -> (class, when queued)
        self.rejections: deque[tuple[float, str]] = deque()
        self.served: dict[str, deque[tuple[float, int, int]]] = {}  # worker -> (ts, prompt, cached)
        self.verdicts: dict[str, dict[str, tuple[str, float | None, float]]] = {}  # worker -> router -> (health, tps, at)

    def on_cost_record(self, key: str, value: bytes) -> None:
        """A router's learned view of a worker (bucket ``workers``, ``cost.<worker>.<router>``)."""
        parsed = S.parse_cost_key(key)
        try:
            rec = orjson.loads(value)
            at, health = float(rec["at"]), str(rec.get("health", "healthy"))
            tps = rec.get("estimate", {}).get("prefill_tokens_per_s")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            return
        if parsed is not None:
            self.verdicts.setdefault(parsed[0], {})[parsed[1]] = (
                health, float(tps) if isinstance(tps, (int, float)) else None, at)

    def _router_view(self, worker: str, now: float) -> tuple[bool, float | None]:
        """(some router holds it half-open, the mean learned prefill rate) from fresh records."""
        fresh = [v for v in self.verdicts.get(worker, {}).values() if now - v[2] <= ROUTER_VERDICT_S]
        rates = [v[1] for v in fresh if v[1]]
        return any(v[0] == "half_open" for v in fresh), (sum(rates) / len(rates) if rates else None)

    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        self.heartbeats[hb.worker] = (hb, now)

    def on_decision(self, d: Decision) -> None:
        if d.admission is not None:  # an inline router's routing record carries the admission record
            for record in d.unfolded()[:-1]:
                self.on_decision(record)
        if d.stage != "admission":
            return
        if d.decision == "queue":
            self.queued[d.request_id] = (d.cls or "?", d.ts)
            return
        self.queued.pop(d.request_id, None)
        if d.decision == "reject":
            self.rejections.append((d.ts, d.reason or "unknown"))

    def on_completion(self, c: Completion) -> None:
        if c.worker and c.status == CompletionStatus.OK:
            self.served.setdefault(c.worker, deque()).append((c.ts, c.prompt_tokens, c.cached_tokens))

    def prune(self, now: float) -> None:
        s = self.settings
        while self.rejections and now - self.rejections[0][0] > s.window_s:
            self.rejections.popleft()
        for rows in self.served.values():
            while rows and now - rows[0][0] > s.window_s:
                rows.popleft()
        self.queued = {rid: q for rid, q in self.queued.items() if now - q[1] <= s.queue_memory_s}
        self.heartbeats = {w: hb for w, hb in self.heartbeats.items() if now - hb[1] <= s.forget_worker_s}

    def models(self, now: float) -> dict[str, bool]:
        """Every model (and LoRA adapter) a live worker serves -> whether a healthy worker serves it now."""
        out: dict[str, bool] = {}
        for hb, seen in self.heartbeats.values():
            window = max(STALE_AFTER_INTERVALS * max(hb.interval, 0.1), REFUSE_AFTER_S)
            ok = now - seen <= window and hb.state == "healthy"
            for name in {hb.model, *(m.id for m in hb.served)}:
                out[name] = out.get(name, False) or ok
        return out

    def model_cards(self) -> dict[str, dict]:
        """The engine servers' own ``/v1/models`` entries by id (workers fronting ``vllm serve``),
        the newest heartbeat's winning: ``object``, ``created``, ``owned_by``, ``root``, ``parent``,
        ``max_model_len``."""
        cards: dict[str, dict] = {}
        for hb, _ in sorted(self.heartbeats.values(), key=lambda x: x[1]):
            for m in hb.served:
                cards[m.id] = {"object": m.object, "created": m.created or None, "owned_by": m.owned_by,
                               "root": m.root, "parent": m.parent, "max_model_len": m.max_model_len}
        return cards

    def view(self, quota_entries: dict[str, bytes], usage_raw: bytes | None, now: float,
             inflight: Inflight | None = None) -> StatusView:
        """``inflight`` (:func:`natsched.admitter.inflight.read_inflight`), when given, replaces
        ``usage_raw``: the usage of every partition, added."""
        self.prune(now)
        warnings: list[str] = []
        quota_entries = dict(quota_entries)
        dynamic_raw = quota_entries.pop(S.KEY_DYNAMIC_TOTAL, None)
        quotas, errors = Quotas.from_kv(quota_entries)
        warnings += errors
        if inflight is not None:
            usage = inflight.usage
            warnings += inflight.warnings
        else:
            try:
                usage = Usage.from_json(usage_raw) if usage_raw else Usage()
            except UsageError as exc:
                warnings.append(f"inflight usage unreadable: {exc}")
                usage = Usage()
        total = quotas.ceiling()
        try:
            dynamic = orjson.loads(dynamic_raw) if dynamic_raw else None
        except orjson.JSONDecodeError:
            dynamic = None
        if isinstance(dynamic, int) and not isinstance(dynamic, bool) and dynamic > 0:
            total = dynamic
        return StatusView(
            at=now, total=total, configured_total=quotas.total, used=usage.used,
            workers=self._worker_rows(now), tenants=_tenant_rows(quotas, usage, total),
            queues=self._queue_rows(quotas), rejections=self._rejection_counts(),
            window_s=self.settings.window_s, warnings=warnings,
            partitions=list(inflight.partitions) if inflight is not None else [],
        )

    def _worker_rows(self, now: float) -> list[WorkerRow]:
        rows = []
        for worker, (hb, seen) in sorted(self.heartbeats.items()):
            age = max(0.0, now - seen)
            served = self.served.get(worker) or ()
            prompt = sum(p for _, p, _ in served)
            state = "stale" if age > STALE_AFTER_INTERVALS * max(hb.interval, 0.1) else hb.state
            half_open, tps = self._router_view(worker, now)
            if state == "healthy" and half_open:
                state = "half_open"
            rows.append(WorkerRow(
                id=worker, state=state, model=hb.model, running=hb.running, waiting=hb.waiting,
                runtime_tokens=hb.runtime_tokens, capacity_tokens=hb.capacity_tokens,
                kv_used_blocks=hb.kv_used_blocks, kv_total_blocks=hb.kv_total_blocks, heartbeat_age_s=age,
                hit_ratio=(sum(c for _, _, c in served) / prompt) if prompt else None, prefill_tps=tps,
            ))
        return rows

    def _queue_rows(self, quotas: Quotas) -> list[QueueRow]:
        depth: dict[str, int] = {}
        for cls, _ in self.queued.values():
            depth[cls] = depth.get(cls, 0) + 1
        return [QueueRow(cls, depth.get(cls, 0), quotas.queue_limit(cls))
                for cls in sorted(set(S.CLASSES) | set(depth), key=_class_order)]

    def _rejection_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, reason in self.rejections:
            counts[reason] = counts.get(reason, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _class_order(cls: str) -> tuple[int, str]:
    return (S.CLASSES.index(cls) if cls in S.CLASSES else len(S.CLASSES), cls)


def _tenant_rows(quotas: Quotas, usage: Usage, total: int) -> list[TenantRow]:
    rows = []
    for tenant in sorted(set(quotas.tenants) | set(usage.tenants)):
        q = quotas.tenants.get(tenant)
        configured = q is not None
        q = q or quotas.default_tenant
        rows.append(TenantRow(tenant, q.floor, int(q.floor * total), usage.tenant(tenant), q.cap, configured))
    return rows


# --- feeding it from the bus ---------------------------------------------------------------


class StatusCollector:
    """Keeps a :class:`StatusState` current from the bus; :meth:`snapshot` adds the KV figures."""

    def __init__(self, bus: Bus, settings: StatusSettings | None = None, follow_records: bool = True) -> None:
        self.bus = bus
        self.state = StatusState(settings)
        self.follow_records = follow_records  # False: heartbeats only (a gateway with --no-status)

    async def start(self) -> None:
        await self.bus.subscribe(S.HEARTBEATS_ALL, self._on_heartbeat)
        if not self.follow_records:
            return
        # live first, then the tail: a record in both is applied twice, which is harmless
        # (a queue record followed by its decision ends the same; a rejection counts once more)
        await self.bus.subscribe(S.DECISIONS_ALL, self._on_decision)
        await self.bus.subscribe(S.COMPLETIONS_ALL, self._on_completion)
        n = self.state.settings.backfill
        for data in await stream_tail(self.bus, S.STREAM_DECISIONS, n):
            self._apply(data, Decision, self.state.on_decision)
        for data in await stream_tail(self.bus, S.STREAM_COMPLETIONS, n):
            self._apply(data, Completion, self.state.on_completion)

    async def snapshot(self) -> StatusView:
        # one filtered snapshot, not a watch plus a get per key: a role may be allowed this read
        # without the rights a watch needs (natsched.ops.auth, the gateway's role)
        entries = {key: value async for key, value in self.bus.kv(S.BUCKET_QUOTAS).entries()}
        try:  # the routers' verdicts: a role without read rights on bucket workers shows reported states
            async for key, value in self.bus.kv(S.BUCKET_WORKERS).entries(S.COST_KEYS):
                self.state.on_cost_record(key, value)
        except Exception as exc:
            log.debug("status: no router verdicts (%s)", exc)
        return self.state.view(entries, None, time.time(), inflight=await read_inflight(self.bus))

    @staticmethod
    def _apply(data: bytes, schema, sink) -> None:
        try:
            sink(schema.decode(data))
        except MessageError as exc:
            log.debug("status: ignoring an unreadable %s: %s", schema.__name__, exc)

    async def _on_heartbeat(self, subject: str, data: bytes, headers: dict) -> None:
        try:
            self.state.on_heartbeat(Heartbeat.decode(data), time.time())
        except MessageError as exc:
            log.debug("status: ignoring a bad heartbeat on %s: %s", subject, exc)

    async def _on_decision(self, subject: str, data: bytes, headers: dict) -> None:
        self._apply(data, Decision, self.state.on_decision)

    async def _on_completion(self, subject: str, data: bytes, headers: dict) -> None:
        self._apply(data, Completion, self.state.on_completion)


async def stream_tail(bus: Bus, stream: str, count: int, parallel: int = 64) -> list[bytes]:
    """The bodies of a stream's last ``count`` messages, oldest first (direct gets by sequence).

    Reading only the tail keeps a status page cheap on a week-long audit stream.
    """
    return await bus.stream(stream).tail(count, parallel)
