"""The gateway's HTTP server (uvicorn in the running loop) and the ``natsched gateway`` command.

The command connects to NATS, starts following worker heartbeats (models, health, ``/status``),
serves HTTP and prints ``READY gateway http://HOST:PORT`` like every natsched service. Its flags
and settings are in :mod:`natsched.cli.gateway`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

import uvicorn

from natsched.client.producer import Client, Timeouts
from natsched.bus.connection import Bus
from natsched.errors import NatschedError
from natsched.gateway.app import build_app
from natsched.gateway.edge import EdgeLimits, EdgeProtocol
from natsched.cli.gateway import settings_from_args
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


async def run_gateway(args: argparse.Namespace) -> int:
    from natsched.hosting.runtime import serve

    settings, keys = settings_from_args(args)
    holder: dict[str, GatewayServer] = {}

    async def start(bus: Bus) -> str:
        client = Client(bus, Timeouts(queued=settings.max_wait_s))
        holder["server"] = server = await GatewayServer(Gateway(client, keys, settings)).start()
        who = f"open as tenant {keys.open_principal.tenant}" if keys.is_open else f"{len(keys)} keys"
        return f"{server.url} ({who})"

    async def stop() -> None:
        if "server" in holder:
            await holder["server"].stop()

    await serve(args.nats_url, settings.name, start, stop, credentials=args.credentials)
    return 0


def main(args: argparse.Namespace) -> int:
    """The ``natsched gateway`` command: uvloop when installed, one clear line on a bad setting."""
    try:
        settings_from_args(args)  # refuse bad flags before connecting anywhere
    except ConfigError as exc:
        print(f"natsched: error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # the pure-asyncio loop works, a little slower
        runner = asyncio.run
    try:
        return runner(run_gateway(args))
    except (NatschedError, ConfigError, OSError) as exc:
        print(f"natsched: error: {exc}", file=sys.stderr)
        return 1
