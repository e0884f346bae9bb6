"""Wait until the test server has let go of a finished test's connections.

A client that closes its socket may leave its last messages in the server's read buffer, and
the server matches them to streams only when it reads them. On a busy machine that can be after
the next test deleted and re-created every stream, so a finished test's message would land in
the next test's fresh stream. A connection the server no longer lists has nothing left unread.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

#: nats url -> monitoring base url, for the servers this session started (conftest.nats_url)
MONITORS: dict[str, str] = {}


def _connections(base: str) -> dict[int, str]:
    with urllib.request.urlopen(f"{base}/connz?limit=100000", timeout=5) as resp:
        body = json.load(resp)
    return {c["cid"]: c.get("name", "") for c in body.get("connections") or []}


async def wait_gone(nats_url: str, buses, timeout: float = 15.0) -> None:
    """Return once the server lists none of ``buses``' connections (no-op for a server whose
    monitoring port we do not know); AssertionError naming those left after ``timeout``."""
    base = MONITORS.get(nats_url)
    ids = {b.nc.client_id for b in buses if b.nc.client_id is not None}
    if base is None or not ids:
        return
    deadline = time.monotonic() + timeout
    while True:
        left = {cid: name for cid, name in (await asyncio.to_thread(_connections, base)).items() if cid in ids}
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the server still serves closed connections {left} after {timeout:g}s")
        await asyncio.sleep(0.02)
