"""A gateway in the running event loop, for tests and demos: every argument has a keyword default.

``await start_gateway(nats_url)`` connects its own Bus (as the real command does), serves on a
free loopback port and returns the :class:`~natsched.gateway.server.GatewayServer`; ``await
server.close()`` stops the server and closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson

from natsched.client.producer import Client, Timeouts
from natsched.bus.connection import Bus
from natsched.bus.server import free_port
from natsched.gateway.keys import KeyRing
from natsched.gateway.server import GatewayServer
from natsched.gateway.service import Gateway, GatewaySettings

#: two tenants: alpha may use any class, beta at most batch
KEYS = {
    "sk-alpha-0123456789": {"tenant": "alpha", "class": "online"},
    "sk-beta-0123456789": {"tenant": "beta", "class": "batch"},
}
ALPHA, BETA = "sk-alpha-0123456789", "sk-beta-0123456789"


class TestGateway(GatewayServer):
    __test__ = False  # not a pytest class

    async def close(self) -> None:
        await self.stop()
        await self.gateway.client.bus.close()

    async def wait_for_workers(self, n: int, timeout: float = 10.0) -> None:
        """Until ``n`` workers' heartbeats have arrived (the gateway learns models from them)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while len(self.gateway.status.state.heartbeats) < n:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{len(self.gateway.status.state.heartbeats)} of {n} workers seen")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def gateway_over_stack(nats_url: str, workers: int = 2, *, time_scale: float = 1.0, **settings: Any):
    """A stack (``tests.factories.stack``) and a gateway in front of it that has seen every
    worker: ``async with gateway_over_stack(url) as (stack, gw)``; both closed afterwards."""
    from tests.factories.stack import start_stack

    stack = await start_stack(nats_url, workers=workers, time_scale=time_scale)
    gw = await start_gateway(nats_url, **settings)
    try:
        await gw.wait_for_workers(workers)
        yield stack, gw
    finally:
        await gw.close()
        await stack.close()


async def start_gateway(
    nats_url: str,
    *,
    keys: dict[str, Any] | None = None,
    open_tenant: str | None = None,
    timeouts: Timeouts | None = None,
    credentials: Any = None,
    **settings: Any,
) -> TestGateway:
    bus = await Bus.connect(nats_url, name="gateway", credentials=credentials)
    ring = KeyRing.open(open_tenant) if open_tenant else KeyRing.from_json(orjson.dumps(KEYS if keys is None else keys))
    settings.setdefault("port", free_port())
    gs = GatewaySettings(**settings)
    client = Client(bus, timeouts or Timeouts(admission=10, idle=20), migrations=gs.stream_migrations)
    server = TestGateway(Gateway(client, ring, gs))
    return await server.start()  # type: ignore[return-value]
