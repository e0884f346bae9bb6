"""Rollback of the routing config and the quotas from their buckets' history.

Both buckets keep 10 revisions per key (``natsched.bus.provision``). A KV revision is the
bucket stream's sequence number, so it orders writes across keys: the bucket "as of revision R"
is, for each key, its latest entry at or below R. A rollback writes that state again as new
revisions — it is itself an edit, and can be rolled back.

- routing (``natsched route rollback [--to REV]``): one key, ``router``; by default the revision
  before the one in force.
- quotas (``natsched quota rollback [--to REV]``): many keys per edit; every ``quota set`` writes
  the ``change`` marker last, so by default the bucket goes back to where the previous marker
  left it (one edit undone). ``cluster.dynamic_total`` (the admitters' own) is never touched.

The functions here are pure: history rows in, the state to write out.
"""

from __future__ import annotations

from dataclasses import dataclass

from natsched.errors import NatschedError
from natsched.wire import subjects as S

Row = tuple[str, "bytes | None", int, str]  # (key, value or None when deleted, revision, operation)


class RollbackError(NatschedError):
    """No such revision, or one older than the history kept."""


@dataclass
class Plan:
    target: int  # the revision whose state is restored
    put: dict[str, bytes]  # keys to write (their value at the target)
    delete: list[str]  # keys that did not exist at the target


def route_target(rows: list[Row], to: int | None) -> tuple[int, bytes]:
    """(revision, value) of the routing config to restore: ``to``, else the one before the
    current. RollbackError when there is none."""
    puts = [(rev, value) for key, value, rev, _ in rows if key == S.KEY_ROUTER_CONFIG and value is not None]
    kept = ", ".join(str(rev) for rev, _ in puts) or "none"
    if to is None:
        if len(puts) < 2:
            raise RollbackError(f"no earlier routing config to roll back to (revisions kept: {kept})")
        return puts[-2]
    for rev, value in puts:
        if rev == to:
            return rev, value
    raise RollbackError(f"revision {to} is not a routing config in the history (revisions kept: {kept})")


def _quota_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r[0] != S.KEY_DYNAMIC_TOTAL]


def quota_target(rows: list[Row], to: int | None) -> int:
    """The revision to restore: ``to``, else where the previous ``change`` marker left the bucket
    (0, the empty bucket, when the edit in force is the first)."""
    rows = _quota_rows(rows)
    if to is not None:
        if to < 0 or (rows and to > rows[-1][2]):
            raise RollbackError(f"revision {to} is outside the bucket's history (latest {rows[-1][2] if rows else 0})")
        return to
    markers = [rev for key, value, rev, _ in rows if key == S.KEY_QUOTA_CHANGE and value is not None]
    if not markers:
        raise RollbackError("no quota edit recorded to undo (natsched quota history lists the revisions; "
                            "use --to REV)")
    return markers[-2] if len(markers) >= 2 else 0


def quota_plan(rows: list[Row], target: int, history: int) -> Plan:
    """What to write so the quotas are as they were at ``target``. RollbackError when a key's
    kept history starts after ``target`` with all ``history`` slots used (its value then is lost)."""
    rows = _quota_rows(rows)
    by_key: dict[str, list[Row]] = {}
    for row in rows:
        by_key.setdefault(row[0], []).append(row)
    put, delete = {}, []
    for key, entries in sorted(by_key.items()):
        if key == S.KEY_QUOTA_CHANGE:
            continue
        before = [r for r in entries if r[2] <= target]
        now = entries[-1][1]
        if before:
            then = before[-1][1]
        elif len(entries) >= history:
            raise RollbackError(f"revision {target} is older than the history kept for {key} ({history} "
                                f"revisions, the oldest {entries[0][2]})")
        else:
            then = None  # the key did not exist yet
        if then == now:
            continue
        if then is None:
            delete.append(key)
        else:
            put[key] = then
    return Plan(target, put, delete)
