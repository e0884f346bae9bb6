"""The harness waits for the server to drop a finished test's connections (tests/serverwatch.py)."""

import shutil
import tempfile

import pytest

from natsched.bus.connection import Bus
from natsched.bus.server import EmbeddedServer, free_port
from tests.serverwatch import MONITORS, wait_gone


async def test_wait_gone_waits_for_the_server_to_drop_the_connection():
    # a server of its own, so that the test does not depend on which server the session uses
    data_dir, monitor_port = tempfile.mkdtemp(prefix="natsched-watch-"), free_port()
    server = EmbeddedServer(port=free_port(), data_dir=data_dir, extra_args=["-m", str(monitor_port)])
    server.start()
    MONITORS[server.url] = f"http://{server.host}:{monitor_port}"
    try:
        b = await Bus.connect(server.url, name="watched")
        with pytest.raises(AssertionError, match="watched"):
            await wait_gone(server.url, [b], timeout=0.2)  # still open: the server serves it
        await b.close()
        await wait_gone(server.url, [b], timeout=10)
    finally:
        MONITORS.pop(server.url, None)
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
