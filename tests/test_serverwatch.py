"""The harness waits for the server to drop a finished test's connections (tests/serverwatch.py)."""

import pytest

from bus.connection import Bus
from tests.serverwatch import MONITORS, wait_gone


async def test_wait_gone_waits_for_the_server_to_drop_the_connection(nats_url):
    if nats_url not in MONITORS:  # NATSCHED_TEST_NATS_URL or a container; CI always starts its own
        pytest.skip("the harness knows no monitoring port for an outside server")
    b = await Bus.connect(nats_url, name="watched")
    with pytest.raises(AssertionError, match="watched"):
        await wait_gone(nats_url, [b], timeout=0.2)  # still open: the server serves it
    await b.close()
    await wait_gone(nats_url, [b], timeout=10)
