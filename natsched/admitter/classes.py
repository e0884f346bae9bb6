"""Class limits and loans: how much online, batch and offline work may hold, and how a surge of
online work borrows batch's room and gives it back. Pure module: no I/O.

A *class limit* (``class.<c>.limit`` in the quotas bucket) caps the runtime tokens all tenants'
requests of one class hold together, cluster-wide, beside the per-tenant floors and caps. Without
lending it is a hard cap. With lending (``admission.lend_to``, default ``["online"]``), a class in
``lend_to`` whose own limit is full may *borrow* from the classes ranked below it (``class_rank``:
online before batch before offline) that have a limit of their own. The state is two counts in
the shared usage: ``classes[c]`` (what class *c* holds, borrowed part included) and
``loans[(borrower, lender)]``.

The rule, and why:

- **What may be lent** (:meth:`ClassBook.lendable`). Never more than the lender's *free* room:
  its limit minus what it holds and what it lent already, so the lender's limit is never
  oversubscribed. Of that, the part the lender does not want itself (free room beyond the tokens
  of its own queued requests) may always be lent: lending idle room costs the lender nothing until
  it comes back. Room the lender's queue is waiting for may be lent only *in a surge* — the
  cluster past the degrade watermark (used + queued ≥ watermark × total) — and only up to
  ``lend_share`` of the lender's limit in loans at once: that is the seed's "lend low-priority
  quota to high priority in a surge", bounded so that the lender keeps ``1 − lend_share`` of its
  limit while its backlog waits. ``lend_share = 0`` lends idle room only.
- **When borrowing stops**: as soon as the lender's own demand (its queued tokens) reaches its
  free room and the surge is over, or the surge cap is reached; nothing already running is
  pre-empted (a running request's KV cannot be taken back).
- **How it is given back** (:func:`repay`): every release of the borrower's class repays its
  loans *first* — the lender's room comes back at the rate the borrower finishes anything, before
  the borrower regains its own room. So a loan lasts at most as long as the longest request
  admitted while it grew, and needs no per-request bookkeeping: the records stay as they are,
  and a reconciliation that rebuilds the class counts from them keeps the loans, clamped to what
  the borrower still holds. Borrow from the lowest-ranked lender first (offline before batch),
  repay the highest-ranked first (batch before offline): the most urgent lender is made whole
  first.

Credit blocks (``natsched.admitter.credit``) are counted in no class; a class limit switches
credit off (``AdmitterCore.grantable``) so that every allow is counted in its class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from natsched.wire import subjects as S

Loan = dict[str, int]  # lender class -> runtime tokens borrowed from it by one admission
Loans = dict[tuple[str, str], int]  # (borrower, lender) -> runtime tokens outstanding

#: why a request must wait for its class (``AdmissionDecision.reason`` of a queue, the planner's block)
CLASS_LIMIT = "class_limit"


def _wire_order(cls: str) -> int:
    return S.CLASSES.index(cls) if cls in S.CLASSES else len(S.CLASSES)


def repay(classes: Mapping[str, int], loans: Mapping[tuple[str, str], int], cls: str | None,
          tokens: int) -> tuple[dict[str, int], Loans]:
    """``classes`` and ``loans`` after ``tokens`` of class ``cls`` are released: the class holds
    less, and its loans are repaid first, the highest-ranked lender (wire order) first; loans
    never exceed what their borrower still holds."""
    out, owed = dict(classes), dict(loans)
    if cls is None or tokens <= 0:
        return out, owed
    left = max(0, out.get(cls, 0) - tokens)
    if left:
        out[cls] = left
    else:
        out.pop(cls, None)
    pay = tokens
    for key in sorted((k for k in owed if k[0] == cls), key=lambda k: _wire_order(k[1])):
        take = min(pay, owed[key])
        owed[key] -= take
        pay -= take
        if not owed[key]:
            del owed[key]
    return out, clamp(out, owed)


def clamp(classes: Mapping[str, int], loans: Mapping[tuple[str, str], int]) -> Loans:
    """Loans no larger than their borrower holds (a late release, a rebuild from the records):
    the excess is dropped from the lowest-ranked lender first."""
    out = {k: v for k, v in loans.items() if v > 0}
    for borrower in {b for b, _ in out}:
        excess = sum(v for (b, _), v in out.items() if b == borrower) - classes.get(borrower, 0)
        for key in sorted((k for k in out if k[0] == borrower), key=lambda k: -_wire_order(k[1])):
            if excess <= 0:
                break
            cut = min(excess, out[key])
            out[key] -= cut
            excess -= cut
        for key in [k for k in out if k[0] == borrower and not out[k]]:
            del out[key]
    return out


@dataclass
class ClassBook:
    """The class limits and what each class holds, for one decision (a planner's scratch copy
    changes it with :meth:`add`; the core never keeps one)."""

    limits: Mapping[str, int]
    used: dict[str, int] = field(default_factory=dict)
    loans: Loans = field(default_factory=dict)
    demand: Mapping[str, int] = field(default_factory=dict)  # queued runtime tokens per class
    lend_to: tuple[str, ...] = (S.ONLINE,)
    lend_share: float = 0.5
    rank: Mapping[str, int] = field(default_factory=dict)
    surge: bool = False  # the cluster is past the degrade watermark (see the module docstring)

    # ------------------------------------------------------------------ reads
    def borrowed(self, cls: str) -> int:
        return sum(v for (b, _), v in self.loans.items() if b == cls)

    def lent(self, cls: str) -> int:
        return sum(v for (_, l), v in self.loans.items() if l == cls)

    def own(self, cls: str) -> int:
        """What the class holds on its own limit (its borrowed part excluded)."""
        return max(0, self.used.get(cls, 0) - self.borrowed(cls))

    def room(self, cls: str) -> int | None:
        """Its limit minus its own use and what it lent (None: no limit)."""
        limit = self.limits.get(cls)
        return None if limit is None else limit - self.own(cls) - self.lent(cls)

    def lenders(self, cls: str) -> list[str]:
        """Who ``cls`` may borrow from: limited classes ranked below it, the lowest first."""
        if cls not in self.lend_to:
            return []
        mine = self.rank.get(cls, 99)
        below = [c for c in self.limits if c != cls and self.rank.get(c, 99) > mine]
        return sorted(below, key=lambda c: (-self.rank.get(c, 99), -_wire_order(c)))

    def lendable(self, lender: str) -> int:
        """Runtime tokens ``lender`` may lend now (module docstring)."""
        free = self.room(lender)
        if free is None or free <= 0:
            return 0
        idle = free - self.demand.get(lender, 0)
        surge = int(self.lend_share * self.limits[lender]) - self.lent(lender) if self.surge else 0
        return max(0, min(free, max(idle, surge)))

    # ------------------------------------------------------------------ the decision
    def fit(self, cls: str, cost: int) -> Loan | None:
        """The loan an admission of ``cost`` runtime tokens of class ``cls`` needs ({}: none, it
        fits its own limit or the class has none), or None when it does not fit even borrowing."""
        room = self.room(cls)
        if room is None or cost <= room:
            return {}
        need = cost - max(0, room)
        loan: Loan = {}
        for lender in self.lenders(cls):
            take = min(need, self.lendable(lender))
            if take > 0:
                loan[lender] = take
                need -= take
            if not need:
                return loan
        return None

    def never(self, cls: str, cost: int) -> str | None:
        """A message when no amount of waiting or borrowing lets ``cost`` into its class."""
        limit = self.limits.get(cls)
        if limit is None or cost <= limit:
            return None
        reach = limit + sum(int(self.limits[l]) for l in self.lenders(cls))
        if cost <= reach:
            return None
        return f"needs {cost} runtime tokens, class {cls!r} is limited to {limit}" + (
            f" (and may borrow up to {reach - limit})" if reach > limit else "")

    def add(self, cls: str, cost: int, loan: Mapping[str, int]) -> None:
        """Account for one admission in this scratch copy."""
        self.used[cls] = self.used.get(cls, 0) + cost
        for lender, n in loan.items():
            self.loans[(cls, lender)] = self.loans.get((cls, lender), 0) + n

    def view(self, cls: str) -> dict:
        """What the audit records about the class at a decision."""
        out: dict = {"class": cls, "class_used": self.used.get(cls, 0)}
        if cls in self.limits:
            out["class_limit"] = self.limits[cls]
        if self.borrowed(cls):
            out["class_borrowed"] = self.borrowed(cls)
        if self.lent(cls):
            out["class_lent"] = self.lent(cls)
        return out
