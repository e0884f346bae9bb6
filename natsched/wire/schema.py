"""Versioned wire schemas: every message on the bus is one of these dataclasses.

Rules (the wire contract in ``subjects.md`` mirrors them):
- each message carries ``v`` (schema version); readers accept any version and
  **ignore unknown fields**, so a newer producer never breaks an older consumer;
- ``to_wire()`` omits ``None`` so optional fields cost nothing;
- ``from_wire()`` checks presence and type of each field (:mod:`natsched.wire.validate`) and raises
  :class:`~natsched.wire.errors.SchemaError` naming the field, so handlers can answer precisely.

Pure module: no nats import, no I/O.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from natsched.wire.errors import SchemaError

# the ids live in natsched.wire.ids; imported here too, beside the messages that carry them
from natsched.wire.ids import (
    TOKEN,
    RequestId,
    TenantId,
    WorkerId,
    is_token,
)
from natsched.wire.subjects import reply_allowed
from natsched.wire.validate import (  # the engine: Schema is the messages' base
    Schema,
    bounded,
    wire,
)

SCHEMA_VERSION = 1

log = logging.getLogger(__name__)


def _check_id(value: str, name: str) -> None:
    if not is_token(value):
        raise SchemaError(f"field '{name}' must match {TOKEN} (it is used in subjects)", name)


#: the largest token id any message may carry: engines index vocabularies with 32-bit ints, so a
#: larger one can only be an attack or a bug (it would crash the engine, not be refused)
MAX_TOKEN_ID = 2**31 - 1


#: a token id of a prompt: the engine bounds each as it decodes (no Python loop over 4k ids)
TokenId = bounded(int, 0, MAX_TOKEN_ID, "a token id")


def _check_counts(obj: Any, names: tuple[str, ...]) -> None:
    """Counts of tokens, blocks or attempts are never negative (None = not given)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 0:
            raise SchemaError(f"field '{name}' must be >= 0, got {value}", name)


@dataclass
class Request(Schema):
    """An inference request as a producer publishes it on ``req.<class>.<tenant>``.

    Either ``prompt`` (text) or ``prompt_token_ids`` is set. ``system_prompt`` and
    ``kb_version`` are the *stable prefix segments* the router keys its cache affinity on.

    ``resume_token_ids``: the output its consumer already has from an attempt whose worker died
    mid-stream (:class:`natsched.client.producer.Client` migrates such a stream). The worker
    continues after them, prompt + these tokens, and generates at most ``max_tokens`` minus
    their number, so the stream goes on where it stopped instead of starting over.
    """

    id: RequestId
    tenant: TenantId
    cls: str = wire("class")
    model: str = "default"
    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    resume_token_ids: list[TokenId] | None = None
    system_prompt: str | None = None
    kb_version: str | None = None
    max_tokens: int = 128
    expected_output_tokens: int | None = None
    deadline: float | None = None  # unix seconds; past it the request is not worth running
    ttft_deadline: float | None = None  # unix seconds; a run with no first token by then is stopped
    idle_timeout: float | None = None  # seconds; a run with no next token within it is stopped
    reply: str | None = None  # producer's subject for status, tokens and the result
    stream: bool = False  # send token chunks, not only the final result
    degradable: bool = False  # may be moved to the offline path under pressure
    created: float | None = None
    v: int = SCHEMA_VERSION

    def __post_init_check__(self) -> None:
        _check_id(self.id, "id")
        _check_id(self.tenant, "tenant")
        if self.prompt is None and self.prompt_token_ids is None:
            raise SchemaError("missing required field 'prompt' (or 'prompt_token_ids')", "prompt")
        if self.resume_token_ids is not None and not 0 < len(self.resume_token_ids) < self.max_tokens:
            raise SchemaError(f"field 'resume_token_ids' must hold 1 to max_tokens - 1 ({self.max_tokens - 1}) "
                              f"token ids, got {len(self.resume_token_ids)}", "resume_token_ids")
        if self.idle_timeout is not None and not self.idle_timeout > 0:
            raise SchemaError(f"field 'idle_timeout' must be > 0 seconds, got {self.idle_timeout}", "idle_timeout")
        if self.reply is not None and not reply_allowed(self.reply, self.tenant):
            raise SchemaError(f"field 'reply' must be one of the tenant's reply subjects "
                              f"(resp.<tenant>.<id>), got {self.reply[:80]!r}", "reply")


@dataclass
class Admitted(Schema):
    """What the admitter forwards on ``adm.<pool>.<class>.<tenant>``: the request and its reservation."""

    request: Request
    runtime_tokens: int
    admitted_at: float
    admitter: str = ""
    queue_wait: float = 0.0
    attempt: int = 0  # 0 first; +1 each time a dead worker's unfinished request is re-admitted
    avoid: list[str] = field(default_factory=list)  # workers it must not be routed to (found dead)
    v: int = SCHEMA_VERSION

    def __post_init_check__(self) -> None:
        _check_counts(self, ("runtime_tokens", "attempt"))


@dataclass
class Decision(Schema):
    """An audit record on ``decision.<stage>.<tenant>``: what was decided, from which inputs."""

    request_id: RequestId
    tenant: TenantId
    stage: str  # "admission" | "routing"
    decision: str  # admission: allow|queue|reject|degrade|rescue ; routing: assign|fail
    ts: float
    cls: str = wire("class", "")
    reason: str | None = None
    retry_after: float | None = None
    runtime_tokens: int | None = None
    budget: dict | None = None  # admission: in_flight/total/... at decision time
    queue_wait: float | None = None
    worker: WorkerId | None = None
    policy: str | None = None
    scores: dict | None = None  # routing: worker -> score (lower is better)
    expected_cached_tokens: int | None = None
    by: str | None = None  # the replica that decided
    latency_ms: float | None = None
    #: on a routing record of an inline router (``admitter --route``): the admission record of the
    #: same request, stored in this one message instead of a second (:meth:`unfolded` reads both)
    admission: dict | None = None
    v: int = SCHEMA_VERSION

    def unfolded(self) -> list["Decision"]:
        """The records this message holds, in the order they were decided: the admission record
        it carries (if any, and readable), then itself. Every reader of DECISIONS reads through it."""
        if self.admission is None:
            return [self]
        try:
            return [Decision.from_wire(self.admission, path="admission"), self]
        except SchemaError as exc:
            log.warning("decision record of %s carries an unreadable admission record: %s", self.request_id, exc)
            return [self]


@dataclass
class Assignment(Schema):
    """The router's hand-off to a worker on ``work.<worker>``."""

    request: Request
    worker: WorkerId
    runtime_tokens: int
    admitted_at: float
    routed_at: float
    policy: str = ""
    expected_cached_tokens: int = 0
    attempt: int = 0  # copied from Admitted: a rescue re-admits it with the next one
    avoid: list[str] = field(default_factory=list)
    fence: str = ""  # natsched.wire.fence.sign(request, worker, attempt): the worker's proof in its completion
    #: natsched.wire.fence.reply_sign with the tenant's reply key: the worker's proof in its replies
    reply_fence: str = ""
    v: int = SCHEMA_VERSION

    def __post_init_check__(self) -> None:
        _check_id(self.worker, "worker")
        _check_counts(self, ("runtime_tokens", "expected_cached_tokens", "attempt"))


class ReplyKind(enum.StrEnum):
    """What one :class:`Reply` is: news (``status``), output (``token``) or the end."""

    STATUS = "status"  # with ``status``: queued / admitted / assigned / rerouted / degraded
    TOKEN = "token"  # a chunk of output
    RESULT = "result"  # final, success
    ERROR = "error"  # final, failure (``status`` rejected or failed, ``reason`` says why)


class ReplyStatus(enum.StrEnum):
    """Where a request is, as its producer hears it (``Reply.status``), in the order it goes."""

    QUEUED = "queued"  # the admitter holds it (``est_wait``)
    ADMITTED = "admitted"
    ASSIGNED = "assigned"  # a worker has it (``worker``)
    REROUTED = "rerouted"  # its worker died; re-admitted to run elsewhere
    DEGRADED = "degraded"  # final: moved to the offline path (``job_id``)
    REJECTED = "rejected"  # an error: refused by admission (``retry_after`` may say when to retry)
    FAILED = "failed"  # an error: it ran, or was routed, and failed


@dataclass
class Reply(Schema):
    """What the producer receives on its reply subject.

    ``kind``: a :class:`ReplyKind`; ``status``: a :class:`ReplyStatus` (an unknown value of
    either does not decode: :class:`~natsched.wire.errors.SchemaError`).
    """

    request_id: RequestId
    kind: ReplyKind
    status: ReplyStatus | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    index: int | None = None
    est_wait: float | None = None
    job_id: str | None = None
    reason: str | None = None
    message: str | None = None
    retry_after: float | None = None
    worker: WorkerId | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    ttft: float | None = None
    tpot: float | None = None
    # on a worker's final reply: when the request was admitted, routed, and received by the
    # worker (unix seconds; the first two copied from its Assignment). What the producer waited
    # for before any engine work, by stage, on the clocks of the services that did it.
    admitted_at: float | None = None
    routed_at: float | None = None
    received_at: float | None = None
    # on a worker's reply: its assignment's ``reply_fence`` and attempt, which the producer checks
    # (natsched.wire.fence.reply_problem) before it takes the reply as output of its request
    fence: str | None = None
    attempt: int | None = None
    v: int = SCHEMA_VERSION

    @property
    def final(self) -> bool:
        return self.kind in (ReplyKind.RESULT, ReplyKind.ERROR)


class CompletionStatus(enum.StrEnum):
    """How an admitted request ended, for the admitter and the router (``Completion.status``)."""

    OK = "ok"
    ERROR = "error"  # ``reason`` says why


@dataclass
class Completion(Schema):
    """One per admitted request and attempt, on ``done.<tenant>.<worker>``: releases its reservation
    (only with the ``fence`` of the assignment's worker and the reservation's current ``attempt``:
    :mod:`natsched.wire.fence`), feeds learning."""

    request_id: RequestId
    tenant: TenantId
    status: CompletionStatus
    runtime_tokens: int
    cls: str = wire("class", "")
    model: str = "default"
    worker: WorkerId | None = None
    finish_reason: str | None = None
    reason: str | None = None  # error code when status == "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    expected_cached_tokens: int | None = None
    ts: float = 0.0
    attempt: int = 0  # the assignment's: a completion of an attempt since rescued is stale
    fence: str = ""  # copied from the Assignment
    # a run its producer cancelled: seconds from the producer's cancel (its ``ts``) to the worker,
    # and the tokens the run still produced once the worker had it (the cancel path's own share)
    cancel_transit_s: float | None = None
    tokens_after_cancel: int | None = None
    v: int = SCHEMA_VERSION

    def __post_init_check__(self) -> None:
        _check_id(self.request_id, "request_id")
        _check_id(self.tenant, "tenant")
        _check_counts(self, ("runtime_tokens", "prompt_tokens", "cached_tokens", "output_tokens",
                             "expected_cached_tokens", "attempt"))


@dataclass
class ServedModel(Schema):
    """One model a worker's engine serves, as ``vllm serve`` lists it in ``/v1/models``.

    A LoRA adapter has ``parent`` (its base model); ``active`` says it is in the engine's batch
    now (loaded on the device: the router prefers such a worker for the adapter's requests).
    """

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    active: bool = False


@dataclass
class Heartbeat(Schema):
    """A worker's load report on ``worker.<id>.hb``; ``inflight`` are the admitter's leases."""

    worker: WorkerId
    seq: int
    ts: float
    state: str = "healthy"  # healthy | backoff | quiescing | reregister
    model: str = "default"
    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    runtime_tokens: int = 0  # in use now
    capacity_tokens: int = 0  # what this worker can hold at its latency knee
    queued_prefill_tokens: int = 0  # uncached prompt tokens of requests with no first token yet
    block_size: int = 32
    started_at: float = 0.0
    interval: float = 1.0
    kv_seq: int = 0  # last cache-event sequence number published
    inflight: list[str] = field(default_factory=list)
    served: list[ServedModel] = field(default_factory=list)  # every model and adapter it serves (besides ``model``)
    deployment: str | None = None  # the calibration key part: routers read its measured speed as a prior
    #: the WORK stream sequence up to which this worker id's durable consumer had delivered when
    #: this instance started: what ``work.<worker>`` still stores at or below it is a
    #: predecessor's unfinished work (the admitters rescue it at once); 0: none
    predecessor_seq: int = 0
    #: request id -> runtime tokens it holds now (2 x prompt + generated), for the requests that
    #: ran past what their assignment reserved: the admitters grow those reservations
    over: dict[str, int] = field(default_factory=dict)
    #: decode progress since the previous heartbeat: the tokens its requests produced after their
    #: first, and the sum of the gaps before each (seconds); 0 / 0: not reported (an older worker).
    #: The router judges the mean gap against its model of the worker (natsched.router.progress)
    decode_tokens: int = 0
    decode_s: float = 0.0
    v: int = SCHEMA_VERSION

    _COUNTS = ("seq", "running", "waiting", "kv_used_blocks", "kv_total_blocks", "runtime_tokens",
               "capacity_tokens", "queued_prefill_tokens", "kv_seq", "predecessor_seq", "decode_tokens")

    def __post_init_check__(self) -> None:
        _check_id(self.worker, "worker")
        _check_counts(self, self._COUNTS)  # a negative load would make a worker look better than idle
        for rid, tokens in self.over.items():
            _check_id(rid, "over")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise SchemaError(f"field 'over' must map request ids to counts >= 0, got {tokens!r}", "over")
        if self.block_size <= 0 or self.interval <= 0:
            raise SchemaError("fields 'block_size' and 'interval' must be > 0", "block_size")
        d = self.decode_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
            raise SchemaError(f"field 'decode_s' must be a finite number >= 0, got {d!r}", "decode_s")


@dataclass
class CacheEvent(Schema):
    """A cache-summary delta (or snapshot) on ``worker.<id>.kv``, sequenced per worker.

    ``kind``: ``stored`` / ``removed`` (``hashes`` changed), ``cleared`` (all gone),
    ``snapshot`` (``hashes`` is the whole content; resets the reader's view).

    ``tier``: where the blocks are, ``gpu`` (default, omitted) or ``host`` (an offload tier in host
    memory: vLLM's CPU offloading, LMCache). A ``host`` snapshot or ``cleared`` replaces only the
    host tier's view; a GPU one resets both (the worker follows it with a host snapshot).
    """

    worker: WorkerId
    seq: int
    kind: str
    ts: float
    hashes: list[int] = field(default_factory=list)
    block_size: int = 32
    tier: str | None = None
    v: int = SCHEMA_VERSION

    KINDS = ("stored", "removed", "cleared", "snapshot")
    TIERS = ("gpu", "host")

    def __post_init_check__(self) -> None:
        _check_id(self.worker, "worker")
        if self.seq < 1:
            raise SchemaError(f"field 'seq' must be >= 1, got {self.seq}", "seq")
        if self.kind not in self.KINDS:
            raise SchemaError(f"field 'kind' must be one of {', '.join(self.KINDS)}, got {self.kind!r}", "kind")
        if self.block_size <= 0:
            raise SchemaError(f"field 'block_size' must be > 0, got {self.block_size}", "block_size")
        if self.tier is not None and self.tier not in self.TIERS:
            raise SchemaError(f"field 'tier' must be one of {', '.join(self.TIERS)}, got {self.tier!r}", "tier")


@dataclass
class Control(Schema):
    """A control message on ``worker.<id>.ctl``: ``drain``, ``snapshot``, ``resume``, ``cancel``;
    also the body of a producer's ``cancel.<tenant>.<request_id>`` (informational there: the
    subject, which the server authorised, says what is cancelled).

    ``cancel`` names ``request_id``: its producer went away (an HTTP client disconnected), so
    the worker stops generating and closes the request with reason ``cancelled``.

    ``handover`` names ``request_id`` and ``attempt``: an admitter rescues that attempt, which a
    restarted worker's predecessor left un-acked (admitter/rescue.py, ``take_over``). The worker
    must never run it (nor any older attempt): a copy the server redelivers later is acked and
    dropped, one it started meanwhile is stopped. Without it, a copy redelivered between the
    heartbeat the rescue read and the rescue itself ran twice (once here, once rescued).
    """

    kind: str
    ts: float = 0.0
    by: str | None = None
    request_id: RequestId | None = None
    attempt: int | None = None
    v: int = SCHEMA_VERSION


@dataclass
class ScaleEvent(Schema):
    """A scaling signal on ``scale.<kind>`` (``natsched.admitter.scaling``): ``out`` (add ``add``
    workers: queue wait p95 over its threshold for a window) or ``in`` (drain ``drain``: the
    cluster idle for a window). The latest is also kept in KV ``config`` under ``scale``."""

    kind: str  # out | in
    ts: float
    by: str  # the admitter replica that saw it
    reason: str
    workers: int
    add: int = 0
    drain: WorkerId | None = None
    queue_wait_p95: float = 0.0
    demand_tokens: int = 0
    worker_capacity: int = 0
    utilisation: float = 0.0
    v: int = SCHEMA_VERSION

    def __post_init_check__(self) -> None:
        if self.kind not in ("out", "in"):
            raise SchemaError(f"field 'kind' must be 'out' or 'in', got {self.kind!r}", "kind")
        _check_counts(self, ("workers", "add", "demand_tokens", "worker_capacity"))


@dataclass
class DeadLetter(Schema):
    """A message no handler could use, kept on ``dead.<source>`` with the reason."""

    subject: str
    reason: str
    error: str
    ts: float
    data: bytes = b""
    headers: dict | None = None
    by: str | None = None
    v: int = SCHEMA_VERSION


class JobStatus(enum.StrEnum):
    """Where a job is (``JobRecord.status``); see :class:`JobRecord`."""

    SUBMITTED = "submitted"  # published by a batch producer, nothing heard yet
    WAITING = "waiting"  # on the OFFLINE queue
    RUNNING = "running"
    COMPLETED = "completed"  # final: ``output`` set
    FAILED = "failed"  # final: ``reason`` set, dead-lettered

    @property
    def final(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED)


@dataclass
class JobRecord(Schema):
    """A batch line or a degraded/offline request in bucket ``jobs`` (``job.<tenant>.<batch>.<id>``).

    Kept because its producer may be long gone when the job runs: the record holds the request
    (so a failed attempt can be retried), where the job is, and how it ended. ``status``:
    ``submitted`` (published by a batch producer, nothing heard yet), ``waiting`` (on the OFFLINE
    queue), ``running``, ``completed`` (``output`` set) or ``failed`` (``reason`` set, dead-lettered).
    ``attempt_id`` is the request id the current attempt runs under: the job id for the first,
    ``<id>-r<n>`` afterwards (every stage dedups on the id, so a retry needs a fresh one).
    """

    id: RequestId
    tenant: TenantId
    status: JobStatus
    batch: str = "-"
    line: int | None = None
    request: Request | None = None
    attempts: int = 0
    attempt_id: str | None = None
    #: the admission attempt ``attempt_id`` runs as now (0; a rescue re-admits it as the next:
    #: Assignment.attempt): a worker's outcome of an older one is stale (issue 26)
    admission_attempt: int = 0
    enqueued: int = 0  # times put on the OFFLINE queue (by the admitter or a retry)
    path: str | None = None  # "online" (the admitter let it run) | "offline" (the offline runner did)
    worker: WorkerId | None = None
    reason: str | None = None
    message: str | None = None
    output: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    ttft: float | None = None
    tpot: float | None = None
    created: float = 0.0
    started: float | None = None  # of the current attempt
    updated: float = 0.0
    finished: float | None = None
    history: list[dict] = field(default_factory=list)  # [{"ts", "event", "attempt", "reason"?}], capped
    v: int = SCHEMA_VERSION


@dataclass
class BatchManifest(Schema):
    """What a batch producer submitted, in bucket ``jobs`` (``batch.<batch>``): lets a re-run or
    ``--resume`` skip what is already there, and ``batch status``/``results`` enumerate its lines.

    ``spans`` are the line numbers that hold requests, as inclusive ``[first, last]`` ranges;
    ``malformed`` maps a line number (as a string) to why it was not submitted.
    """

    id: str
    tenant: TenantId
    cls: str = wire("class", "batch")
    source: str = ""
    digest: str = ""
    lines: int = 0
    spans: list[list[int]] = field(default_factory=list)
    malformed: dict = field(default_factory=dict)
    submitted: int = 0  # requests the stream acknowledged, as of the last checkpoint
    complete: bool = False  # every request line was published
    created: float = 0.0
    updated: float = 0.0
    v: int = SCHEMA_VERSION
