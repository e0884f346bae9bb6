"""Changing the partition count (issue 27): refused until the partitions it leaves are drained.

A tenant's partition is nats-server's ``partition(P, tenant)`` hash, so changing P moves tenants:
``up --partitions 2`` then ``--partitions 4``, or a plain ``up`` after a partitioned one. What the
old partition set still holds would then be lost or counted twice:

- requests stored under the old subjects (``reqp.<k>.…`` for the old P, ``req.…`` for P = 1)
  that its consumer has not delivered or not yet decided: the new set's consumers filter the new
  mapping, so a request of a moved tenant stored under its old partition is never decided (a
  consumer that keeps its name, ``admitter-p0``, now serves other tenants and drops it as not its own);
- reservations in the old partition's bucket (requests admitted and still running): the new
  partition of their tenant does not see them, so it admits up to its budget *beside* them
  (over-admission), and their completions release nothing there.

Moving them live (adopting another partition's records under the plan's epoch) is not built;
instead :func:`change_partitions` reads the old set's consumers and usage keys and refuses, with
every reason, while anything is pending. Drained (all decided and completed), a change loses
and duplicates nothing: every old consumer's ack floor is past every stored request, the new
consumers start on new subjects, and the old buckets hold no reservation. The old set's budget
plan and reports go with it (:func:`forget_budget`): the new set's coordinator plans from zero.
The old set's admitters must be stopped first (``natsched up`` starts none before the change).

Stop the producers (or the gateway) before a change: a request published between the check and
the stream update is stored under the old mapping; :func:`change_partitions` checks again after
the update and raises if one slipped in under a partition the new set does not have (run the
old P again to drain it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from natsched.admitter.errors import AdmitterError, UsageError
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S

if TYPE_CHECKING:
    from natsched.bus.connection import Bus

log = logging.getLogger(__name__)


class PartitionMoveError(AdmitterError):
    """A partition count change refused: the partitions it leaves still hold requests or reservations."""


def partition_set(partitions: int) -> list[tuple[str, str, str]]:
    """(request consumer, the subjects it consumes, in-flight bucket) of every partition of ``partitions``."""
    if partitions == 1:
        return [(S.CONSUMER_ADMITTER, S.REQUESTS_ALL, S.BUCKET_INFLIGHT)]
    return [(S.partition_admitter(k), S.partition_requests(k), S.partition_bucket(k)) for k in range(partitions)]


def reserved(usage: Usage) -> int:
    """Runtime tokens reserved for requests: ``used`` without unspent credit blocks (a credit is
    no request: it lapses with its lease, and partitions use none)."""
    return usage.used - sum(usage.credit_by_tenant().values())


async def pending_in(bus: Bus, partitions: int, besides: int | None = None) -> list[str]:
    """Why the partition set of ``partitions`` is not drained (empty: it is); with ``besides``,
    only its partitions whose consumer the set of ``besides`` does not also use."""
    keep = {d for d, _, _ in partition_set(besides)} if besides is not None else set()
    why: list[str] = []
    for durable, subjects, bucket in partition_set(partitions):
        if durable in keep:
            continue
        backlog = await bus.consumer_backlog(S.STREAM_REQUESTS, durable)
        if backlog is None:  # never consumed: every request stored there is pending
            stored = sum((await bus.subject_counts(S.STREAM_REQUESTS, subjects)).values())
            if stored:
                why.append(f"{stored} request(s) stored under {subjects} and no consumer {durable} to decide them")
        elif backlog[0] or backlog[1]:
            why.append(f"consumer {durable}: {backlog[0]} request(s) not delivered, {backlog[1]} delivered and "
                       f"not decided")
        got = await bus.kv(bucket).get(S.KEY_USAGE)
        try:
            held = reserved(Usage.from_json(got[0])) if got and got[0] else 0
        except UsageError as exc:
            why.append(f"{bucket}/{S.KEY_USAGE} unreadable ({exc}): its reservations are unknown")
            continue
        if held > 0:
            why.append(f"{bucket}/{S.KEY_USAGE}: {held} runtime tokens reserved by requests still running")
    return why


async def forget_budget(bus: Bus) -> None:
    """The old set's plan and reports removed: its grants name partitions of the old P and its
    stopped replicas' reports would hold the new set's raises back until they age out (the new
    set started with budget 0 in partitions the old plan did not name). Drained, they guard nothing."""
    kv = bus.kv(S.BUCKET_BUDGET)
    for key in [*(await kv.snapshot(S.REPORTS_ALL)), S.KEY_PLAN]:
        await kv.delete(key)


async def change_partitions(bus: Bus, partitions: int) -> bool:
    """``bus.set_partitions(partitions)`` (True when P changed), refused with
    :class:`PartitionMoveError` while the partition set it leaves is not drained."""
    current = await bus.partitions()
    if current == partitions:
        return await bus.set_partitions(partitions)  # (idempotent: the buckets exist)
    why = await pending_in(bus, current)
    if why:
        raise PartitionMoveError(
            f"cannot change partitions {current} -> {partitions}: tenants would move with requests still pending "
            f"in their old partition ({'; '.join(why)}). Run with --partitions {current} until they are decided and "
            f"completed (natsched status shows nothing in flight), stop the producers, then change it")
    changed = await bus.set_partitions(partitions)
    await forget_budget(bus)
    late = await pending_in(bus, current, besides=partitions)  # (a shared name now serves the new mapping)
    if late:
        raise PartitionMoveError(
            f"partitions changed {current} -> {partitions}, but requests arrived under the old mapping during the "
            f"change ({'; '.join(late)}): run with --partitions {current} to drain them, stop the producers, retry")
    log.warning("partitions changed %d -> %d: the old partition set was drained", current, partitions)
    return changed
