"""Tenants isolated by the broker: what a producer, batch producer or gateway names cannot reach
the scheduler's KV or streams (issue 26), against a real nats-server with ``auth init``'s config.

The attack that worked with one shared account: a JetStream publish on the tenant's own
``req.online.<t>`` with its NATS reply-to set to ``$KV.inflight.usage`` (or another tenant's
quota key) made the server write its publish ack there. In accounts of their own the ack goes
back into the publisher's account, where no bucket exists: each test publishes the attack, waits
until the request is stored (so the ack was sent), and reads the targets back unchanged.
"""

from __future__ import annotations

import asyncio
import uuid

import nats
import orjson
import pytest

from natsched.bus.connection import Bus, Credentials
from natsched.client.producer import make_request
from natsched.wire import subjects as S
from natsched.wire.roles import local_subject, tenant_account
from tests.ops.test_auth_permissions import provisioned, secured  # noqa: F401 (fixtures)

USAGE_KEY = S.kv_subject(S.BUCKET_INFLIGHT, S.KEY_USAGE)
QUOTA_B = S.kv_subject(S.BUCKET_QUOTAS, S.tenant_quota_key("B"))
GOOD_USAGE = b'{"long":0,"models":{"m":5},"tenants":{"B":5},"used":5}'
GOOD_QUOTA = b'{"cap":7,"floor":0.0,"weight":1.0}'


async def _stored(admin: Bus, stream: str, count: int) -> None:
    """Wait (bounded, on the stream's state) until ``stream`` holds ``count`` messages."""
    for _ in range(500):
        if (await admin.stream(stream).info()).messages >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{stream} never held {count} messages")


async def _seed(admin: Bus) -> tuple[int, int]:
    await admin.kv(S.BUCKET_INFLIGHT).put(S.KEY_USAGE, GOOD_USAGE)
    await admin.kv(S.BUCKET_QUOTAS).put(S.tenant_quota_key("B"), GOOD_QUOTA)
    usage = await admin.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE)
    quota = await admin.kv(S.BUCKET_QUOTAS).get(S.tenant_quota_key("B"))
    return usage[1], quota[1]


async def _unchanged(admin: Bus, usage_rev: int, quota_rev: int) -> None:
    assert await admin.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE) == (GOOD_USAGE, usage_rev)
    assert await admin.kv(S.BUCKET_QUOTAS).get(S.tenant_quota_key("B")) == (GOOD_QUOTA, quota_rev)


async def _raw(url: str, creds) -> nats.NATS:
    return await nats.connect(url, allow_reconnect=False, **Credentials.load(creds).options())


def _body(tenant: str) -> bytes:
    return make_request(tenant, "hello", max_tokens=4).encode()


@pytest.mark.parametrize("user", ["producer-A", "batch-A", "gateway"])
async def test_a_publish_ack_cannot_be_written_into_the_schedulers_kv(provisioned, user):  # noqa: F811
    """Four publishes with reply-to ``$KV.inflight.usage`` and one with another tenant's quota
    key: the requests are stored (the server sent its acks), and neither key moved."""
    server, files, admin = provisioned
    usage_rev, quota_rev = await _seed(admin)
    before = (await admin.stream(S.STREAM_REQUESTS).info()).messages
    nc = await _raw(server.url, files.creds(user))
    try:
        targets = [USAGE_KEY] * 4 + [QUOTA_B]
        for target in targets:
            await nc.publish(S.request(S.ONLINE, "A"), _body("A"), reply=target,
                             headers={S.HDR_MSG_ID: f"attack-{uuid.uuid4().hex}"})
        await nc.flush()
        await _stored(admin, S.STREAM_REQUESTS, before + len(targets))
        # the acks went back to the publisher's own account; give them a round trip more
        await nc.flush()
    finally:
        await nc.close()
    await _unchanged(admin, usage_rev, quota_rev)


async def test_a_batch_producers_consumer_cannot_deliver_into_the_schedulers_kv(provisioned):  # noqa: F811
    """A push consumer's deliver subject is in the services' account: batch-A names the usage key
    (and B's quota) as the deliver subject of a consumer on its own requests. The server accepts
    the consumer but writes nothing there: a bucket's stream is no subscriber a push consumer
    delivers to (it is removed when its inactivity threshold passes without interest)."""
    server, files, admin = provisioned
    usage_rev, quota_rev = await _seed(admin)
    nc = await _raw(server.url, files.creds("batch-A"))
    try:
        await nc.publish(S.request(S.ONLINE, "A"), _body("A"))
        await nc.flush()
        answers = []
        for name, target in (("hijack1", USAGE_KEY), ("hijack2", QUOTA_B)):
            body = {"stream_name": S.STREAM_REQUESTS, "config": {
                "name": name, "filter_subject": S.requests_of("A"), "deliver_subject": target,
                "ack_policy": "none", "deliver_policy": "all"}}
            create = local_subject(f"$JS.API.CONSUMER.CREATE.{S.STREAM_REQUESTS}.{name}.{S.requests_of('A')}")
            answers.append(orjson.loads((await nc.request(create, orjson.dumps(body), timeout=10)).data))
        for answer in answers:
            if "error" in answer:
                continue
            # accepted (the server does not check a deliver subject): wait, bounded, until it has
            # pushed what it holds or was removed for want of interest, then read the targets
            await _pushed_or_gone(admin, answer["name"])
    finally:
        await nc.close()
    await _unchanged(admin, usage_rev, quota_rev)


async def _pushed_or_gone(admin: Bus, name: str) -> None:
    from natsched.bus.errors import StreamNotFound

    for _ in range(1000):
        try:
            info = await admin.stream(S.STREAM_REQUESTS).consumer(name)
        except StreamNotFound:
            return
        if info.delivered_stream_seq and not info.pending:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"consumer {name} neither delivered nor went away")


def test_every_outside_role_lives_in_its_own_account(tmp_path):
    from natsched.ops.auth import AuthSettings, init

    files = init(AuthSettings(out=tmp_path / "auth", tenants=["A", "B"], workers=["w1"]))
    text = files.config.read_text()
    config = orjson.loads(text[text.index("{"):])
    accounts = config["accounts"]
    users = {u["user"]: name for name, acc in accounts.items() for u in acc["users"]}
    assert users["producer-A"] == users["batch-A"] == tenant_account("A") != users["producer-B"]
    assert users["gateway"] == "GATEWAY" and users["admitter"] == users["worker-w1"] == "NATSCHED"
    assert "jetstream" not in accounts[tenant_account("A")] and "jetstream" not in accounts["GATEWAY"]
    # A's account imports A's request subjects and replies, never B's
    imported = {next(iter(i.values()))["subject"] for i in accounts[tenant_account("A")]["imports"]}
    assert S.requests_of("A") in imported and S.replies_of("A") in imported
    assert not any(".B" in s or "job.B" in s for s in imported)
