"""``Nats-Msg-Id`` values: the JetStream dedup key of every message a stage publishes.

A stream stores a message once per id within its dedup window, so a publish retried after a
lost ack (or by a second replica doing the same work) is not stored twice. The id is the
request id, and every later stage adds its own suffix: one request leaves one message per
stage, and one per attempt where a stage may run again::

    <id>                       the request (raw publishers): REQUESTS
    <id>:req<tag>              the request as the client and batch producer publish it (tag: per tenant): REQUESTS
    <id>:adm[:<attempt>]       admitted (admitter, offline runner; a rescue's re-admission): ADMITTED
    <id>:work[:<attempt>]      assigned to a worker (router, inline routing): WORK
    <id>:done:<fence>          its completion (worker, or the router when it cannot route): COMPLETIONS
    <id>:admission | :queue    the admission decision (a queued request is decided twice): DECISIONS
    <id>:rescue:<attempt>      a rescue from a dead worker: DECISIONS
    <id>:routing               the routing decision: DECISIONS
    <id>:offline[<enqueued>]   degraded to the OFFLINE queue, or put back there: OFFLINE
    <id>:offline[-<what><attempt>-<enqueued>]   the offline runner's decision: DECISIONS
    <id>:dead                  a job given up: DEADLETTER

Built here and parsed here (the audit finds a request's records by the id before the first
``:``); ``subjects.md`` lists them. Pure module: no I/O.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
from dataclasses import dataclass

from natsched.wire.ids import TOKEN

SEP = ":"


class Kind(enum.StrEnum):
    """The suffix that names the stage (absent on the request itself: ``REQUEST``)."""

    REQUEST = ""
    ADMITTED = "adm"
    WORK = "work"
    COMPLETION = "done"
    ADMISSION = "admission"
    QUEUE = "queue"
    RESCUE = "rescue"
    ROUTING = "routing"
    OFFLINE = "offline"
    DEAD = "dead"
    SUBMISSION = "req"


def _with(request_id: str, kind: Kind, detail: str = "") -> str:
    return f"{request_id}{SEP}{kind}{detail}"


def _attempt(attempt: int) -> str:
    return f"{SEP}{attempt}" if attempt else ""


def request(request_id: str) -> str:
    """A request as its producer publishes it: the id itself."""
    return request_id


def submission(request_id: str, key: str) -> str:
    """A request as natsched's producers publish it: ``<id>:req<tag>``, ``<tag>`` an HMAC of the id
    with the tenant's reply key (:func:`natsched.wire.fence.reply_key`). A publisher sets its own
    ``Nats-Msg-Id`` and the server dedups on it alone, so with the bare id as the message id a
    tenant knowing another's future id could take its dedup slot; no other tenant knows the key.
    The same tenant submitting the same id again gets the same message id: deduplicated."""
    tag = hmac.new(key.encode(), f"natsched-submit\x00{request_id}".encode(), hashlib.sha256).hexdigest()[:16]
    return _with(request_id, Kind.SUBMISSION, tag)


def admitted(request_id: str, attempt: int = 0) -> str:
    """On ADMITTED: ``<id>:adm``, or ``<id>:adm:<attempt>`` for a rescue's re-admission."""
    return _with(request_id, Kind.ADMITTED, _attempt(attempt))


def work(request_id: str, attempt: int = 0) -> str:
    """On WORK: ``<id>:work``, ``<id>:work:<attempt>`` for a re-admitted one."""
    return _with(request_id, Kind.WORK, _attempt(attempt))


def completion(request_id: str, fence: str = "") -> str:
    """On COMPLETIONS: ``<id>:done:<fence>``, one per attempt and worker. The assignment's fencing
    token (:mod:`natsched.wire.fence`) is in it so that no other worker can know it in advance
    and take the real completion's dedup slot (``<id>:done`` without one: no fence known)."""
    return _with(request_id, Kind.COMPLETION, f"{SEP}{fence}" if fence else "")


def admission(request_id: str, queued: bool = False) -> str:
    """The admission decision: ``<id>:queue`` when held in the queue, ``<id>:admission`` for the final one."""
    return _with(request_id, Kind.QUEUE if queued else Kind.ADMISSION)


def rescue(request_id: str, attempt: int) -> str:
    """The decision to re-admit a dead worker's request: ``<id>:rescue:<attempt>``."""
    return _with(request_id, Kind.RESCUE, f"{SEP}{attempt}")


def routing(request_id: str) -> str:
    """The routing decision: ``<id>:routing``."""
    return _with(request_id, Kind.ROUTING)


def offline(request_id: str, enqueued: int = 0) -> str:
    """On OFFLINE: ``<id>:offline`` (degraded by the admitter), ``<id>:offline<n>`` (its n-th time there)."""
    return _with(request_id, Kind.OFFLINE, str(enqueued) if enqueued else "")


def offline_decision(request_id: str, what: str = "allow", attempt: int = 0, enqueued: int = 0) -> str:
    """The offline runner's decision: ``<id>:offline`` when it lets a job run, else one per
    attempt and queueing, ``<id>:offline-<what><attempt>-<enqueued>`` (retry, requeue, fail)."""
    return _with(request_id, Kind.OFFLINE, "" if what == "allow" else f"-{what}{attempt}-{enqueued}")


def dead(request_id: str) -> str:
    """On DEADLETTER: ``<id>:dead``."""
    return _with(request_id, Kind.DEAD)


_PARSE = re.compile(rf"\A({TOKEN})(?:{SEP}([a-z]+)(.*))?\Z", re.S)
_KINDS = {k.value: k for k in Kind if k is not Kind.REQUEST}


@dataclass(frozen=True)
class MsgId:
    """A parsed ``Nats-Msg-Id``: the request, the stage, and what follows the stage's name."""

    request_id: str
    kind: Kind
    detail: str = ""  # ":<attempt>", "<enqueued>", "-<what><attempt>-<enqueued>" or ""

    @property
    def attempt(self) -> int | None:
        """The attempt a ``:adm:<n>``, ``:work:<n>`` or ``:rescue:<n>`` names, else None."""
        tail = self.detail[1:] if self.detail.startswith(SEP) else ""
        return int(tail) if tail.isdigit() else None

    def __str__(self) -> str:
        return self.request_id if self.kind is Kind.REQUEST else _with(self.request_id, self.kind, self.detail)


def parse(msg_id: str) -> MsgId | None:
    """The parts of a natsched ``Nats-Msg-Id``, or None for one this module did not build."""
    m = _PARSE.match(msg_id)
    if m is None:
        return None
    if m.group(2) is None:
        return MsgId(m.group(1), Kind.REQUEST)
    kind = _KINDS.get(m.group(2))
    return None if kind is None else MsgId(m.group(1), kind, m.group(3))


def request_of(msg_id: str) -> str:
    """The request id a ``Nats-Msg-Id`` belongs to: the part before the first ``:``."""
    return msg_id.split(SEP, 1)[0]
