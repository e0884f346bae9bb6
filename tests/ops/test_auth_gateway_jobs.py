"""``GET /v1/natsched/jobs/{id}`` under ``natsched auth init``: the gateway's own role reads the
job records of the tenants it serves and nothing more, on a real nats-server with the generated
config. Every service on its own role (admitter, router, worker, offline runner, gateway); the
official openai SDK meets the degraded answer, httpx fetches the job with the caller's key.
"""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from natsched.bus.connection import Bus
from natsched.wire import subjects as S
from natsched.wire.roles import JS_API, local_subject
from tests.factories.auth import RoleServices, admin_provisioned, secured_server
from tests.factories.core import wait_for
from tests.factories.gateway import start_gateway
from tests.ops.test_auth_permissions import assert_no_violation, probe  # noqa: F401 (probe: a fixture)

TENANTS = ["A", "B", "C"]
GATEWAY_TENANTS = ["A", "B"]  # C is not served by the gateway
KEYS = {"sk-tenant-a-0123456789": {"tenant": "A", "class": "batch"},
        "sk-tenant-b-0123456789": {"tenant": "B", "class": "batch"}}
KEY_A, KEY_B = KEYS


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    with secured_server(tmp_path_factory.mktemp("auth-gateway-jobs"), tenants=TENANTS, workers=["w1"],
                        gateway_tenants=GATEWAY_TENANTS) as both:
        yield both


@pytest.fixture(scope="module")
async def provisioned(secured):
    server, files = secured
    async with admin_provisioned(server, files) as admin:
        yield server, files, admin


@pytest.fixture
async def services(provisioned):
    """Every service on its own role (batch requests always degraded), and the gateway on its."""
    server, files, _ = provisioned
    buses: list[Bus] = []

    async def as_role(user: str) -> Bus:
        buses.append(await Bus.connect(server.url, name=user, credentials=files.creds(user)))
        return buses[-1]

    running = await RoleServices.start(as_role)
    gw = await start_gateway(server.url, keys=KEYS, credentials=files.creds("gateway"))
    try:
        await gw.wait_for_workers(1)
        yield gw
    finally:
        await gw.close()
        await running.stop()
        for bus in reversed(buses):
            await bus.close()


async def _degraded(gw, key: str) -> str:
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)
    try:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await sdk.completions.create(model="default", prompt="a job for later " * 4, max_tokens=3)
    finally:
        await sdk.close()
    assert caught.value.code == "degraded_to_job"
    return caught.value.body["job_id"]


async def test_a_degraded_requests_job_is_read_through_the_gateway_with_its_own_keys_only(services, caplog):
    gw = services
    job_a, job_b = await _degraded(gw, KEY_A), await _degraded(gw, KEY_B)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        async def get(job_id: str, key: str) -> httpx.Response:
            return await http.get(f"/v1/natsched/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})

        async def done(job_id: str, key: str):
            r = await get(job_id, key)
            assert r.status_code == 200, r.text  # readable at once (the admitter's record), then until completed
            return r.json() if r.json()["done"] else None

        for job_id, key in ((job_a, KEY_A), (job_b, KEY_B)):
            assert await wait_for(lambda: done(job_id, key), timeout=60)
            job = await done(job_id, key)
            assert job["status"] == "completed" and job["output"].split() == ["tok0", "tok1", "tok2"]
        # a tenant's key cannot read another tenant's job (the same answer as for no job at all)
        for job_id, key in ((job_a, KEY_B), (job_b, KEY_A)):
            other = await get(job_id, key)
            assert other.status_code == 404 and other.json()["error"]["code"] == "job_not_found"
        assert (await get("no-such-job", KEY_A)).status_code == 404
    assert_no_violation(caplog)  # the gateway's reads were all within its role


async def test_the_gateway_role_reads_its_tenants_jobs_and_nothing_else_of_the_bucket(probe):
    gw = await probe("gateway")
    jobs = S.kv_stream(S.BUCKET_JOBS)

    def key(tenant: str) -> str:
        return S.kv_subject(S.BUCKET_JOBS, f"job.{tenant}.b1.j1")

    allowed = [f"{JS_API}.DIRECT.GET.{jobs}.{key('A')}", f"{JS_API}.DIRECT.GET.{jobs}.{key('B')}",
               f"{JS_API}.CONSUMER.CREATE.{jobs}.x.{key('A')}", f"{JS_API}.STREAM.INFO.{jobs}"]
    for subject in allowed:
        assert not await gw.publish(local_subject(subject)), f"the gateway was refused {subject}"
    refused = [
        f"{JS_API}.DIRECT.GET.{jobs}.{key('C')}",  # a tenant it does not serve
        f"{JS_API}.CONSUMER.CREATE.{jobs}.x.{key('C')}",
        f"{JS_API}.CONSUMER.CREATE.{jobs}.x.{S.kv_subject(S.BUCKET_JOBS, '>')}",  # the whole bucket
        f"{JS_API}.CONSUMER.CREATE.{jobs}",  # an unnamed consumer (its filter is in the body)
        f"{JS_API}.DIRECT.GET.{jobs}.{S.kv_subject(S.BUCKET_JOBS, S.batch_key('b1'))}",  # manifests
        f"{JS_API}.DIRECT.GET.{jobs}",  # a direct get naming the key in its body
        f"{JS_API}.STREAM.MSG.GET.{jobs}", f"{JS_API}.CONSUMER.MSG.NEXT.{jobs}.x",
        key("A"), key("B"),  # no write, not even its own tenants' records
        f"{JS_API}.STREAM.CREATE.{jobs}", f"{JS_API}.STREAM.UPDATE.{jobs}", f"{JS_API}.STREAM.PURGE.{jobs}",
        f"{JS_API}.STREAM.DELETE.{jobs}", f"{JS_API}.STREAM.CREATE.{S.STREAM_OUTCOMES}",
        f"{JS_API}.CONSUMER.CREATE.{S.STREAM_OUTCOMES}.x.{S.outcome('A', 'b1', 'j1')}",
        f"{JS_API}.STREAM.MSG.GET.{S.STREAM_REQUESTS}",
    ]
    for subject in refused:
        assert await gw.publish(local_subject(subject), orjson.dumps(1)), f"the gateway was allowed {subject}"
