"""Every service serves Prometheus metrics on its port; a scrape parses, and the histograms count real traffic."""

from __future__ import annotations

import asyncio
import urllib.request

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from natsched.admitter.service import AdmitterService, AdmitterServiceSettings
from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.bus.server import free_port
from tests.factories.gateway import ALPHA, start_gateway
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.profiles import H100_LLAMA8B
from natsched.workers.simengine import SimEngine

#: every documented metric (README, "Metrics") -> its type, per service
EXPECTED = {
    "admitter": {
        "natsched_admission_decisions": "counter",
        "natsched_admission_inflight_runtime_tokens": "gauge",
        "natsched_admission_total_runtime_tokens": "gauge",
        "natsched_admission_queue_depth": "gauge",
        "natsched_admission_queue_wait_seconds": "histogram",
        "natsched_admission_decision_latency_seconds": "histogram",
        "natsched_admission_batch_requests": "histogram",
        "natsched_admission_handoff_seconds": "histogram",
        "natsched_admission_reconciliation_repairs": "counter",
        "natsched_admission_cas_conflicts": "counter",
        "natsched_admission_bad_quota_entries": "counter",
        "natsched_admission_queue_wait_p95_seconds": "gauge",
        "natsched_admission_scale_signals": "counter",
        "natsched_admission_scale_advice": "gauge",
        "natsched_admission_lease_expiries": "counter",
        "natsched_admission_class_tokens": "gauge",
    },
    "router": {
        "natsched_routing_decisions": "counter",
        "natsched_routing_decision_latency_seconds": "histogram",
        "natsched_routing_wait_seconds": "histogram",
        "natsched_routing_expected_cached_tokens": "counter",
        "natsched_routing_prompt_tokens": "counter",
        "natsched_routing_workers": "gauge",
        "natsched_routing_snapshot_requests": "counter",
        "natsched_routing_config_errors": "counter",
        "natsched_routing_claim_failures": "counter",
        "natsched_routing_finished_copies": "counter",
        "natsched_routing_repeated_copies": "counter",
        "natsched_routing_prefix_routes": "counter",
        "natsched_routing_prefix_migrations": "counter",
    },
    "worker": {
        "natsched_worker_info": "gauge",  # an Info: labels worker, model
        "natsched_worker_ttft_seconds": "histogram",
        "natsched_worker_tpot_seconds": "histogram",
        "natsched_worker_e2e_seconds": "histogram",
        "natsched_worker_dispatch_wait_seconds": "histogram",
        "natsched_worker_requests": "counter",
        "natsched_worker_prompt_tokens": "counter",
        "natsched_worker_cached_tokens": "counter",
        "natsched_worker_output_tokens": "counter",
        "natsched_worker_cancelled": "counter",
        "natsched_worker_running": "gauge",
        "natsched_worker_waiting": "gauge",
        "natsched_worker_kv_used_blocks": "gauge",
        "natsched_worker_kv_total_blocks": "gauge",
        "natsched_worker_runtime_tokens": "gauge",
        "natsched_worker_capacity_tokens": "gauge",
        "natsched_worker_state": "gauge",
    },
    "gateway": {
        "natsched_gateway_requests": "counter",
        "natsched_gateway_errors": "counter",
        "natsched_gateway_request_duration_seconds": "histogram",
        "natsched_gateway_ttft_seconds": "histogram",
        "natsched_gateway_tpot_seconds": "histogram",
        "natsched_gateway_tokens": "counter",
        "natsched_gateway_inflight_requests": "gauge",
        "natsched_gateway_cancelled": "counter",
    },
}


#: every service's connection counts (natsched.bus.metrics), labelled by connection name
BUS = {"natsched_bus_records_lost": "counter", "natsched_bus_records_retrying": "gauge",
       "natsched_bus_server_changes": "counter"}
for _expected in EXPECTED.values():
    _expected.update(BUS)


def scrape(port: int) -> dict:
    """{family name: family} of one endpoint, parsed by prometheus_client's own parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, family: str, sample: str, **labels) -> float:
    return sum(s.value for s in families[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture
async def services(bus, nats_url):
    ports = {name: free_port() for name in EXPECTED}
    buses: list[Bus] = []

    async def connect(name: str) -> Bus:
        b = await Bus.connect(nats_url, name=name)
        buses.append(b)
        return b

    admitter = AdmitterService(await connect("admitter"), AdmitterServiceSettings(metrics_port=ports["admitter"]))
    await admitter.start()
    router = RouterService(await connect("router"), RouterServiceSettings(
        core=RouterSettings(policy="least_loaded"), retry_delay_s=0.2, metrics_port=ports["router"]))
    await router.start()
    worker = WorkerAgent(await connect("w1"), SimEngine(H100_LLAMA8B, block_size=32, time_scale=1.0),
                         WorkerSettings(id="w1", heartbeat_interval_s=0.2, metrics_port=ports["worker"]))
    await worker.start()
    gw = await start_gateway(nats_url, metrics_port=ports["gateway"])
    await gw.wait_for_workers(1)
    try:
        yield admitter, gw, ports
    finally:
        await gw.close()
        await worker.stop()
        for b in buses:
            await b.close()


async def test_each_service_serves_its_documented_metrics_and_they_count_real_traffic(services, bus):
    admitter, gw, ports = services
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ALPHA, max_retries=0)
    system = "Shared system prompt for the metrics test. " * 30
    for question in ("one", "two"):
        await client.chat.completions.create(model="default", max_tokens=4, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
    stream = await client.completions.create(model="default", prompt="stream it", max_tokens=4, stream=True)
    assert len([c async for c in stream]) == 5  # 4 tokens + the finish chunk
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x", max_tokens=1)
    # one request that waits in the admission queue, so queue wait is observed too
    await bus.kv(S.BUCKET_QUOTAS).put(S.KEY_CLUSTER_TOTAL, orjson.dumps(300))
    for _ in range(100):
        if admitter.total == 300:
            break
        await asyncio.sleep(0.05)
    first = asyncio.create_task(client.completions.create(model="default", prompt=list(range(100)), max_tokens=50))
    for _ in range(100):
        if admitter.shared.usage.used:
            break
        await asyncio.sleep(0.02)
    await client.completions.create(model="default", prompt=list(range(100)), max_tokens=50)
    await first
    await asyncio.sleep(0.5)  # a heartbeat after the last request (gauges) and the dequeue loop's gauges

    scraped = {name: await asyncio.to_thread(scrape, port) for name, port in ports.items()}
    for service, expected in EXPECTED.items():
        types = {name: f.type for name, f in scraped[service].items()}
        missing = {n: t for n, t in expected.items() if types.get(n) != t}
        assert not missing, f"{service} lacks {missing}"

    adm, rt, wk, gwm = (scraped[s] for s in ("admitter", "router", "worker", "gateway"))
    assert value(adm, "natsched_admission_decisions", "natsched_admission_decisions_total", decision="allow") == 5
    assert value(adm, "natsched_admission_decisions", "natsched_admission_decisions_total", decision="queue") == 1
    assert value(adm, "natsched_admission_queue_wait_seconds", "natsched_admission_queue_wait_seconds_count") == 1
    assert value(adm, "natsched_admission_decision_latency_seconds",
                 "natsched_admission_decision_latency_seconds_count") >= 5
    # five requests were pulled (the sixth decision is the queued one's allow, from the queue);
    # every allow's hand-off was waited for in some batch
    assert value(adm, "natsched_admission_batch_requests", "natsched_admission_batch_requests_sum") == 5
    handoffs = value(adm, "natsched_admission_handoff_seconds", "natsched_admission_handoff_seconds_count")
    assert 1 <= handoffs <= 5
    assert value(adm, "natsched_admission_handoff_seconds", "natsched_admission_handoff_seconds_sum") > 0
    for service, connection in (("admitter", "admitter"), ("router", "router"), ("worker", "w1")):
        families = scraped[service]
        assert value(families, "natsched_bus_records_lost", "natsched_bus_records_lost_total",
                     connection=connection) == 0  # every decision record was stored
        assert [s.labels["connection"] for s in families["natsched_bus_records_retrying"].samples] == [connection]
    assert value(rt, "natsched_routing_decision_latency_seconds",
                 "natsched_routing_decision_latency_seconds_count") == 5
    assert value(rt, "natsched_routing_decisions", "natsched_routing_decisions_total", decision="assign") == 5
    assert value(rt, "natsched_routing_workers", "natsched_routing_workers", state="healthy") == 1
    assert value(wk, "natsched_worker_ttft_seconds", "natsched_worker_ttft_seconds_count") == 5
    assert value(wk, "natsched_worker_tpot_seconds", "natsched_worker_tpot_seconds_count") == 5
    assert value(wk, "natsched_worker_requests", "natsched_worker_requests_total", status="ok") == 5
    assert value(wk, "natsched_worker_cached_tokens", "natsched_worker_cached_tokens_total") > 0  # shared system
    assert value(wk, "natsched_worker_state", "natsched_worker_state", state="healthy") == 1
    assert value(wk, "natsched_worker_kv_total_blocks", "natsched_worker_kv_total_blocks") > 0
    assert value(gwm, "natsched_gateway_ttft_seconds", "natsched_gateway_ttft_seconds_count") == 1  # the stream
    assert value(gwm, "natsched_gateway_requests", "natsched_gateway_requests_total",
                 endpoint="/v1/chat/completions", code="200") == 2
    assert value(gwm, "natsched_gateway_requests", "natsched_gateway_requests_total",
                 endpoint="/v1/completions", code="404") == 1
    assert value(gwm, "natsched_gateway_errors", "natsched_gateway_errors_total", code="model_not_found") == 1
    assert value(gwm, "natsched_gateway_tokens", "natsched_gateway_tokens_total", tenant="alpha", kind="output") \
        == 4 + 4 + 4 + 50 + 50
