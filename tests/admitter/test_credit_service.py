"""Credit in the admitter service, on a real nats-server: allows paid without a shared write,
never over the total, released once wherever the completion lands, given back when idle or at
stop, and a silent replica's entry dropped without losing what it reserved."""

import asyncio

from natsched.admitter.credit import CreditSettings
from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.wire.schema import Decision
from tests.factories.core import make_completion, make_request
from tests.factories.core import wait_for as until


def credit(**kw) -> CreditSettings:
    """Eager credit: a block after a couple of requests, given back after a short idle."""
    kw.setdefault("horizon_s", 2.0)
    kw.setdefault("min_requests", 1.0)
    kw.setdefault("idle_s", 0.5)
    kw.setdefault("tick_s", 0.02)
    kw.setdefault("max_share", 0.5)
    kw.setdefault("slack", 0.0)
    return CreditSettings(**kw)


async def start_admitter(url, name="adm", **kw) -> AdmitterService:
    kw.setdefault("ack_wait_s", 5.0)
    kw.setdefault("reconcile_interval_s", 3600)  # tests call reconcile_once themselves
    kw.setdefault("credit", credit())
    service = AdmitterService(await Bus.connect(url, name=name), AdmitterServiceSettings(name=name, **kw))
    await service.start()
    return service


def request(tenant="t1", tokens=100, **kw):
    # runtime tokens = 2 * prompt + max_tokens = 300
    return make_request(tenant=tenant, prompt_token_ids=list(range(tokens)), cls="online", max_tokens=tokens, **kw)


async def publish(bus, req) -> None:
    await bus.jpublish(S.request(req.cls, req.tenant), req, msg_id=req.id)


async def allowed(bus) -> list[Decision]:
    ds = [Decision.decode(d) for _, d in await bus.stream_messages(S.STREAM_DECISIONS)]
    return [d for d in ds if d.stage == "admission" and d.decision == "allow"]


async def warm(bus, adm, n=4) -> list:
    """Requests until the replica holds credit (the first ones are committed one by one)."""
    reqs = []
    for _ in range(n):
        reqs.append(request())
        await publish(bus, reqs[-1])
        await until(lambda: len(adm.shared.reservations) == len(reqs), timeout=5)
    assert await until(lambda: sum(adm.credit.free.values()) > 0, timeout=5)
    return reqs


async def pause_keeper():
    return None


async def test_allows_paid_from_credit_write_no_usage_and_their_records_say_so(bus, nats_url):
    adm = await start_admitter(nats_url)
    writes = 0
    inflight = adm.bus.kv(S.BUCKET_INFLIGHT)  # one handle per bucket and Bus: the admitter writes through it
    real = inflight.update

    async def counted(*a, **kw):  # the real compare-and-swap, counted
        nonlocal writes
        writes += 1
        return await real(*a, **kw)

    try:
        await warm(bus, adm)
        await asyncio.sleep(0.1)
        adm.keep_credit = pause_keeper  # its top-ups and renewals are writes of their own, not counted here
        await asyncio.sleep(0.1)
        inflight.update = counted
        before = adm.metrics.credit_allows._value.get()
        paid = [request() for _ in range(5)]
        for r in paid:
            await publish(bus, r)
        assert await until(lambda: all(r.id in adm.shared.reservations for r in paid), timeout=5)
        assert adm.metrics.credit_allows._value.get() - before == 5 and writes == 0
        for r in paid:
            record = await adm.shared.lookup(r.id)
            assert record.credit == adm.credit.epoch and record.by == "adm"
        usage = Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
        records = await adm.shared.snapshot()
        assert sum(r.tokens for r in records.values()) <= usage.used  # everything running is counted
        assert usage.credit("adm", adm.credit.epoch).block("t1", "default") >= 5 * 300
    finally:
        await adm.bus.close()


async def test_two_replicas_with_credit_never_pass_the_total(bus, nats_url):
    await bus.kv(S.BUCKET_QUOTAS).put("cluster.total", b"6000")  # 20 requests of 300
    await bus.kv(S.BUCKET_QUOTAS).put("class.online.queue", b"0")  # what does not fit is refused
    replicas = [await start_admitter(nats_url, f"adm{i}", fetch_batch=4) for i in range(2)]
    try:
        await asyncio.gather(*(publish(bus, request()) for _ in range(60)))

        async def all_decided():
            ds = [Decision.decode(d) for _, d in await bus.stream_messages(S.STREAM_DECISIONS)]
            return len([d for d in ds if d.stage == "admission"]) == 60
        assert await until(all_decided, timeout=10)
        ok = await allowed(bus)
        assert 0 < len(ok) <= 20  # credit held by one replica is not room for the other: maybe fewer
        records = await replicas[0].shared.snapshot()
        assert sum(r.tokens for r in records.values()) == 300 * len(ok) <= 6000
        usage = Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
        assert usage.used <= 6000
    finally:
        for r in replicas:
            await r.bus.close()


async def test_a_credit_paid_request_is_released_once_by_either_replica(bus, nats_url):
    a = await start_admitter(nats_url, "adm-a")
    b = None
    try:
        await warm(bus, a)
        await asyncio.sleep(0.1)
        a.keep_credit = pause_keeper  # the block stays as it is while we look at it
        r, mine = request(), request()
        for x in (r, mine):
            await publish(bus, x)
        assert await until(lambda: r.id in a.shared.reservations and mine.id in a.shared.reservations, timeout=5)
        for x in (r, mine):
            assert (await a.shared.lookup(x.id)).credit == a.credit.epoch  # both paid from a's block
        free, block = sum(a.credit.free.values()), a.shared.usage.credit("adm-a").total()
        used = a.shared.usage.used
        b = await start_admitter(nats_url, "adm-b", credit=credit(enabled=False))  # (after: a took every request)
        # b frees r (another replica took the completion): out of a's block and the aggregate
        assert await b.release(r.id, make_completion(r.id, runtime_tokens=300)) == 300
        assert await until(lambda: a.shared.usage.used == used - 300, timeout=5)
        assert a.shared.usage.credit("adm-a").total() == block - 300 and sum(a.credit.free.values()) == free
        assert await a.release(r.id) == 0 and await b.release(r.id) == 0  # once
        # a frees its own: back into its credit, nothing written
        assert await a.release(mine.id, make_completion(mine.id, runtime_tokens=300)) == 300
        await asyncio.sleep(0.1)
        assert a.shared.usage.used == used - 300 and sum(a.credit.free.values()) == free + 300
    finally:
        for adm in (a, b):
            if adm is not None:
                await adm.bus.close()


async def test_idle_credit_is_given_back_and_stop_gives_back_the_rest(bus, nats_url):
    adm = await start_admitter(nats_url)
    try:
        reqs = await warm(bus, adm)
        for r in reqs:
            await bus.jpublish(S.completion("t1", "w1"), make_completion(r.id, runtime_tokens=300), msg_id=f"{r.id}:d")
        # every request done and the block unused for idle_s: the aggregate is back to zero
        assert await until(lambda: adm.shared.usage.used == 0 and not adm.shared.usage.credits, timeout=5)
        reqs = await warm(bus, adm)
        assert adm.shared.usage.credits
        await adm.stop()
        usage = Usage.from_json((await bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
        assert not usage.credits and usage.used == 300 * len(reqs)  # only what is running
    finally:
        await adm.bus.close()


async def test_a_silent_replicas_entry_is_dropped_and_its_unspent_part_repaired(bus, nats_url):
    a = await start_admitter(nats_url, "adm-a")
    b = None
    try:
        reqs = await warm(bus, a)
        b = await start_admitter(nats_url, "adm-b", credit=credit(enabled=False, lease_s=0.5))
        running = sum(r.tokens for r in (await a.shared.snapshot()).values())
        assert running == 300 * len(reqs) and a.shared.usage.used > running  # the unspent block
        await a.bus.close()  # a dies without giving anything back
        assert await until(lambda: "adm-a" not in b.shared.usage.credits, timeout=5)
        assert b.shared.usage.used > running  # dropping lowers nothing: a's requests still run
        assert await b.reconcile_once() == 0  # drift seen once: could be a commit in flight
        assert await b.reconcile_once() == 1
        assert b.shared.usage.used == running  # the unspent part, repaired from the records
        for r in reqs:  # a's requests finish: released on their own now
            assert await b.release(r.id, make_completion(r.id, runtime_tokens=300)) == 300
        assert b.shared.usage.used == 0
    finally:
        if b is not None:
            await b.bus.close()


async def test_credit_never_makes_a_request_wait_it_is_given_back_in_the_same_write(bus, nats_url):
    adm = await start_admitter(nats_url)
    try:
        reqs = await warm(bus, adm)
        adm.keep_credit = pause_keeper  # no idle give-back: only the decision itself may return it
        await asyncio.sleep(0.1)
        running, free = 300 * len(reqs), sum(adm.credit.free.values())
        total = running + 300 + free // 2  # room for one more request only if a's credit goes back
        await bus.kv(S.BUCKET_QUOTAS).put("cluster.total", str(total).encode())
        assert await until(lambda: adm.total == total, timeout=5)
        other = request(tenant="t2")  # another tenant: a's block for t1 cannot pay for it
        await publish(bus, other)
        assert await until(lambda: other.id in adm.shared.reservations, timeout=5)
        decision = [d for d in await allowed(bus) if d.request_id == other.id]
        assert len(decision) == 1  # allowed at once, never queued
        assert adm.shared.usage.used == running + 300 and not any(adm.credit.free.values())
    finally:
        await adm.bus.close()
