"""Traces leave by OTLP when configured (issue 25, item 7): ``natsched up`` with
``OTEL_EXPORTER_OTLP_ENDPOINT`` set exports every service's spans over OTLP/HTTP (the SDK's own
exporter, protobuf) to a collector endpoint; a request sent with curl to the gateway arrives as
one trace gateway -> admission -> routing -> worker, each service under its own name, joined by
the request id. The collector is a plain HTTP server that decodes the standard
``ExportTraceServiceRequest`` (opentelemetry-proto): no collector binary is packaged here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from natsched.bus.server import free_port
from tests.factories.core import read_until_up

PATH = ("natsched.gateway", "natsched.admission", "natsched.routing", "natsched.worker")


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span it was sent, as (service, name, trace id, attributes)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes, dict]] = []
        self.paths: set[str] = set()
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        export = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            self.server.paths.add(self.path)
            for rs in export.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        attrs = {a.key: a.value.string_value or a.value.int_value for a in s.attributes}
                        self.server.spans.append((service, s.name, s.trace_id, attrs))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(b"")

    def log_message(self, *args) -> None:
        pass


def _curl(url: str) -> str:
    return subprocess.run(["curl", "-sS", url], capture_output=True, text=True, timeout=30).stdout


def test_natsched_up_exports_one_trace_per_request_over_otlp(tmp_path):
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    gw_port = free_port()
    env = os.environ | {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}",
                        "NATSCHED_TRACE_TOKEN_SHARE": "1", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    proc = subprocess.Popen([sys.executable, "-m", "natsched", "up", "--workers", "1", "--port", str(free_port()),
                             "--data-dir", str(tmp_path / "data"), "--time-scale", "0.05", "--gateway", str(gw_port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        read_until_up(proc, 60)
        deadline = time.monotonic() + 60
        while '"default"' not in _curl(f"http://127.0.0.1:{gw_port}/health") and time.monotonic() < deadline:
            time.sleep(0.1)  # the gateway has heard no worker's heartbeat yet
        out = subprocess.run(["curl", "-sS", "-D", "-", "-H", "content-type: application/json",
                              f"http://127.0.0.1:{gw_port}/v1/chat/completions", "-d",
                              '{"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}'],
                             capture_output=True, text=True, timeout=60)
        assert " 200" in out.stdout.splitlines()[0], out.stdout
        rid = next(line.split(":", 1)[1].strip() for line in out.stdout.splitlines()
                   if line.lower().startswith("x-request-id:"))

        def mine():
            with collector.lock:
                return [s for s in collector.spans if s[3].get("natsched.request_id") == rid]

        deadline = time.monotonic() + 60
        # (not a strict-subset test: a span outside PATH, such as first_token, must not end the wait)
        while not {s[1] for s in mine()} >= set(PATH) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling a collector thread: the exporter sends on its own schedule
        spans = mine()
        assert {s[1] for s in spans} >= set(PATH), spans
        assert collector.paths == {"/v1/traces"}
        assert len({s[2] for s in spans}) == 1  # one trace across four processes and the bus
        by_name = {name: service for service, name, _, _ in spans}
        assert by_name["natsched.gateway"] == "natsched-gateway" and by_name["natsched.worker"] == "natsched-worker w1"
        assert by_name["natsched.admission"].startswith("natsched-admitter")
        worker = next(s[3] for s in spans if s[1] == "natsched.worker")
        assert worker["natsched.tokens.kept"] == "sampled"  # NATSCHED_TRACE_TOKEN_SHARE=1 reached the worker
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        collector.shutdown()
