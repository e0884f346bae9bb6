"""The shared in-flight aggregate: runtime tokens reserved, in total, per tenant, per model, and
how many of them are held by *long* requests (the long reserve needs that; pass ``long=True`` to
:meth:`Usage.plus` / :meth:`Usage.minus` for requests whose cost reaches the long threshold —
``AdmitterCore.is_long(tokens)``).

Every admitter replica decides against the same :class:`Usage`, which the service keeps in the
``inflight`` KV bucket and changes only by compare-and-swap. It is a *value*: :meth:`Usage.plus`
and :meth:`Usage.minus` return a new object, so a decision evaluated on one revision can be
retried on the next without undoing anything. Keys whose count falls to zero are dropped, so
two usages that describe the same reservations compare (and serialise) equal.

``credits`` lists the *credit* each replica holds (:mod:`natsched.admitter.credit`): runtime tokens it
reserved ahead for a (tenant, model) and hands out to that pair's short requests without a
write of its own. A credit block is counted in ``used``, ``tenants`` and ``models`` like a
reservation of that tenant and model (never in ``long``), so every other replica's decisions
already account for it; the entry names the block's holder and its *epoch* (one per credit
the holder opened), which is what a release and the reconciliation need to tell a request
paid from a block from one reserved on its own. ``beat`` changes with every write of the
holder: a holder that stops writing for the credit lease loses its entry (:meth:`Usage.drop_credit`).

``classes`` counts the runtime tokens each request class holds (every reservation that carries
its class, i.e. all but those paid from credit blocks) and ``loans`` what one class borrowed of
another's class limit, ``(borrower, lender) -> tokens``: the class limits and their lending rule
are :mod:`natsched.admitter.classes`' (a release of a class repays its loans first).

Pure module: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from natsched.admitter.classes import Loans, clamp, repay
from natsched.admitter.errors import UsageError
from natsched.wire import subjects as S


@dataclass(frozen=True)
class CreditEntry:
    """One replica's credit in the shared usage: its blocks by (tenant, model)."""

    epoch: str
    beat: int = 0
    blocks: dict[tuple[str, str], int] = field(default_factory=dict)

    def block(self, tenant: str, model: str) -> int:
        return self.blocks.get((tenant, model), 0)

    def total(self) -> int:
        return sum(self.blocks.values())

    def adjusted(self, tenant: str, model: str, delta: int) -> "CreditEntry":
        """The same entry with (tenant, model)'s block changed by ``delta`` (never below 0)."""
        blocks = dict(self.blocks)
        left = max(0, self.block(tenant, model) + delta)
        if left:
            blocks[(tenant, model)] = left
        else:
            blocks.pop((tenant, model), None)
        return CreditEntry(self.epoch, self.beat, blocks)

    def to_obj(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "beat": self.beat,
                "blocks": [[t, m, n] for (t, m), n in sorted(self.blocks.items())]}

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> "CreditEntry":
        if not isinstance(obj, dict) or not isinstance(obj.get("epoch"), str) or not obj["epoch"]:
            raise UsageError(f"usage field '{where}' must be an object with a non-empty 'epoch'")
        blocks: dict[tuple[str, str], int] = {}
        raw = obj.get("blocks", [])
        if not isinstance(raw, list):
            raise UsageError(f"usage field '{where}.blocks' must be a list of [tenant, model, tokens]")
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[1], str)):
                raise UsageError(f"usage field '{where}.blocks' holds {item!r}, not [tenant, model, tokens]")
            n = _count(item[2], f"{where}.blocks")
            if n:
                blocks[(item[0], item[1])] = n
        return cls(obj["epoch"], _count(obj.get("beat", 0), f"{where}.beat"), blocks)


@dataclass
class Usage:
    used: int = 0
    tenants: dict[str, int] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)
    long: int = 0  # part of ``used`` held by long requests
    credits: dict[str, CreditEntry] = field(default_factory=dict)  # replica -> its credit (module docstring)
    classes: dict[str, int] = field(default_factory=dict)  # class -> runtime tokens held (module docstring)
    loans: Loans = field(default_factory=dict)  # (borrower, lender) -> runtime tokens borrowed

    def cls(self, cls: str) -> int:
        return self.classes.get(cls, 0)

    def tenant(self, tenant: str) -> int:
        return self.tenants.get(tenant, 0)

    def model(self, model: str) -> int:
        return self.models.get(model, 0)

    def credit_by_tenant(self) -> dict[str, int]:
        """Runtime tokens the admitters hold as credit blocks, by tenant: counted in ``used`` from
        the moment a block is granted, spent or not (an idle cluster with credit shows usage)."""
        out: dict[str, int] = {}
        for entry in self.credits.values():
            for (tenant, _model), tokens in entry.blocks.items():
                out[tenant] = out.get(tenant, 0) + tokens
        return out

    def plus(self, tenant: str, model: str, tokens: int, long: bool = False, cls: str | None = None,
             loan: dict[str, int] | None = None) -> "Usage":
        """A new usage with ``tokens`` more reserved for ``tenant`` / ``model`` (by a long request),
        counted in class ``cls`` (None: in no class) with ``loan`` of it borrowed (lender -> tokens)."""
        if tokens < 0:
            raise ValueError(f"cannot reserve a negative number of runtime tokens ({tokens}); use minus()")
        classes, loans = self.classes, self.loans
        if cls is not None:
            classes = _add(classes, cls, tokens)
            if loan:
                loans = dict(loans)
                for lender, n in loan.items():
                    if n > 0:
                        loans[(cls, lender)] = loans.get((cls, lender), 0) + n
        return Usage(self.used + tokens, _add(self.tenants, tenant, tokens), _add(self.models, model, tokens),
                     self.long + (tokens if long else 0), self.credits, classes, loans)

    def minus(self, tenant: str, model: str, tokens: int, long: bool = False, cls: str | None = None) -> "Usage":
        """A new usage with ``tokens`` released; every count clamps at 0 (a release may be late).
        A release of class ``cls`` repays that class's loans first (:func:`natsched.admitter.classes.repay`)."""
        tokens = max(0, tokens)
        classes, loans = repay(self.classes, self.loans, cls, tokens) if cls is not None else (self.classes,
                                                                                                 self.loans)
        return Usage(max(0, self.used - tokens), _add(self.tenants, tenant, -tokens),
                     _add(self.models, model, -tokens), max(0, self.long - tokens) if long else self.long,
                     self.credits, classes, loans)

    def reclass(self, cls: str | None, delta: int) -> "Usage":
        """The same usage with class ``cls`` holding ``delta`` more (a reservation that grew: its
        growth is its class's own, not borrowed)."""
        if cls is None or not delta:
            return self
        return Usage(self.used, self.tenants, self.models, self.long, self.credits, _add(self.classes, cls, delta),
                     clamp(_add(self.classes, cls, delta), self.loans))

    def with_loans(self, loans: Loans) -> "Usage":
        """The same usage with ``loans`` (clamped to what each borrower holds): a rebuild keeps them."""
        return Usage(self.used, self.tenants, self.models, self.long, self.credits, self.classes,
                     clamp(self.classes, loans))

    # --- credit blocks (natsched.admitter.credit) ------------------------------------------------
    def credit(self, replica: str, epoch: str | None = None) -> CreditEntry | None:
        """``replica``'s credit entry (only if it has ``epoch``, when given)."""
        entry = self.credits.get(replica)
        return entry if entry is not None and (epoch is None or entry.epoch == epoch) else None

    def grant(self, replica: str, epoch: str, tenant: str, model: str, tokens: int) -> "Usage":
        """``tokens`` more in ``replica``'s block for (tenant, model): reserved like a request's."""
        if tokens < 0:
            raise ValueError(f"cannot grant a negative credit ({tokens}); use give_back()")
        entry = self._entry(replica, epoch)
        return self.plus(tenant, model, tokens)._with(replica, entry.adjusted(tenant, model, tokens))

    def give_back(self, replica: str, epoch: str, tenant: str, model: str, tokens: int) -> "Usage":
        """``tokens`` of a block returned unused (no more than the block holds)."""
        entry = self._entry(replica, epoch)
        tokens = min(max(0, tokens), entry.block(tenant, model))
        return self.minus(tenant, model, tokens)._with(replica, entry.adjusted(tenant, model, -tokens))

    def release_from(self, by: str, epoch: str, tenant: str, model: str, tokens: int, long: bool = False,
                     cls: str | None = None) -> "Usage":
        """Release a reservation: out of ``by``'s block when it was paid from that block (``epoch``)
        and the block still exists, else on its own (``minus``, in class ``cls``); the aggregate
        drops by ``tokens`` either way. A credit-paid request was counted in no class."""
        entry = self.credit(by, epoch) if epoch else None
        if entry is None:
            return self.minus(tenant, model, tokens, long, None if epoch else cls)
        return self.minus(tenant, model, tokens, long)._with(by, entry.adjusted(tenant, model, -max(0, tokens)))

    def renew(self, replica: str, epoch: str) -> "Usage":
        """The holder's write: ``beat`` moves on, so the others see it alive (creates the entry)."""
        entry = self._entry(replica, epoch)
        return self._with(replica, CreditEntry(epoch, entry.beat + 1, entry.blocks))

    def drop_credit(self, replica: str) -> "Usage":
        """Remove ``replica``'s entry. Its blocks stay counted: what it paid from them is still
        running (and is now released on its own); what was unused is drift for the reconciliation."""
        if replica not in self.credits:
            return self
        credits = dict(self.credits)
        del credits[replica]
        return Usage(self.used, self.tenants, self.models, self.long, credits, self.classes, self.loans)

    def _entry(self, replica: str, epoch: str) -> CreditEntry:
        entry = self.credits.get(replica)
        if entry is None:
            return CreditEntry(epoch)
        if entry.epoch != epoch:
            raise UsageError(f"replica {replica!r} holds credit epoch {entry.epoch!r}, not {epoch!r}")
        return entry

    def _with(self, replica: str, entry: CreditEntry) -> "Usage":
        credits = dict(self.credits)
        credits[replica] = entry
        return Usage(self.used, self.tenants, self.models, self.long, credits, self.classes, self.loans)

    def to_json(self) -> bytes:
        data: dict[str, Any] = {"used": self.used, "tenants": self.tenants, "models": self.models, "long": self.long}
        if self.credits:
            data["credits"] = {r: e.to_obj() for r, e in self.credits.items()}
        if self.classes:
            data["classes"] = self.classes
        if self.loans:
            data["loans"] = [[b, l, n] for (b, l), n in sorted(self.loans.items())]
        return orjson.dumps(data, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes) -> "Usage":
        """Decode strictly: exactly what :meth:`to_json` writes, or :class:`UsageError` naming
        what is wrong.

        Strict because a missing count read as 0 *is* an attack: the server's publish ack
        ``{"stream": "REQUESTS", "seq": 7}`` written on this key (a reply-to injection) decoded
        as an empty usage and let 25 requests in against a total that fits 5. Every field the
        writer always writes is required, and no other field is accepted.
        """
        try:
            data = orjson.loads(raw)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise UsageError(f"usage is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise UsageError(f"usage must be a JSON object, got {type(data).__name__}")
        missing = [k for k in REQUIRED_FIELDS if k not in data]
        unknown = sorted(set(data) - set(REQUIRED_FIELDS) - OPTIONAL_FIELDS)
        if missing or unknown:
            raise UsageError("usage is not one the admitters wrote: "
                             + "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                         + ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])))
        used = _count(data["used"], "used")
        tenants = _counts(data["tenants"], "tenants")
        models = _counts(data["models"], "models")
        credits = data.get("credits", {})
        if not isinstance(credits, dict):
            raise UsageError(f"usage field 'credits' must be an object, got {type(credits).__name__}")
        classes = _counts(data.get("classes", {}), "classes")
        unknown_classes = sorted(set(classes) - set(S.CLASSES))
        if unknown_classes:
            raise UsageError(f"usage field 'classes' names unknown class(es) {', '.join(unknown_classes)}")
        return cls(used, tenants, models, _count(data["long"], "long"),
                   {str(r): CreditEntry.from_obj(e, f"credits.{r}") for r, e in credits.items()},
                   classes, _loans(data.get("loans", [])))


#: what :meth:`Usage.to_json` always writes (``credits`` only while a replica holds credit)
REQUIRED_FIELDS = ("used", "tenants", "models", "long")
#: written only while non-empty: a replica's credit, the class counts, the loans between classes
OPTIONAL_FIELDS = frozenset({"credits", "classes", "loans"})


def sum_usage(usages: list[Usage]) -> Usage:
    """Several usage keys as one (the partitions' ``inflight-p<k>/usage``, for status readers):
    counts added, credits side by side (replicas are named per partition). Exact because a tenant
    lives in one partition: no tenant is counted twice."""
    out = Usage()
    for u in usages:
        tenants, models, classes, loans = dict(out.tenants), dict(out.models), dict(out.classes), dict(out.loans)
        for mine, theirs in ((tenants, u.tenants), (models, u.models), (classes, u.classes), (loans, u.loans)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        out = Usage(out.used + u.used, tenants, models, out.long + u.long, {**out.credits, **u.credits}, classes,
                    loans)
    return out


def _add(counts: dict[str, int], key: str, delta: int) -> dict[str, int]:
    out = dict(counts)
    value = out.get(key, 0) + delta
    if value > 0:
        out[key] = value
    else:
        out.pop(key, None)
    return out


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"usage field '{where}' must be a non-negative integer, got {value!r}")
    return value


def _loans(value: Any) -> Loans:
    if not isinstance(value, list):
        raise UsageError(f"usage field 'loans' must be a list of [borrower, lender, tokens], got {type(value).__name__}")
    out: Loans = {}
    for item in value:
        if not (isinstance(item, list) and len(item) == 3 and item[0] in S.CLASSES and item[1] in S.CLASSES
                and item[0] != item[1]):
            raise UsageError(f"usage field 'loans' holds {item!r}, not [borrower, lender, tokens] of two classes")
        n = _count(item[2], "loans")
        if n:
            out[(item[0], item[1])] = out.get((item[0], item[1]), 0) + n
    return out


def _counts(value: Any, where: str) -> dict[str, int]:
    if not isinstance(value, dict):
        raise UsageError(f"usage field '{where}' must be an object, got {type(value).__name__}")
    return {str(k): _count(v, f"{where}.{k}") for k, v in value.items() if v != 0}
