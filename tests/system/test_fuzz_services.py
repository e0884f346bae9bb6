"""Property-based fuzzing of every message handler of the running services.

The real admitter, router and two sim workers run on the test server (in an event loop on a
thread of their own, so hypothesis drives them example by example). Every subject a service
reads gets random bytes and structurally valid but wrong messages; for each one:

- a JetStream consumer (``req.*.*``, ``adm.*.*``, ``work.<id>``, ``done.*``) settles it: an
  error reply, a dead letter with a *message* error (never ``max_deliver``: that means a
  handler raised on input), or its normal outcome (a decision, a completion, an ack);
- a core subscription (``worker.*.hb``, ``worker.*.kv``, ``worker.<id>.ctl``) and a watched KV
  value (``quotas``, ``config``) logs and ignores it: a valid sentinel sent right after is
  still applied (the handler is alive, in order), and no handler raised;

and after each barrage a valid request still completes.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import json
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from natsched.admitter.service import AdmitterService
from natsched.wire import fence
from natsched.wire import subjects as S
from natsched.client.producer import Client, Timeouts, make_request
from natsched.bus.connection import Bus
from natsched.wire.schema import CacheEvent, Completion, Control, DeadLetter, Decision, Heartbeat, Reply
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from tests.conftest import wipe
from tests.wire.test_fuzz_codec import mutated, valid_messages, values, wrong_values
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.profiles import H100_LLAMA8B
from natsched.workers.simengine import SimEngine

EXAMPLES = int(os.environ.get("NATSCHED_FUZZ_EXAMPLES", "100"))  # more for a deeper local run
#: no shrinking: each step would replay against services whose state moved on, minutes per failure;
#: the failing example is reported as generated
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
OUTCOME_WAIT_S = 10.0
SENTINEL = "fzsentinel"
_ids = itertools.count()


def new_id() -> str:
    return f"fz{next(_ids)}x{int(time.time() * 1000) % 100000}"


# --- the services, on a loop of their own --------------------------------------------------
class LoopThread:
    """An event loop running on a thread: the services keep serving between examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class CrashLog(logging.Handler):
    """Records what only a handler that raised on its input logs."""

    MARKERS = ("handler for", "failed on", "giving up on", "Task exception was never retrieved",
               "exception was never retrieved")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.crashes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info or any(m in message for m in self.MARKERS):
            text = message
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self.crashes.append(f"{record.name}: {text}")


PHANTOM_TIMEOUT_S = 1.0


@dataclass(repr=False)
class Observer:
    """Everything the services say back, collected from core subscriptions."""

    dead: dict[str, list[DeadLetter]] = field(default_factory=lambda: defaultdict(list))  # by Nats-Msg-Id
    dead_by_data: dict[bytes, list[DeadLetter]] = field(default_factory=lambda: defaultdict(list))
    decisions: dict[str, list[Decision]] = field(default_factory=lambda: defaultdict(list))
    completions: dict[str, list[Completion]] = field(default_factory=lambda: defaultdict(list))
    replies: dict[str, list[Reply]] = field(default_factory=lambda: defaultdict(list))  # by subject
    cache_events: list[CacheEvent] = field(default_factory=list)

    async def start(self, bus: Bus) -> None:
        async def on_dead(subject: str, data: bytes, headers: dict) -> None:
            d = DeadLetter.decode(data)
            self.dead[(d.headers or {}).get(S.HDR_MSG_ID, "")].append(d)
            self.dead_by_data[d.data].append(d)

        async def on_decision(subject: str, data: bytes, headers: dict) -> None:
            d = Decision.decode(data)
            self.decisions[d.request_id].append(d)

        async def on_done(subject: str, data: bytes, headers: dict) -> None:
            try:
                c = Completion.decode(data)
            except Exception:
                return  # the fuzz's own bad completions
            self.completions[c.request_id].append(c)

        async def on_reply(subject: str, data: bytes, headers: dict) -> None:
            try:
                self.replies[subject].append(Reply.decode(data))
            except Exception:
                return

        async def on_cache(subject: str, data: bytes, headers: dict) -> None:
            try:
                self.cache_events.append(CacheEvent.decode(data))
            except Exception:
                return

        await bus.subscribe(S.DEADLETTER_ALL, on_dead)
        await bus.subscribe(S.DECISIONS_ALL, on_decision)
        await bus.subscribe(S.COMPLETIONS_ALL, on_done)
        await bus.subscribe("resp.>", on_reply)
        await bus.subscribe(S.cache_events("w1"), on_cache)

    def final_reply(self, subject: str) -> Reply | None:
        return next((r for r in self.replies.get(subject, []) if r.final), None)


@dataclass(repr=False)
class Env:
    loop: LoopThread
    bus: Bus  # the fuzzer's own connection
    admitter: AdmitterService
    router: RouterService
    workers: list[WorkerAgent]
    client: Client
    observer: Observer
    crashes: CrashLog
    buses: list[Bus]

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return "Env(admitter, router, w1, w2)"

    def run(self, coro, timeout: float = 60.0) -> Any:
        return self.loop.run(coro, timeout)

    def wait(self, predicate: Callable[[], bool], timeout: float = OUTCOME_WAIT_S) -> bool:
        """Poll ``predicate`` on the services' loop until it holds (bounded by ``timeout``)."""
        async def check() -> bool:
            return predicate()

        return self.wait_async(check, timeout)

    def wait_async(self, predicate: Callable[[], Any], timeout: float = OUTCOME_WAIT_S) -> bool:
        """Like :meth:`wait`, for a predicate that awaits (it runs on the services' loop)."""
        async def poll() -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if await predicate():
                    return True
                await asyncio.sleep(0.01)
            return bool(await predicate())

        return self.run(poll(), timeout + 5)

    def assert_no_crash(self, what: str) -> None:
        assert not self.crashes.crashes, f"a handler raised on {what}:\n" + "\n".join(self.crashes.crashes[:3])

    def assert_still_serving(self) -> None:
        """A valid request completes after the barrage."""
        async def one():
            for w in self.workers:  # undo a fuzzed drain
                await self.bus.publish(S.control(w.id), Control(kind="resume", by="fuzz"))
            await asyncio.sleep(PHANTOM_TIMEOUT_S + 0.2)  # phantom workers the fuzz invented time out
            return await self.client.submit(make_request("fz", "still serving?", max_tokens=2))

        result = self.run(one())
        assert result.status == "completed" and result.output_tokens == 2


async def _start(url: str) -> tuple:
    buses: list[Bus] = []

    async def connect(name: str) -> Bus:
        b = await Bus.connect(url, name=name)
        buses.append(b)
        return b

    fuzzer = await connect("fuzzer")
    await wipe(fuzzer)
    await fuzzer.provision()
    await fuzzer.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(10_000_000))
    admitter = AdmitterService(await connect("admitter"))
    await admitter.start()
    router = RouterService(await connect("router"), RouterServiceSettings(
        # heartbeats fuzzed for a phantom worker make it look healthy: it drops out when they stop
        core=RouterSettings(policy="least_loaded", heartbeat_timeout_s=PHANTOM_TIMEOUT_S),
        no_worker_wait_s=1.0, retry_delay_s=0.2))
    await router.start()
    workers = []
    for wid in ("w1", "w2"):
        agent = WorkerAgent(await connect(wid), SimEngine(H100_LLAMA8B, block_size=32, time_scale=0.05),
                            WorkerSettings(id=wid, heartbeat_interval_s=0.2))
        await agent.start()
        workers.append(agent)
    client = Client(await connect("producer"), Timeouts(admission=10, idle=20))
    observer = Observer()
    await observer.start(fuzzer)
    for _ in range(100):  # bounded: the router has seen both workers
        if {"w1", "w2"} <= set(router.core.workers):
            break
        await asyncio.sleep(0.02)
    return fuzzer, admitter, router, workers, client, observer, buses


async def _stop(env: Env) -> None:
    for w in env.workers:
        await w.stop()
    for b in env.buses:
        await b.close()


@pytest.fixture(scope="module")
def env(nats_url):
    loop = LoopThread()
    crashes = CrashLog()
    logging.getLogger().addHandler(crashes)
    try:
        parts = loop.run(_start(nats_url))
        e = Env(loop, parts[0], *parts[1:6], crashes, parts[6])
        e.assert_still_serving()
        yield e
        loop.run(_stop(e))
    finally:
        logging.getLogger().removeHandler(crashes)
        loop.close()


@pytest.fixture
def fresh(env):
    """Each test starts without crashes from the previous one, and ends still serving once
    good quotas are back (a fuzzed quota may be a valid one that refuses everything)."""
    env.crashes.crashes.clear()
    yield env
    _repair_usage(env)
    _restore_quotas(env)
    env.assert_still_serving()
    env.assert_no_crash("the barrage (seen after it)")


def _repair_usage(env: Env) -> None:
    """Undo a corrupted shared usage (what the reply-subject bugs do), so one finding does not
    fail every later test."""
    async def repair():
        current = await env.bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE)
        try:
            if current is not None:
                orjson.loads(current[0])
        except orjson.JSONDecodeError:
            await env.bus.kv(S.BUCKET_INFLIGHT).delete(S.KEY_USAGE)

    env.run(repair())


def _restore_quotas(env: Env) -> None:
    async def restore():
        for key in QUOTA_KEYS:
            if key != S.KEY_CLUSTER_TOTAL and await env.bus.kv(S.BUCKET_QUOTAS).get(key) is not None:
                await env.bus.kv(S.BUCKET_QUOTAS).delete(key)
        await env.bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(10_000_000))

    env.run(restore())
    assert env.wait(lambda: env.admitter.core.quotas.total == 10_000_000)


# --- payloads -------------------------------------------------------------------------------
def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def payloads(base: dict) -> st.SearchStrategy[bytes]:
    """Random bytes, msgpack of random values, or a valid message with wrong fields."""
    return st.one_of(st.binary(max_size=300), values.map(pack), mutated(base).map(pack))


# --- JetStream consumers --------------------------------------------------------------------
def settled_by_consumer(env: Env, msg_id: str, request_id: str | None, reply: str, stage: str) -> bool:
    """The message got its outcome: an error or final reply, a dead letter, or a decision."""
    o = env.observer
    return bool(o.dead.get(msg_id) or o.final_reply(reply)
                or (request_id and any(d.stage == stage for d in o.decisions.get(request_id, []))))


def assert_settled(env: Env, msg_id: str, payload: bytes, outcome: Callable[[], bool], what: str) -> None:
    assert env.wait(outcome), f"no outcome for {what} {payload[:200]!r}"
    dead = env.observer.dead.get(msg_id, [])
    assert all(d.reason in ("malformed", "invalid") for d in dead), \
        f"{what} {payload[:200]!r} was dead-lettered as {[(d.reason, d.error) for d in dead]}: a handler raised"
    env.assert_no_crash(f"{what} {payload[:200]!r}")


def _body_id(payload: bytes, nested: str | None = None) -> str | None:
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if nested:
            body = body.get(nested)
        rid = body.get("id")
        return rid if isinstance(rid, str) else None
    except Exception:
        return None


@FUZZ
@given(data=st.data())
def test_requests_subject(fresh, data):
    env = fresh
    rid = new_id()
    reply = S.reply(rid)
    base = valid_messages(rid=rid, reply=reply)["Request"].to_wire()
    payload = data.draw(payloads(base))
    cls = data.draw(st.sampled_from([*S.CLASSES, "gold"]))
    env.run(env.bus.jpublish(S.request(cls, "fz"), payload, msg_id=rid, headers={S.HDR_REPLY: reply}))
    body_id = _body_id(payload)
    assert_settled(env, rid, payload,
                   lambda: settled_by_consumer(env, rid, body_id, reply, "admission"), "request")


@FUZZ
@given(data=st.data())
def test_admitted_subject(fresh, data):
    env = fresh
    rid = new_id()
    reply = S.reply(rid)
    base = valid_messages(rid=rid, reply=reply)["Admitted"].to_wire()
    payload = data.draw(payloads(base))
    env.run(env.bus.jpublish(S.admitted(S.DEFAULT_POOL, S.ONLINE, "fz"), payload, msg_id=f"{rid}:adm",
                             headers={S.HDR_REPLY: reply}))
    body_id = _body_id(payload, "request")
    assert_settled(env, f"{rid}:adm", payload,
                   lambda: settled_by_consumer(env, f"{rid}:adm", body_id, reply, "routing"), "admitted")


@FUZZ
@given(data=st.data())
def test_work_subject(fresh, data):
    env = fresh
    rid = new_id()
    reply = S.reply(rid)
    base = valid_messages(rid=rid, reply=reply, worker="w1")["Assignment"].to_wire()
    payload = data.draw(payloads(base))
    env.run(env.bus.jpublish(S.work("w1"), payload, msg_id=f"{rid}:work", headers={S.HDR_REPLY: reply}))
    body_id = _body_id(payload, "request")

    def outcome() -> bool:  # a dead letter, or the worker ran it: its completion (dedup: maybe earlier)
        return bool(env.observer.dead.get(f"{rid}:work") or env.observer.final_reply(reply)
                    or (body_id and env.observer.completions.get(body_id)))

    assert_settled(env, f"{rid}:work", payload, outcome, "assignment")


async def _consumers_done(bus: Bus, seq: int) -> bool:
    info = await bus.stream(S.STREAM_COMPLETIONS).consumer(S.CONSUMER_ADMITTER_COMPLETIONS)
    return info.ack_floor >= seq and not info.ack_pending


def _router_feedback(env, worker: str) -> float:
    """The cached tokens the router has read from ``worker``'s completions (its watch on ``done.>``)."""
    return env.router.metrics.cached_tokens.labels(worker, "actual")._value.get()


@FUZZ
@given(data=st.data())
def test_completions_subject(fresh, data):
    env = fresh
    rid = new_id()
    base = valid_messages(rid=rid)["Completion"].to_wire()
    payload = data.draw(payloads(base))
    ack = env.run(env.bus.jpublish(S.completion("fz", "w1"), payload, msg_id=f"{rid}:done"))
    # the admitters' consumer (release) acked or terminated it
    done = env.wait_async(lambda: _consumers_done(env.bus, ack.seq))
    assert done, f"completion {payload[:200]!r} still pending (redelivered: a handler raised?)"
    # the router's watch (feedback) still reads the next one
    before = _router_feedback(env, SENTINEL)
    sid = new_id()  # fenced as its worker's own (a router without auth init signs with the default key)
    sentinel = Completion(request_id=sid, tenant="fz", status="ok", runtime_tokens=1, worker=SENTINEL,
                          cached_tokens=7, fence=fence.sign(None, sid, SENTINEL, 0))
    env.run(env.bus.jpublish(S.completion("fz", SENTINEL), sentinel, msg_id=f"{sid}:done"))
    assert env.wait(lambda: _router_feedback(env, SENTINEL) == before + 7), f"completion {payload[:200]!r} " \
        "stopped the router's completion handler"
    dead = env.observer.dead.get(f"{rid}:done", [])
    assert all(d.reason in ("malformed", "invalid") for d in dead), [(d.reason, d.error) for d in dead]
    env.assert_no_crash(f"completion {payload[:200]!r}")


# --- core subscriptions: logged and ignored, the handler stays alive ------------------------
def sentinel_heartbeat(n: int) -> Heartbeat:
    """A valid heartbeat that takes no work (quiescing, a model nobody asks for) and carries ``n``."""
    return Heartbeat(worker=SENTINEL, seq=n, ts=time.time(), state="quiescing", model="fz-model", kv_seq=n,
                     runtime_tokens=n)


@FUZZ
@given(data=st.data())
def test_heartbeat_subject(fresh, data):
    env = fresh
    n = next(_ids)
    worker = data.draw(st.sampled_from(["fz-1", "fz-2", "w9"]))
    base = valid_messages(worker=worker)["Heartbeat"].to_wire()
    payload = data.draw(payloads(base))

    async def send():
        await env.bus.publish(S.heartbeat(worker), payload)
        await env.bus.publish(S.heartbeat(SENTINEL), sentinel_heartbeat(n))

    env.run(send())
    router_alive = env.wait(lambda: getattr(env.router.core.workers.get(SENTINEL), "kv_seq", None) == n)
    admitter_alive = env.wait(lambda: env.admitter.worker_load.get(SENTINEL, (0, None))[1] == n)
    assert router_alive and admitter_alive, f"heartbeat {payload[:200]!r} stopped a heartbeat handler"
    env.assert_no_crash(f"heartbeat {payload[:200]!r}")


@FUZZ
@given(data=st.data())
def test_cache_event_subject(fresh, data):
    env = fresh
    n = next(_ids) + 1
    worker = data.draw(st.sampled_from(["fz-1", "fz-2", "w9"]))
    base = valid_messages(worker=worker)["CacheEvent"].to_wire()
    payload = data.draw(payloads(base))

    async def send():
        await env.bus.publish(S.cache_events(worker), payload)
        await env.bus.publish(S.cache_events(SENTINEL), CacheEvent(worker=SENTINEL, seq=n, kind="snapshot",
                                                                   ts=time.time(), hashes=[n]))

    env.run(send())
    assert env.wait(lambda: env.router.core.index._seq.get(SENTINEL) == n), \
        f"cache event {payload[:200]!r} stopped the router's cache-event handler"
    env.assert_no_crash(f"cache event {payload[:200]!r}")


@FUZZ
@given(data=st.data())
def test_control_subject(fresh, data):
    env = fresh
    base = valid_messages()["Control"].to_wire()
    kinds = st.sampled_from(["drain", "resume", "snapshot", "cancel", "reboot"])
    payload = data.draw(st.one_of(payloads(base), mutated(base).map(lambda m: pack({**m, "kind": "cancel"})),
                                  kinds.map(lambda k: pack({"kind": k, "v": 1}))))
    before = len(env.observer.cache_events)

    async def send():
        await env.bus.publish(S.control("w1"), payload)
        await env.bus.publish(S.control("w1"), Control(kind="snapshot", by="fuzz-sentinel"))

    env.run(send())
    assert env.wait(lambda: any(e.kind == "snapshot" for e in env.observer.cache_events[before:])), \
        f"control {payload[:200]!r} stopped worker w1's control handler"
    env.assert_no_crash(f"control {payload[:200]!r}")


# --- watched KV values: a bad value is logged, the last good one kept -----------------------
QUOTA_KEYS = [S.KEY_CLUSTER_TOTAL, "cluster.hard_cap", S.tenant_quota_key("fz"), "default.tenant", "unknown_tenant",
              "class.online.queue", "model.fz-model", "weird.key"]


def kv_values() -> st.SearchStrategy[bytes]:
    json_like = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                                       st.floats(), st.text(max_size=10)),
                             lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.sampled_from(
                                                         ["floor", "weight", "cap", "policy", "weights", "canary",
                                                          "canary_share", "x"]), inner, max_size=4)),
                             max_leaves=8)
    dump = lambda v: json.dumps(v, default=repr).encode()  # noqa: E731 (stdlib: big ints, NaN)
    return st.one_of(st.binary(max_size=64), json_like.map(dump), wrong_values.map(dump))


@FUZZ
@given(key=st.sampled_from(QUOTA_KEYS), value=kv_values())
def test_quota_values(fresh, key, value):
    env = fresh
    n = next(_ids) + 1

    async def put():
        await env.bus.kv(S.BUCKET_QUOTAS).put(key, value)
        await env.bus.kv(S.BUCKET_QUOTAS).put("model.fz-sentinel", orjson.dumps(n))

    env.run(put())
    assert env.wait(lambda: env.admitter.core.quotas.models.get("fz-sentinel") == n), \
        f"quota {key}={value[:100]!r} stopped the admitter's quota watch"
    env.admitter.core.quotas.validate()  # whatever was applied is a consistent set of quotas
    env.assert_no_crash(f"quota {key}={value[:100]!r}")




@FUZZ
@given(value=kv_values())
def test_router_config_values(fresh, value):
    env = fresh
    share = (next(_ids) % 997 + 1) / 1000

    async def put():
        await env.bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, value)
        await env.bus.kv(S.BUCKET_CONFIG).put(S.KEY_ROUTER_CONFIG, orjson.dumps(
            {"policy": "least_loaded", "canary": "round_robin", "canary_share": share}))

    env.run(put())
    assert env.wait(lambda: env.router.core.canary_share == share), \
        f"router config {value[:100]!r} stopped the router's config watch"
    assert env.router.core.policy.name == "least_loaded"
    env.assert_no_crash(f"router config {value[:100]!r}")


# --- the inputs the fuzz found, pinned ------------------------------------------------------
def _admitter_acked(env: Env, seq: int) -> Callable[[], Any]:
    async def check() -> bool:
        info = await env.bus.stream(S.STREAM_REQUESTS).consumer(S.CONSUMER_ADMITTER)
        return info.ack_floor >= seq and info.ack_pending == 0
    return check


def test_a_reply_header_no_one_can_publish_to_is_dead_lettered_and_the_admitter_keeps_consuming(fresh):
    """Was: the error reply to ``Natsched-Reply: sp ace`` raised BadSubjectError on every delivery,
    and at max_deliver inside the consume loop, which ended: no admission any more."""
    env = fresh
    rid = new_id()
    ack = env.run(env.bus.jpublish(S.request(S.ONLINE, "fz"), b"\xc1 not msgpack", msg_id=rid,
                                   headers={S.HDR_REPLY: "sp ace"}))
    assert env.wait(lambda: bool(env.observer.dead.get(rid)))
    assert env.wait_async(_admitter_acked(env, ack.seq))  # terminated at once, not redelivered
    assert [d.reason for d in env.observer.dead[rid]] == ["malformed"]


@pytest.mark.parametrize("reply", ["sp ace", "a\tb", "$KV.inflight.usage", S.admitted(S.DEFAULT_POOL, S.ONLINE, "other")])
def test_a_request_cannot_name_a_reply_subject_outside_its_own_replies(fresh, reply):
    """Found by the fuzz: a body ``reply`` with a space made the admitter (after allowing it), the
    router and the worker raise BadSubjectError on their replies, so the request ran up to 3 times;
    a valid foreign subject makes a service publish there with its own rights (``$KV.inflight.usage``
    overwrote the admitters' shared usage with a Reply)."""
    env = fresh
    rid = new_id()
    request = valid_messages(rid=rid, tenant="fz", reply=reply)["Request"]
    before = env.run(env.bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))
    ack = env.run(env.bus.jpublish(S.request(S.ONLINE, "fz"), request.encode(), msg_id=rid))
    assert env.wait_async(_admitter_acked(env, ack.seq))
    after = env.run(env.bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))
    assert after is None or orjson.loads(after[0]) is not None, "the shared usage was overwritten"
    assert before is None or after[1] >= before[1]
    refused = [d.reason for d in env.observer.dead.get(rid, [])] == ["invalid"] or any(
        d.decision == "reject" for d in env.observer.decisions.get(rid, []))
    assert refused, f"a request with reply {reply!r} was not refused"
    env.assert_no_crash(f"a request with reply {reply!r}")


def test_a_completion_whose_request_id_is_not_a_token_is_dead_lettered_once(fresh):
    """Found by the fuzz: ``request_id`` "\\x96©" passed the Completion schema and made the admitter's
    release raise ValueError (``S.reservation_key``): the batch was redelivered 5 times and the
    completion dead-lettered as ``max_deliver``."""
    env = fresh
    rid = new_id()
    wire = valid_messages(rid=rid)["Completion"].to_wire() | {"request_id": "\x96©"}
    ack = env.run(env.bus.jpublish(S.completion("fz", "w1"), pack(wire), msg_id=f"{rid}:done"))
    assert env.wait_async(lambda: _consumers_done(env.bus, ack.seq))
    # by the admitters' consumer; the routers only watch completions and skip it
    assert [d.reason for d in env.observer.dead.get(f"{rid}:done", [])] == ["invalid"]
    env.assert_no_crash("a completion with request_id '\\x96©'")


def test_a_cancel_control_does_not_crash_the_worker(fresh):
    """Found by the fuzz: ``{"kind": "cancel"}`` on ``worker.<id>.ctl`` raised AttributeError:
    the agent reads ``Control.request_id``, a field the schema does not have."""
    env = fresh
    before = len(env.observer.cache_events)

    async def send():
        await env.bus.publish(S.control("w1"), pack({"kind": "cancel", "request_id": "nobody", "v": 1}))
        await env.bus.publish(S.control("w1"), Control(kind="snapshot", by="fuzz-sentinel"))

    env.run(send())
    assert env.wait(lambda: any(e.kind == "snapshot" for e in env.observer.cache_events[before:]))
    env.assert_no_crash("a cancel control")


def test_a_reply_header_cannot_make_a_service_publish_outside_the_replies(fresh):
    """The header twin of the body ``reply``: the dead-letter path answers ``Natsched-Reply`` with the
    admitter's own rights, so ``$KV.inflight.usage`` there overwrote the shared usage."""
    env = fresh
    rid = new_id()
    ack = env.run(env.bus.jpublish(S.request(S.ONLINE, "fz"), b"\xc1", msg_id=rid,
                                   headers={S.HDR_REPLY: "$KV.inflight.usage"}))
    assert env.wait_async(_admitter_acked(env, ack.seq))
    after = env.run(env.bus.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))
    assert after is None or orjson.loads(after[0]) is not None, "the shared usage was overwritten"
