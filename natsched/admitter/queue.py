"""The admission queue: queued requests in lanes, with O(1) add / remove / redelivery lookup.

Requests are kept per tenant in FIFO *lanes* — (class, long/short, model) — because the dequeue
order is decided in that shape: tenants first (floors, then weighted shares), then inside a tenant
aged requests, then class, then arrival order; and short requests are held back, lane by lane,
while the budget reserved for long ones is in use (:mod:`natsched.admitter.planner`). The model is
in the lane because a model can be full while others are not (per-model capacity): the planner
looks at most ``scan_limit`` entries into a lane, so one lane of mixed models would let a full
model's backlog hide the others' requests behind it (head-of-line blocking across models). A global FIFO finds
timed-out requests from its head and a sorted deadline list finds expired ones, so a dequeue plan
never scans the whole queue. The planner only reads this structure; ``add`` and ``remove`` are
called by :class:`~natsched.admitter.policy.AdmitterCore` when a decision is applied.

Pure module: no I/O.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterator

from natsched.wire.schema import Request, RequestId

Lane = tuple[str, bool, str]  # (class, long, model)


@dataclass(slots=True, eq=False)
class Entry:
    request: Request
    cost: int  # runtime tokens reserved if admitted
    long: bool  # cost >= the long threshold
    enqueued_at: float
    seq: int  # insertion order: ties between equal times

    @property
    def id(self) -> RequestId:
        return self.request.id

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def cls(self) -> str:
        return self.request.cls


class AdmissionQueue:
    def __init__(self) -> None:
        self._by_id: OrderedDict[RequestId, Entry] = OrderedDict()  # global FIFO
        self._lanes: dict[str, dict[Lane, OrderedDict[RequestId, Entry]]] = {}
        self._tenant_tokens: Counter[str] = Counter()
        self._tenant_count: Counter[str] = Counter()
        self._depth: Counter[str] = Counter()
        self._class_tokens: Counter[str] = Counter()
        self._model_tokens: Counter[str] = Counter()
        self._by_model_class: dict[tuple[str, str], OrderedDict[RequestId, Entry]] = {}  # FIFO per (model, class)
        self.tokens = 0  # runtime tokens of every queued request
        self._deadlines: list[tuple[float, int, RequestId]] = []
        self._seq = itertools.count()
        self.longs = 0

    # ------------------------------------------------------------------ changes
    def add(self, request: Request, cost: int, long: bool, now: float) -> Entry:
        """Enqueue (a request already queued keeps its place and is returned as it is)."""
        entry = self._by_id.get(request.id)
        if entry is not None:
            return entry
        entry = Entry(request, cost, long, now, next(self._seq))
        self._by_id[request.id] = entry
        lanes = self._lanes.setdefault(request.tenant, {})
        lanes.setdefault((request.cls, long, request.model), OrderedDict())[request.id] = entry
        self._tenant_tokens[request.tenant] += cost
        self._tenant_count[request.tenant] += 1
        self._by_model_class.setdefault((request.model, request.cls), OrderedDict())[request.id] = entry
        self._depth[request.cls] += 1
        self._class_tokens[request.cls] += cost
        self._model_tokens[request.model] += cost
        self.tokens += cost
        self.longs += long
        if request.deadline is not None:
            bisect.insort(self._deadlines, (request.deadline, entry.seq, request.id))
        return entry

    def remove(self, request_id: RequestId) -> Entry | None:
        entry = self._by_id.pop(request_id, None)
        if entry is None:
            return None
        t = entry.tenant
        lanes = self._lanes[t]
        key = (entry.cls, entry.long, entry.model)
        lane = lanes[key]
        del lane[request_id]
        if not lane:
            del lanes[key]
        self._tenant_tokens[t] -= entry.cost
        self._tenant_count[t] -= 1
        if not self._tenant_count[t]:
            del self._tenant_count[t], self._tenant_tokens[t], self._lanes[t]
        self._depth[entry.cls] -= 1
        if not self._depth[entry.cls]:
            del self._depth[entry.cls]
        self._class_tokens[entry.cls] -= entry.cost
        if not self._class_tokens[entry.cls]:
            del self._class_tokens[entry.cls]
        fifo = self._by_model_class[entry.model, entry.cls]
        del fifo[request_id]
        if not fifo:
            del self._by_model_class[entry.model, entry.cls]
        self._model_tokens[entry.model] -= entry.cost
        if not self._model_tokens[entry.model]:
            del self._model_tokens[entry.model]
        self.tokens -= entry.cost
        self.longs -= entry.long
        if entry.request.deadline is not None:
            i = bisect.bisect_left(self._deadlines, (entry.request.deadline, entry.seq, request_id))
            if i < len(self._deadlines) and self._deadlines[i][2] == request_id:
                del self._deadlines[i]
        return entry

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def get(self, request_id: RequestId) -> Entry | None:
        return self._by_id.get(request_id)

    def depths(self) -> dict[str, int]:
        return dict(self._depth)

    def depth(self, cls: str) -> int:
        return self._depth.get(cls, 0)

    def class_tokens(self) -> dict[str, int]:
        """Runtime tokens queued per class (a lender's own demand: natsched.admitter.classes)."""
        return dict(self._class_tokens)

    def model_tokens(self, model: str) -> int:
        """Runtime tokens queued for ``model`` (is its own capacity contended: the planner)."""
        return self._model_tokens.get(model, 0)

    def oldest_per_lane(self) -> dict[tuple[str, str], Entry]:
        """The oldest queued entry of each (model, class) with any (the standing-queue check)."""
        return {key: next(iter(fifo.values())) for key, fifo in self._by_model_class.items()}

    def oldest_of(self, model: str, cls: str) -> Iterator[Entry]:
        """The entries of (model, class), the oldest first."""
        return iter(self._by_model_class.get((model, cls), {}).values())

    def tenants(self) -> list[str]:
        """Backlogged tenants: those with at least one queued request."""
        return list(self._tenant_count)

    def tenant_count(self, tenant: str) -> int:
        return self._tenant_count.get(tenant, 0)

    def tenant_class_count(self, tenant: str, cls: str) -> int:
        return sum(len(lane) for (c, _, _), lane in self._lanes.get(tenant, {}).items() if c == cls)

    def tenant_tokens(self, tenant: str) -> int:
        return self._tenant_tokens.get(tenant, 0)

    def lanes(self, tenant: str) -> dict[Lane, OrderedDict[RequestId, Entry]]:
        return self._lanes.get(tenant, {})

    def oldest(self) -> Iterator[Entry]:
        """Entries in the order they were queued (the oldest first)."""
        return iter(self._by_id.values())

    def deadlines_due(self, now: float) -> Iterator[Entry]:
        """Entries whose deadline is at or before ``now``, earliest first."""
        for deadline, _, rid in self._deadlines:
            if deadline > now:
                return
            yield self._by_id[rid]
