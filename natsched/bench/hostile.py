"""``natsched chaos --scenario hostile``: publishers with real credentials who try to over-admit.

The run's system runs under ``natsched auth init``'s accounts and permissions (issue 26). Beside
the honest load (sent as the admin: it only measures), two hostile publishers attack for the
whole sending time with the least-privileged credentials the config hands out:

- a tenant's producer (``producer-mallory``, in its own account): JetStream publishes of its own
  requests with the NATS reply-to set to the admitters' ``usage`` key and to other tenants'
  quota keys (*reply-to injection*); requests that declare ``expected_output_tokens=1`` with a
  large ``max_tokens`` (*declared costs*); its earlier requests again under new msg ids and
  requests under ids shaped like the honest load's (*dedup collisions*);
- a worker (``worker-w1``'s credentials, as a compromised worker would hold them): for every
  request the observer sees assigned to another worker, a completion on its own subject that
  names the request (*forged completions*: guessed fences, the old ``<id>:done`` msg id), one
  naming the other worker in its body, and one on the other worker's subject (refused by the
  server: a permission violation the worker's connection logs).

Reported under ``actors.hostile``: what was sent, and the effects:
``over_admission`` = the most runtime tokens the system really held at once (every assigned
request from its assignment until the completion its own worker published, checked with the
fence key) ÷ the cluster total (it must stay <= 1.0; a forged release that let more in would
push it over), ``max_reserved_ratio`` (the same from the shared ``usage``), and
``foreign_values``: values in ``usage`` or the quota keys that no admitter or operator wrote
(0). The run's own lost / duplicated / leaked cover the honest requests.

The honest load's ids carry a random part here (the clients' default ids are random): the
scheduler's request ids are global, so ids a hostile tenant can predict can be denied to their
owner (docs/reliability.md); the collision attack below uses the predictable shape and must
collide with nothing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson

from natsched.admitter.usage import Usage
from natsched.admitter.errors import UsageError
from natsched.bus.connection import Bus
from natsched.client.producer import make_request
from natsched.wire.ids import scoped
from natsched.wire import fence
from natsched.wire import msgids as M
from natsched.wire import subjects as S
from natsched.wire.errors import MessageError
from natsched.wire.schema import Assignment, Completion

if TYPE_CHECKING:
    from natsched.bench.chaos import ChaosRun

log = logging.getLogger(__name__)

HOSTILE_TENANT = "mallory"
HOSTILE_WORKER = "w1"  # a real worker id: its credentials are what a compromised worker holds
#: the cluster total of the hostile run: small, so that what the attacks would let in shows
HOSTILE_TOTAL = 6000
ATTACKS_PER_S = 8.0
DECLARED_MAX_TOKENS = 2000


async def prepare(run: "ChaosRun", admin: Bus) -> None:
    """Before the load: a small total (and hard cap), so that over-admission would show."""
    quotas = admin.kv(S.BUCKET_QUOTAS)
    for key in ("cluster.total", "cluster.hard_cap"):
        await quotas.put(key, orjson.dumps(HOSTILE_TOTAL))
    await asyncio.sleep(2.0)  # the admitters apply a quota change within a second


class _Ledger:
    """Runtime tokens really held: assigned requests until their own worker's completion."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.held: dict[str, int] = {}
        self.now = 0
        self.max = 0

    def on_work(self, a: Assignment) -> None:
        self.now += a.runtime_tokens - self.held.get(a.request.id, 0)
        self.held[a.request.id] = a.runtime_tokens
        self.max = max(self.max, self.now)

    def on_completion(self, c: Completion, subject: str) -> None:
        if fence.fenced(self.key, c, subject):
            self.now -= self.held.pop(c.request_id, 0)


async def hostile(run: "ChaosRun", t0: float) -> dict[str, Any]:
    """The two hostile publishers beside the load; their report and targets."""
    auth, url = run.auth, run.cluster.url
    admin = await Bus.connect(url, name="hostile-observer", credentials=auth.creds("admin"))
    sent: Counter[str] = Counter()
    mallory = await Bus.connect(url, name="mallory", credentials=auth.creds(f"producer-{HOSTILE_TENANT}"))
    worker = await Bus.connect(url, name="hostile-worker", credentials=auth.creds(f"worker-{HOSTILE_WORKER}"))
    producer = mallory
    ledger = _Ledger(admin.fence_key)
    foreign, max_reserved = Counter(), 0
    victims: asyncio.Queue[Assignment] = asyncio.Queue()
    before = {k: v for k, (v, _) in (await admin.kv(S.BUCKET_QUOTAS).snapshot(">")).items()}

    async def on_work(subject: str, data: bytes, headers: dict) -> None:
        try:
            a = Assignment.decode(data)
        except MessageError:
            return
        ledger.on_work(a)
        if a.worker != HOSTILE_WORKER:
            victims.put_nowait(a)

    async def on_done(subject: str, data: bytes, headers: dict) -> None:
        try:
            ledger.on_completion(Completion.decode(data), subject)
        except MessageError:
            return

    await admin.subscribe(S.WORK_ALL, on_work)
    await admin.subscribe(S.COMPLETIONS_ALL, on_done)
    rng = random.Random(run.s.seed)
    own: list[tuple[str, bytes]] = []
    stop = t0 + run.s.send_s

    async def attack_once() -> None:
        kind = rng.choice(("reply_to", "declared", "dedup", "forge"))
        if kind == "reply_to":
            target = rng.choice([S.kv_subject(S.BUCKET_INFLIGHT, S.KEY_USAGE),
                                 *(S.kv_subject(S.BUCKET_QUOTAS, S.tenant_quota_key(t)) for t in run.s.tenants),
                                 S.kv_subject(S.BUCKET_QUOTAS, "cluster.total")])
            req = make_request(HOSTILE_TENANT, "what is the usage?", max_tokens=4)
            await producer.publish(S.request(S.ONLINE, HOSTILE_TENANT), req, reply=target,
                                   headers={S.HDR_MSG_ID: req.id})
        elif kind == "declared":
            req = make_request(HOSTILE_TENANT, "cheap, I promise " * 10, max_tokens=DECLARED_MAX_TOKENS,
                               expected_output_tokens=1)
            req.reply = S.tenant_reply(HOSTILE_TENANT, req.id)
            await mallory.jpublish(S.request(S.ONLINE, HOSTILE_TENANT), req, msg_id=req.id,
                                   headers={S.HDR_REPLY: req.reply})
            own.append((req.id, req.encode()))
        elif kind == "dedup":
            if own and rng.random() < 0.5:  # its own request again, under a new msg id
                rid, body = rng.choice(own)
                await producer.publish(S.request(S.ONLINE, HOSTILE_TENANT), body,
                                       headers={S.HDR_MSG_ID: f"{rid}-again-{secrets.token_hex(2)}"})
            else:  # an id shaped like the honest load's (which also carries a random part), in its
                # tenant's scope as the honest client submits it: the admitter refuses it as invalid
                rid = scoped(rng.choice(run.s.tenants), f"chaos-{run.run_id}-{rng.randrange(run.s.requests):06d}")
                req = make_request(HOSTILE_TENANT, "mine now", max_tokens=4)
                req.id = rid
                await producer.publish(S.request(S.ONLINE, HOSTILE_TENANT), req, headers={S.HDR_MSG_ID: rid})
        else:
            try:
                a = victims.get_nowait()
            except asyncio.QueueEmpty:
                return
            rid, tenant = a.request.id, a.request.tenant
            for worker_id, on in ((HOSTILE_WORKER, HOSTILE_WORKER), (a.worker, HOSTILE_WORKER), (a.worker, a.worker)):
                guess = secrets.token_hex(fence.TOKEN_HEX // 2)
                c = Completion(request_id=rid, tenant=tenant, status="ok", runtime_tokens=a.runtime_tokens,
                               worker=worker_id, attempt=a.attempt, fence=guess)
                await worker.publish(S.completion(tenant, on), c,
                                     headers={S.HDR_MSG_ID: rng.choice([M.completion(rid), M.completion(rid, guess)])})
        sent[kind] += 1

    try:
        while time.monotonic() < stop + 5.0:
            if time.monotonic() < stop:
                await attack_once()
            raw = await admin.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE)
            if raw is not None:
                try:
                    max_reserved = max(max_reserved, Usage.from_json(raw[0]).used)
                except UsageError:
                    foreign["usage"] += 1
            await asyncio.sleep(1.0 / ATTACKS_PER_S)
        await mallory.flush()
        await worker.flush()
        after = {k: v for k, (v, _) in (await admin.kv(S.BUCKET_QUOTAS).snapshot(">")).items()}
        foreign["quotas"] = sum(1 for k, v in after.items() if k in before and before[k] != v
                                and k not in ("cluster.total", "cluster.hard_cap", S.KEY_DYNAMIC_TOTAL))
    finally:
        for bus in (mallory, worker, admin):
            await bus.close()
    over = round(ledger.max / HOSTILE_TOTAL, 3)
    return {
        "sent": dict(sent), "total": HOSTILE_TOTAL,
        "over_admission": over, "max_reserved_ratio": round(max_reserved / HOSTILE_TOTAL, 3),
        "foreign_values": {k: v for k, v in foreign.items() if v},
        "targets": {"over_admission": over <= 1.0, "max_reserved_ratio": max_reserved <= HOSTILE_TOTAL,
                    "foreign_values": not any(foreign.values()),
                    "attacks_ran": all(sent[k] > 0 for k in ("reply_to", "declared", "dedup", "forge"))},
    }
