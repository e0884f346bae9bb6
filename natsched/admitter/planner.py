"""Who goes next: the ranking both ``evaluate`` (an arrival) and ``plan_dequeue`` (the queue) use.

A planner is a scratch copy of the usage plus cursors over the queue's lanes; picking a request
changes the copy, never the core, so planning has no side effects. The order is:

1. **Tenants** by entitlement. A tenant below its floor (``floor × total``) ranks in tier 0 by
   ``used / floor`` — the most starved relative to its guarantee first. Every other tenant ranks in
   tier 1 by ``(used − floor) / weight``, which shares idle capacity by weight (weighted
   water-filling). Tier 0 always comes first, so elastic use never takes a backlogged tenant's
   unused floor; :meth:`Planner.headroom_ok` also enforces it for the part of a request beyond the
   requester's own floor.
2. **Inside a tenant**: requests queued longer than ``aging_s`` first (oldest first), then class
   (online before batch), then arrival order. A new arrival is never aged, so an aged request
   outranks arrivals of any class or size.
3. **Long reserve**: long requests (``cost ≥ long_threshold_tokens``) have a floor of their own,
   ``reserve_long_share × total``. While any waits, a short request may not take the part of that
   reserve long requests do not hold (``usage.long``): it is picked only if ``used + cost ≤ total −
   max(0, reserve − long)``. Without this a stream of small requests takes every freed token first
   and a long request never finds room; beyond the reserve, long and short compete in order.
   (Any queued long request switches the reserve on, even one held back by its own cap.)
4. **No backfill past the top**: when the best request does not fit the free budget, planning
   stops and the budget accumulates for it (only its own cap, its model's limit or capacity, or the reserve let
   lower-ranked requests pass it). That is what makes the dequeue token-weighted rather than
   first-fit, and what keeps big requests from starving.
5. **Under pressure** — used plus queued runtime tokens at or past the degrade watermark of the
   total — class outranks tenant: the order is the tenant's tier (below its floor or not), then the
   class, then the tenant's key. So online work of any tenant goes
   before batch work of every tenant (the seed: high priority first in a surge), while two things
   stay as they were: a floor is still a guarantee (a tenant below its floor comes first, whatever
   its class, and :meth:`Planner.headroom_ok` still keeps backlogged tenants' floors), and a request
   queued longer than ``aging_s`` ranks as online work (aging promotes it) — unless its class has a
   class limit, which already guarantees it room (its limit less what it lends), so an aged batch
   backlog under a limit does not undo online's priority (:meth:`Planner.pressure_key`). Within
   one class the order is exactly the tenant-first one above, as it is without pressure.
6. **Class limits** (:mod:`natsched.admitter.classes`): a request whose class is at its limit, and
   cannot borrow the rest, waits (``class_limit``) while other classes' work passes it.
7. **Per-model capacity** (``model_totals``, :class:`natsched.admitter.dynamic.ModelTotals`): a
   request whose model's admitted tokens would pass what that model's workers can take waits
   (``model_capacity``) while other models' work passes it — each model has its own lanes in the
   queue, so a full model's backlog never fills the ``scan_limit`` window of another's. A model
   holding nothing may pass a bound smaller than the request (the bound is measured and moves;
   it must not starve the model); a model absent from the map has no live worker and waits.
   While a model's capacity is *contended* (held + queued past its bound, its room below the
   cluster's) its queued requests
   go by age (aged, class, arrival) across tenants, and an arrival of it waits behind them
   (:meth:`Planner.contended`). A *saturated* model — every engine of it has requests waiting
   (:mod:`natsched.admitter.engines`) — is held at what it holds, and is contended while any of
   its requests is queued.
8. **Adaptive LIFO** (``lifo``, :meth:`natsched.admitter.standing.StandingQueues.forming`): in a
   (model, class) lane whose oldest request has waited past the standing target, the newest
   request goes first — ahead of that lane's older ones and of aging — and an arrival of it
   outranks them too (where its model's room is contended it still queues, as 7. says, and is the
   first pick of the next dequeue). Everything else keeps the order above.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from natsched.admitter.classes import CLASS_LIMIT, ClassBook, Loan
from natsched.admitter.queue import AdmissionQueue, Entry, Lane
from natsched.admitter.quotas import Quotas, TenantQuota
from natsched.admitter.usage import Usage
from natsched.wire.schema import Request, RequestId

MODEL_CAPACITY = "model_capacity"  # a wait: the model's own workers are full (7.)

Rank = tuple[int, float]
NEVER_RANK: Rank = (-1, 0.0)  # a tenant that may no longer be admitted at all: purge its queue first


def never_fits(quotas: Quotas, total: int, tenant: str, model: str, cost: int, cls: str | None = None,
               book: ClassBook | None = None) -> tuple[str, str] | None:
    """(reason, message) when no amount of waiting lets the request in under these quotas (with
    ``cls`` and ``book``: nor under its class limit, borrowing included)."""
    quota = quotas.tenant_quota(tenant)
    if quota is None:
        return "unknown_tenant", f"tenant {tenant!r} has no quota and unknown tenants are rejected"
    if cost > total:
        return "too_large", f"needs {cost} runtime tokens, the cluster total is {total}"
    if quota.cap is not None and cost > quota.cap:
        return "tenant_cap", f"needs {cost} runtime tokens, tenant {tenant!r} is capped at {quota.cap}"
    limit = quotas.model_limit(model)
    if limit is not None and cost > limit:
        return "model_limit", f"needs {cost} runtime tokens, model {model!r} is limited to {limit}"
    if cls is not None and book is not None:
        message = book.never(cls, cost)
        if message:
            return CLASS_LIMIT, message
    return None


def tenant_rank(quota: TenantQuota | None, used: int, total: int) -> Rank:
    """(tier, key): lower goes first. See the module docstring."""
    if quota is None:
        return NEVER_RANK
    floor = quota.floor * total
    if floor > 0 and used < floor:
        return 0, used / floor
    return 1, ((used - floor) / quota.weight) if quota.weight > 0 else math.inf


class _Cursor:
    """Reads one lane in order, skipping requests already taken by this plan."""

    __slots__ = ("_it", "_buf", "_head")

    def __init__(self, entries: Iterable[Entry]) -> None:
        self._it = iter(entries)
        self._buf: list[Entry] = []
        self._head = 0

    def first(self, ok: Callable[[Entry], bool], taken: set[RequestId], limit: int) -> Entry | None:
        """The first entry (within ``limit`` of the head) that is not taken and passes ``ok``."""
        i, seen = self._head, 0
        while seen < limit:
            if i == len(self._buf):
                e = next(self._it, None)
                if e is None:
                    return None
                self._buf.append(e)
            e = self._buf[i]
            if e.id in taken:
                if i == self._head:
                    self._head += 1
            else:
                seen += 1
                if ok(e):
                    return e
            i += 1
        return None


class Planner:
    def __init__(self, queue: AdmissionQueue, quotas: Quotas, total: int, usage: Usage, now: float, *,
                 aging_s: float, reserve_long_share: float, class_rank: dict[str, int], scan_limit: int,
                 book: ClassBook | None = None, pressure: bool = False,
                 model_totals: dict[str, int | None] | None = None,
                 saturated: frozenset[str] = frozenset(),
                 lifo: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.queue = queue
        self.quotas = quotas
        self.total = total
        self.now = now
        self.aging_s = aging_s
        self.class_rank = class_rank
        self.scan_limit = scan_limit
        self.long_reserve = reserve_long_share * total
        self.used = usage.used
        self.long_used = usage.long
        self.tenant_used = dict(usage.tenants)
        self.model_used = dict(usage.models)
        self.remaining = {t: queue.tenant_count(t) for t in queue.tenants()}
        self.longs = queue.longs
        self.taken: set[RequestId] = set()
        self.model_taken: dict[str, int] = {}  # queued tokens per model this plan took out
        self._cursors: dict[tuple[str, Lane], _Cursor] = {}
        self.book = book  # class limits and loans (None: no class has a limit)
        self.pressure = pressure  # class before tenant (module docstring, 5.)
        self.model_totals = model_totals  # per-model capacity (module docstring, 7.); None: no bound
        self.saturated = saturated  # models held at what they hold now (module docstring, 7.)
        self.lifo = lifo  # (model, class) lanes served newest first (module docstring, 8.)

    # ------------------------------------------------------------------ ranks
    def rank(self, tenant: str) -> Rank:
        return tenant_rank(self.quotas.tenant_quota(tenant), self.tenant_used.get(tenant, 0), self.total)

    def entry_key(self, e: Entry) -> tuple:
        if (e.model, e.cls) in self.lifo:  # newest first, aging off (module docstring, 8.)
            return (1, self.class_rank.get(e.cls, 99), -e.enqueued_at, -e.seq)
        if self.now - e.enqueued_at >= self.aging_s:
            return (0, 0, e.enqueued_at, e.seq)
        return (1, self.class_rank.get(e.cls, 99), e.enqueued_at, e.seq)

    def arrival_key(self, cls: str, model: str | None = None) -> tuple:
        """An arrival's key against :meth:`entry_key`'s: it loses every tie."""
        if (model, cls) in self.lifo:  # the newest of its lane
            return (1, self.class_rank.get(cls, 99), -self.now, math.inf)
        if self.aging_s <= 0:
            return (0, 0, self.now, math.inf)
        return (1, self.class_rank.get(cls, 99), self.now, math.inf)

    def pressure_key(self, key: tuple, cls: str, rank: Rank, tenant: str = "") -> tuple:
        """Under pressure (module docstring, 5.): ``key`` (an entry or arrival key) of a request of
        ``cls`` from ``tenant`` of ``rank`` as (tier, class, tenant key, tenant, the key). An aged request
        ranks as the top class — aging promotes it — unless its class has a limit of its own: a
        limited class is guaranteed its limit (less what it lends), so its aged backlog need not
        pass online. With one class this is exactly the tenant-first order."""
        aged = key[0] == 0
        guarded = self.book is not None and cls in self.book.limits
        level = 0 if aged and not guarded else self.class_rank.get(cls, 99)
        return (rank[0], level, rank[1], tenant, *key)

    # ------------------------------------------------------------------ checks
    def blocked(self, tenant: str, model: str, cost: int, long: bool, quota: TenantQuota,
                cls: str | None = None) -> str | None:
        """Why this request must wait although it could fit one day (None: it may go now)."""
        if quota.cap is not None and self.tenant_used.get(tenant, 0) + cost > quota.cap:
            return "tenant_cap"
        limit = self.quotas.model_limit(model)
        if limit is not None and self.model_used.get(model, 0) + cost > limit:
            return "model_limit"
        if self.over_model_capacity(model, cost):
            return MODEL_CAPACITY
        if not long and self.longs > 0:
            if self.used + cost > self.total - max(0.0, self.long_reserve - self.long_used):
                return "long_reserve"
        if cls is not None and self.loan(cls, cost) is None:
            return CLASS_LIMIT
        return None

    def over_model_capacity(self, model: str, cost: int) -> bool:
        """``cost`` more would pass what the model's own workers can take (module docstring, 7.)."""
        if model in self.saturated:
            return True  # every engine of it has requests waiting: it takes none (admitter/engines.py)
        if self.model_totals is None:
            return False
        if model not in self.model_totals:
            return True  # no live worker serves it: wait for one
        bound = self.model_totals[model]
        held = self.model_used.get(model, 0)
        return bound is not None and held + cost > bound and (held > 0 or bound <= 0)

    def loan(self, cls: str, cost: int) -> Loan | None:
        """What an admission of ``cost`` in ``cls`` borrows now ({}: nothing), None: it cannot."""
        return {} if self.book is None else self.book.fit(cls, cost)

    def fits_total(self, cost: int) -> bool:
        return self.used + cost <= self.total

    def headroom_ok(self, tenant: str, quota: TenantQuota, cost: int) -> bool:
        """The part of ``cost`` beyond the tenant's own floor may not eat other backlogged tenants'
        unused floors."""
        own_room = max(0.0, quota.floor * self.total - self.tenant_used.get(tenant, 0))
        if cost <= own_room:
            return True
        reserved = 0.0
        for other, left in self.remaining.items():
            if left and other != tenant:
                q = self.quotas.tenant_quota(other)
                if q is not None:
                    reserved += max(0.0, q.floor * self.total - self.tenant_used.get(other, 0))
        return self.total - self.used - cost >= reserved

    def _eligible(self, e: Entry, quota: TenantQuota | None) -> bool:
        if quota is None or never_fits(self.quotas, self.total, e.tenant, e.model, e.cost, e.cls, self.book):
            return True  # surfaces so that the plan rejects it
        return self.blocked(e.tenant, e.model, e.cost, e.long, quota, e.cls) is None

    # ------------------------------------------------------------------ picking
    def top(self, excluded: set[str] = frozenset()) -> tuple[Entry, Rank] | None:
        """The best eligible queued request and its tenant's rank, or None."""
        order = sorted((self.rank(t), t) for t, left in self.remaining.items() if left and t not in excluded)
        found = self._top_by_class(order) if self.pressure else self._top_by_tenant(order)
        if found is not None and self.contended(found[0].model):
            return self._oldest_of(found[0].model, order) or found
        return found

    def _top_by_tenant(self, order: list[tuple[Rank, str]]) -> tuple[Entry, Rank] | None:
        for rank, tenant in order:
            best = self._best(tenant)
            if best is not None:
                return best, rank
        return None

    def contended(self, model: str) -> bool:
        """The model's own capacity binds (module docstring, 7.): what it holds and what is queued
        for it pass its bound, and its room is less than the cluster's. Its requests then go by age across tenants: the tenant order ranks
        by what a tenant holds of the whole cluster, which says nothing of its share of this
        model's workers (a tenant heavy on another model would wait here until it timed out)."""
        held = self.model_used.get(model, 0)
        queued = self.queue.model_tokens(model) - self.model_taken.get(model, 0)
        if model in self.saturated:
            return queued > 0
        if self.model_totals is None:
            return False
        bound = self.model_totals.get(model, 0)
        if bound is None:
            return False
        # only where the model's own room is the tighter one: with one model (or a pool as large as
        # the cluster) the cluster total binds and the tenant order (floors, weights) stays as it is
        return queued > 0 and held + queued > bound and bound - held < self.total - self.used

    def _oldest_of(self, model: str, order: list[tuple[Rank, str]]) -> tuple[Entry, Rank] | None:
        """The eligible queued request of ``model`` first by (aged, class, arrival), of any tenant
        (by :meth:`entry_key`: newest first in a LIFO lane)."""
        found, found_key = None, None
        for rank, tenant in order:
            quota = self.quotas.tenant_quota(tenant)
            for lane, entries in self.queue.lanes(tenant).items():
                if lane[2] != model:
                    continue
                e = self._cursor(tenant, lane, entries).first(lambda x: self._eligible(x, quota), self.taken,
                                                              self.scan_limit)
                if e is not None and (found_key is None or self.entry_key(e) < found_key):
                    found, found_key = (e, rank), self.entry_key(e)
        return found

    def _cursor(self, tenant: str, lane: Lane, entries) -> _Cursor:
        cursor = self._cursors.get((tenant, lane))
        if cursor is None:
            values = reversed(entries.values()) if (lane[2], lane[0]) in self.lifo else entries.values()
            cursor = self._cursors[(tenant, lane)] = _Cursor(values)
        return cursor

    def _top_by_class(self, order: list[tuple[Rank, str]]) -> tuple[Entry, Rank] | None:
        """Under pressure: each tenant's best, by :meth:`pressure_key`. ``order`` is by rank, so
        the walk stops at the first request of the top level (no later tenant can beat it) or
        when the tier changes: with one class it looks at as many tenants as the plain order."""
        found, found_key = None, None
        top_level = min(self.class_rank.values(), default=0)
        for rank, tenant in order:
            if found_key is not None and (found_key[1] <= top_level or rank[0] > found_key[0]):
                break
            key_of = lambda e, rank=rank: self.pressure_key(self.entry_key(e), e.cls, rank, e.tenant)  # noqa: E731
            e = self._best(tenant, key_of)
            if e is None:
                continue
            key = key_of(e)
            if found_key is None or key < found_key:
                found, found_key = (e, rank), key
        return found

    def _best(self, tenant: str, key_of: Callable[[Entry], tuple] | None = None) -> Entry | None:
        """The tenant's best eligible queued request (by ``key_of``; default: aged, class, arrival)."""
        key_of = key_of or self.entry_key
        quota = self.quotas.tenant_quota(tenant)
        best, best_key = None, None
        for lane, entries in self.queue.lanes(tenant).items():
            e = self._cursor(tenant, lane, entries).first(lambda x: self._eligible(x, quota), self.taken, self.scan_limit)
            if e is not None:
                key = key_of(e)
                if best_key is None or key < best_key:
                    best, best_key = e, key
        return best

    def take(self, e: Entry, admit: bool, loan: Loan | None = None) -> None:
        """Account for ``e`` leaving the queue (admitted, with ``loan`` borrowed, or rejected) in this plan."""
        self.taken.add(e.id)
        self.model_taken[e.model] = self.model_taken.get(e.model, 0) + e.cost
        self.remaining[e.tenant] -= 1
        self.longs -= e.long
        if admit:
            self.add_usage(e.tenant, e.model, e.cost, e.long, e.cls, loan or {})

    def add_usage(self, tenant: str, model: str, cost: int, long: bool, cls: str | None = None,
                  loan: Loan | None = None) -> None:
        if self.book is not None and cls is not None:
            self.book.add(cls, cost, loan or {})
        self.used += cost
        self.long_used += cost if long else 0
        self.tenant_used[tenant] = self.tenant_used.get(tenant, 0) + cost
        self.model_used[model] = self.model_used.get(model, 0) + cost

    def arrival_outranks(self, request: Request, top: tuple[Entry, Rank] | None) -> bool:
        """Whether a new arrival goes before the best queued request (it loses every tie)."""
        if top is None:
            return True
        entry, top_rank = top
        mine = self.rank(request.tenant)
        if self.pressure:  # class before tenant (module docstring, 5.); it still loses every tie
            a = self.pressure_key(self.arrival_key(request.cls, request.model), request.cls, mine)[:3]
            b = self.pressure_key(self.entry_key(entry), entry.cls, top_rank)[:3]
            if a != b:
                return a < b
        if request.tenant != entry.tenant:
            return mine < top_rank
        return self.arrival_key(request.cls, request.model) < self.entry_key(entry)
