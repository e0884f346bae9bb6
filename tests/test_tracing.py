"""Traces of a request's path with the OpenTelemetry SDK's in-memory exporter: one trace from the
gateway through admission, routing and the worker (first token, done), the context carried in
message headers across a real nats-server; token timing kept for the sampled share, the tail and
errors; natsched without the package; bad settings refused."""

from __future__ import annotations

import subprocess
import sys

import openai
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from natsched import tracing
from tests.factories.core import wait_for
from tests.factories.gateway import ALPHA, start_gateway
from tests.factories.stack import start_stack

PATH = ["natsched.gateway", "natsched.admission", "natsched.routing", "natsched.worker",
        "natsched.worker.first_token", "natsched.worker.done"]


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.configure(tracing.TraceSettings(service="test", token_share=1.0), exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


@pytest.mark.parametrize("inline", [False, True])
async def test_one_trace_from_the_gateway_to_the_last_token(spans, bus, nats_url, inline):
    stack = await start_stack(nats_url, workers=2, inline_routing=inline)
    gw = await start_gateway(nats_url)
    try:
        await gw.wait_for_workers(2)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ALPHA, max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": "trace me"}])
        rid = raw.headers["x-request-id"]
        assert await wait_for(lambda: {s.name for s in spans.get_finished_spans()} >= set(PATH))
        mine = {s.name: s for s in spans.get_finished_spans() if s.attributes.get("natsched.request_id") == rid}
        assert set(mine) == set(PATH)
        assert len({s.context.trace_id for s in mine.values()}) == 1  # one trace, across the bus
        parent = {name: s.parent.span_id if s.parent else None for name, s in mine.items()}
        for child, up in zip(PATH[1:4], PATH[:3]):
            assert parent[child] == mine[up].context.span_id, child
        assert parent["natsched.worker.first_token"] == parent["natsched.worker.done"] == \
            mine["natsched.worker"].context.span_id
        routing = mine["natsched.routing"].attributes
        assert routing["natsched.worker"] in ("w1", "w2") and routing["natsched.policy"]
        assert set(orjson.loads(routing["natsched.route.terms"])) == {"w1", "w2"}  # the terms of each candidate
        assert mine["natsched.admission"].attributes["natsched.decision"] == "allow"
        worker = mine["natsched.worker"].attributes
        assert worker["natsched.output_tokens"] == 4 and worker["natsched.tokens.kept"] == "sampled"
        offsets = list(worker["natsched.tokens.offsets_ms"])
        assert len(offsets) == 4 and offsets == sorted(offsets)
        assert mine["natsched.worker.first_token"].end_time <= mine["natsched.worker.done"].start_time
    finally:
        await gw.close()
        await stack.close()


async def test_token_timing_is_kept_for_errors_even_when_none_is_sampled(bus, nats_url):
    exporter = InMemorySpanExporter()
    tracing.configure(tracing.TraceSettings(token_share=0.0), exporter=exporter)
    stack = await start_stack(nats_url, workers=1, time_scale=40.0)
    try:
        from natsched.client.errors import RequestFailed
        from natsched.client.producer import make_request

        ok = make_request("t1", "fine", max_tokens=2)
        await stack.client.submit(ok)
        with pytest.raises(RequestFailed):
            await stack.client.submit(make_request("t1", "stalls", max_tokens=50, idle_timeout=0.05))
        assert await wait_for(lambda: len([s for s in exporter.get_finished_spans()
                                           if s.name == "natsched.worker"]) == 2)
        runs = {s.attributes["natsched.request_id"]: s for s in exporter.get_finished_spans()
                if s.name == "natsched.worker"}
        assert "natsched.tokens.offsets_ms" not in runs.pop(ok.id).attributes  # not sampled, not slow
        (failed,) = runs.values()
        assert failed.attributes["natsched.tokens.kept"] == "error" and failed.attributes["natsched.reason"] == \
            "idle_timeout" and not failed.status.is_ok
    finally:
        tracing.shutdown()
        await stack.close()


def test_the_tail_tracker_flags_runs_above_the_p99():
    tail = tracing.TailTracker(window=1000, every=10, warmup=100)
    flagged = [tail.observe(1.0 + (i % 100) / 1000) for i in range(300)]  # 1.000 .. 1.099, three times
    assert not any(flagged[:100])  # warming up: no p99 yet
    assert tail.p99 == pytest.approx(1.098)
    assert sum(flagged[100:]) <= 4  # only the top of each round: 1.099
    assert tail.observe(5.0) and not tail.observe(1.05)


def test_natsched_runs_without_opentelemetry_and_refuses_bad_settings():
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import natsched.gateway.app, natsched.admitter.service, natsched.router.service, natsched.workers.agent\n"
        "from natsched import tracing\n"
        "assert not tracing.configure_from_env('x', {}) and not tracing.enabled()\n"
        "assert tracing.start('s', {'traceparent': 'x'}, 'r1') is None and tracing.carry(None, {'a': 'b'}) == {'a': 'b'}\n"
        "try:\n"
        "    tracing.configure_from_env('x', {'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://127.0.0.1:4318'})\n"
        "except tracing.TracingError as e:\n"
        "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'natsched[tracing]'" in out.stdout
    for env in ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318", "NATSCHED_TRACE_TOKEN_SHARE": "lots"},
                {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318", "NATSCHED_TRACE_TOKEN_SHARE": "1.5"},
                {"OTEL_EXPORTER_OTLP_ENDPOINT": "h:4318"}):
        with pytest.raises(tracing.TracingError):
            tracing.configure_from_env("x", env)
        assert not tracing.enabled()  # nothing changed
