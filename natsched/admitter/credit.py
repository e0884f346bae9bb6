"""Credit: runtime tokens a replica reserves ahead, so most of its allows need no shared write.

Why: an allow committed by compare-and-swap waits for one round trip to the server before its
request can go out, and under load every such wait includes the other processes' turns on the
cores. ``natsched bench pipeline`` measured it as the largest part of the admitter's latency (a
relay without it meets the 2 ms target; the admitter with it did not). The classic answer in
distributed rate limiting (Google's Doorman, Envoy's quota leases) is to lease capacity ahead
and spend it locally; this module is that lease for runtime tokens.

How it stays exact:

- A *block* is granted for one (tenant, model) pair by the same compare-and-swap as any allow,
  only when the policy would allow a request of that size for that pair and ``slack`` of the
  total stays free after it (near capacity there is no credit: every allow is committed, as
  before). The block is counted in the shared usage like a reservation of that pair, so every
  other replica already sees it as used; nothing paid from it can exceed any limit.
- A replica pays a short request from its block when its own policy allows it on the usage
  *minus its own unused credit* (:meth:`Credit.view`): what it holds but has not spent is room
  for itself, and for no one else.
- Other replicas see a whole block as that tenant's usage, which is conservative: with several
  replicas a tenant near its cap may be refused up to the others' unused credit early. With one
  replica the view is exact.
- A release of a request paid from a block goes back into the block (the holder, locally) or
  out of the block and the aggregate (any other replica, by compare-and-swap); the
  reservation's record carries the block's epoch, which says which.
- Blocks are sized to ``horizon_s`` of the pair's recent demand (nothing for a pair that sees
  fewer than ``min_requests`` requests in that time), bounded by ``max_share`` of the total per
  replica, given back when unused for ``idle_s`` or whenever this replica holds queued requests
  (credit must never keep waiting work out).
- Every write of the holder moves its entry's ``beat``. A holder stops spending credit
  ``lease_s / 2`` after its last write was sent, unless a newer write renewed it; any replica
  drops an entry whose beat has not moved for ``lease_s`` (its own clock, started when it saw
  that beat, which is after the write was sent). Dropping never lowers the aggregate: the
  requests paid from the block are still running and are then released on their own, and the
  unused part is drift that the reconciliation repairs.

Pure module: no I/O (``natsched.admitter.service`` performs the writes this plans).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Callable

from natsched.admitter.errors import SettingsError
from natsched.admitter.usage import Usage

Key = tuple[str, str]  # (tenant, model)
_epochs = itertools.count(1)


@dataclass
class CreditSettings:
    enabled: bool = True
    horizon_s: float = 0.1  # a block holds this long of its pair's recent demand
    min_requests: float = 2.0  # no block for a pair that sees fewer of its requests in horizon_s
    max_share: float = 0.05  # all of one replica's blocks: at most this share of the total
    slack: float = 0.1  # a block is granted only if this share of the total stays free after it
    idle_s: float = 1.0  # a block unused this long is given back
    lease_s: float = 10.0  # a holder whose entry has not moved this long loses it
    demand_tau_s: float = 1.0  # time constant of the demand estimate
    tick_s: float = 0.05  # how often the keeper looks (it also wakes when a block runs low)

    def __post_init__(self) -> None:
        for name in ("horizon_s", "lease_s", "demand_tau_s", "tick_s", "idle_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"credit {name} must be > 0, got {getattr(self, name)}")
        for name in ("max_share", "slack"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SettingsError(f"credit {name} must be between 0 and 1, got {getattr(self, name)}")
        if self.min_requests < 1:
            raise SettingsError(f"credit min_requests must be >= 1, got {self.min_requests}")


@dataclass
class _Demand:
    """Tokens allowed for a pair, decayed with time constant tau: value / tau is a rate."""

    value: float = 0.0
    at: float = 0.0
    last_cost: int = 0
    last_use: float = 0.0


@dataclass
class KeeperPlan:
    """One write the keeper wants: the usage it writes and the changes to the local credit."""

    usage: Usage
    deltas: dict[Key, int] = field(default_factory=dict)  # + granted, - given back
    dropped: list[str] = field(default_factory=list)  # other replicas' entries removed
    lost: bool = False  # our entry was gone (or another epoch's): our unused credit is lost


class Credit:
    """This replica's side of its credit: what it holds unspent, per pair, and its lease."""

    def __init__(self, replica: str, settings: CreditSettings | None = None) -> None:
        self.replica = replica
        self.settings = settings or CreditSettings()
        self.epoch = self._new_epoch()
        self.free: dict[Key, int] = {}
        self.valid_until = -math.inf  # monotonic; spending stops then unless renewed
        self.last_write = -math.inf  # monotonic: when our last write of the usage was sent
        self.demand: dict[Key, _Demand] = {}
        self._seen: dict[str, tuple[str, int, float]] = {}  # other replica -> (epoch, beat, first seen)

    def _new_epoch(self) -> str:
        return f"{self.replica}.{os.getpid()}.{next(_epochs)}.{os.urandom(3).hex()}"

    # --- spending ---------------------------------------------------------------------
    def usable(self, usage: Usage, now: float) -> bool:
        """Whether unspent credit may be spent now: enabled, leased, and our entry is the one shared."""
        return self.settings.enabled and now < self.valid_until and usage.credit(self.replica, self.epoch) is not None

    def view(self, usage: Usage, free: dict[Key, int] | None = None) -> Usage:
        """The usage as this replica decides on it: minus what it holds but has not spent."""
        for (tenant, model), n in (self.free if free is None else free).items():
            if n:
                usage = usage.minus(tenant, model, n)
        return usage

    def spend(self, key: Key, tokens: int) -> None:
        self.free[key] = self.free.get(key, 0) - tokens

    def refund(self, key: Key, tokens: int) -> None:
        """A request paid from our block finished: its tokens are ours to spend again."""
        self.free[key] = self.free.get(key, 0) + tokens

    def note(self, key: Key, tokens: int, now: float) -> None:
        """A short request of this pair was allowed (paid from credit or not): demand."""
        d = self.demand.get(key)
        if d is None:
            d = self.demand[key] = _Demand(at=now)
        d.value = d.value * math.exp(-(now - d.at) / self.settings.demand_tau_s) + tokens
        d.at, d.last_cost, d.last_use = now, tokens, now

    def target(self, key: Key, now: float) -> int:
        """Tokens a block of this pair should hold: ``horizon_s`` of its demand, or 0."""
        d = self.demand.get(key)
        if d is None or not d.last_cost:
            return 0
        rate = d.value * math.exp(-(now - d.at) / self.settings.demand_tau_s) / self.settings.demand_tau_s
        want = rate * self.settings.horizon_s
        return int(want) if want >= self.settings.min_requests * d.last_cost else 0

    def low(self, key: Key, now: float) -> bool:
        """The block runs low: the keeper should top it up before requests miss it."""
        target = self.target(key, now)
        return target > 0 and self.free.get(key, 0) < target // 2

    # --- the keeper's write -----------------------------------------------------------
    def plan(self, usage: Usage, now: float, total: int, queue_busy: bool,
             grantable: Callable[[Usage, str, str, int], bool]) -> KeeperPlan | None:
        """What to write now (None: nothing). Pure but for noting the others' beats; re-run on
        the fresh usage after a lost race.

        ``grantable(usage, tenant, model, tokens)`` is the policy's word on a block (as on a
        request of that size for that pair); ``queue_busy``: this replica holds queued requests.
        """
        plan = KeeperPlan(usage)
        mine = usage.credit(self.replica)
        if mine is not None and mine.epoch != self.epoch:  # an earlier life of this replica
            plan.usage = plan.usage.drop_credit(self.replica)
            mine = None
        plan.lost = mine is None and self.last_write > -math.inf  # dropped while we were past our lease
        free = {} if plan.lost else {k: n for k, n in self.free.items() if n > 0}
        for replica in self._silent(usage, now):
            plan.usage = plan.usage.drop_credit(replica)
            plan.dropped.append(replica)
        epoch = self._new_epoch() if plan.lost else self.epoch
        for key, n in free.items():  # give back first: that room counts for the grants
            keep = self._keep(key, n, now, queue_busy)
            if n > keep:
                plan.usage = plan.usage.give_back(self.replica, epoch, key[0], key[1], n - keep)
                plan.deltas[key] = keep - n
        if self.settings.enabled and not queue_busy:
            self._grant(plan, free, epoch, now, total, grantable)
        holding = any(free.get(k, 0) + plan.deltas.get(k, 0) > 0 for k in set(free) | set(plan.deltas))
        if not holding:
            # nothing unspent: no entry to keep alive. What was paid from it is still running
            # and is released on its own from now on (a new entry gets a new epoch)
            plan.usage = plan.usage.drop_credit(self.replica)
        elif plan.deltas or plan.lost or now - self.last_write > self.settings.lease_s / 4:
            plan.usage = plan.usage.renew(self.replica, epoch)
        return None if plan.usage is usage else plan

    def _keep(self, key: Key, n: int, now: float, queue_busy: bool) -> int:
        """How much of ``n`` unspent tokens of ``key`` to keep."""
        d = self.demand.get(key)
        if queue_busy or not self.settings.enabled or d is None or now - d.last_use > self.settings.idle_s:
            return 0
        target = self.target(key, now)
        return n if n <= 2 * target else target

    def _grant(self, plan: KeeperPlan, free: dict[Key, int], epoch: str, now: float, total: int,
               grantable: Callable[[Usage, str, str, int], bool]) -> None:
        entry = plan.usage.credit(self.replica)
        room = int(self.settings.max_share * total) - (entry.total() if entry is not None else 0)
        for key in sorted(self.demand):
            target = self.target(key, now)
            have = free.get(key, 0) + plan.deltas.get(key, 0)
            if room <= 0 or target <= 0 or have >= target // 2 or key in plan.deltas:
                continue
            want = min(target - have, room)
            if plan.usage.used + want > (1.0 - self.settings.slack) * total:
                continue
            if not grantable(plan.usage, key[0], key[1], want):
                continue
            plan.usage = plan.usage.grant(self.replica, epoch, key[0], key[1], want)
            plan.deltas[key] = want
            room -= want

    def applied(self, plan: KeeperPlan, sent: float) -> None:
        """After ``plan``'s write succeeded (``sent``: when it was sent, monotonic)."""
        if plan.lost:
            self.free = {}
        for key, delta in plan.deltas.items():
            left = self.free.get(key, 0) + delta
            if left > 0:
                self.free[key] = left
            else:
                self.free.pop(key, None)
        entry = plan.usage.credit(self.replica)
        if entry is not None:
            self.epoch = entry.epoch
            self.last_write = sent
            self.valid_until = sent + self.settings.lease_s / 2
        else:  # dropped: a later entry must not back the requests paid from this one
            self.epoch = self._new_epoch()
            self.last_write = self.valid_until = -math.inf
        for replica in plan.dropped:
            self._seen.pop(replica, None)

    def forget_demand(self, now: float) -> None:
        """Drop the demand of pairs idle for long (bounded memory with many tenants)."""
        for key in [k for k, d in self.demand.items() if now - d.last_use > 60 * self.settings.idle_s
                    and not self.free.get(k)]:
            del self.demand[key]

    def _silent(self, usage: Usage, now: float) -> list[str]:
        """Other replicas whose entry has not moved for ``lease_s`` (as seen from here)."""
        out = []
        for replica, entry in usage.credits.items():
            if replica == self.replica:
                continue
            seen = self._seen.get(replica)
            if seen is None or seen[:2] != (entry.epoch, entry.beat):
                self._seen[replica] = (entry.epoch, entry.beat, now)
            elif now - seen[2] > self.settings.lease_s:
                out.append(replica)
        for replica in [r for r in self._seen if r not in usage.credits]:
            del self._seen[replica]
        return out
