"""The gateway's HTTP server: uvicorn inside the running event loop (the CLI and tests).

The ``natsched gateway`` command (:mod:`natsched.cli.gateway`) builds the settings, connects and
serves a :class:`GatewayServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from natsched.gateway.app import build_app
from natsched.gateway.edge import EdgeLimits, EdgeProtocol
from natsched.gateway.errors import ConfigError
from natsched.gateway.service import Gateway

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def capture_signals(self):  # natsched.hosting.runtime owns SIGINT/SIGTERM and stops us in order
        return contextlib.nullcontext()


class GatewayServer:
    """A :class:`Gateway` served over HTTP inside the running event loop (the CLI and tests)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        s = gateway.settings
        config = uvicorn.Config(build_app(gateway), host=s.host, port=s.port, log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                http=EdgeProtocol, timeout_keep_alive=s.idle_timeout_s)  # type: ignore[arg-type]
        shed = gateway.metrics.shed
        config.natsched_edge = EdgeLimits(  # type: ignore[attr-defined]  (read by EdgeProtocol)
            max_connections=s.max_connections, header_timeout_s=s.header_timeout_s, body_timeout_s=s.body_timeout_s,
            max_header_bytes=s.max_header_bytes, shed=lambda reason: shed.labels(reason).inc())
        self.server = _Server(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        s = self.gateway.settings
        return f"http://{s.host}:{s.port}"

    async def start(self) -> "GatewayServer":
        await self.gateway.start()
        self._task = asyncio.create_task(self.server.serve(), name="gateway-http")
        while not self.server.started:
            if self._task.done():  # port taken, bad host: say why
                self._task.result()
                raise ConfigError(f"the HTTP server on {self.url} did not start")
            await asyncio.sleep(0.02)
        if self.gateway.settings.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.gateway.settings.metrics_port, registry=self.gateway.metrics.registry)
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
