"""``natsched bench shared-state``: what the admitters' compare-and-swap on ``inflight/usage`` costs.

Each replica (its own connection, like a separate admitter) commits one-token reservations
through :meth:`natsched.admitter.shared.SharedState.change_usage` as fast as it can, for a while. The
benchmark reports commits per second, lost races (conflicts) per commit, and checks that the
final aggregate equals the number of commits: no update lost, nothing admitted twice.
One commit stands for a whole batch of decisions in the admitter, so these numbers bound how
often replicas can decide together, not how many requests they can decide.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time

from natsched.admitter.shared import SharedState
from natsched.admitter.usage import Usage
from natsched.wire import subjects as S
from natsched.bus.connection import Bus
from natsched.bus.server import EmbeddedServer, free_port


async def _replica(url: str, name: str, seconds: float) -> tuple[int, int]:
    bus = await Bus.connect(url, name=name)
    try:
        shared = SharedState(bus, name)
        await shared.start()
        commits = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await shared.change_usage(lambda u: (u.plus("bench", "default", 1), None))
            commits += 1
        return commits, shared.conflicts
    finally:
        await bus.close()


async def measure(url: str, replicas: int, seconds: float) -> dict:
    setup = await Bus.connect(url, name="bench-shared")
    try:
        await setup.provision()
        await setup.kv(S.BUCKET_INFLIGHT).put(S.KEY_USAGE, Usage().to_json())
        started = time.monotonic()
        results = await asyncio.gather(*(_replica(url, f"r{i}", seconds) for i in range(replicas)))
        wall = time.monotonic() - started
        final = Usage.from_json((await setup.kv(S.BUCKET_INFLIGHT).get(S.KEY_USAGE))[0])
    finally:
        await setup.close()
    commits = sum(c for c, _ in results)
    conflicts = sum(x for _, x in results)
    return {"replicas": replicas, "seconds": round(wall, 2), "commits": commits,
            "commits_per_s": round(commits / wall), "conflicts_per_commit": round(conflicts / max(1, commits), 3),
            "final_used": final.used, "lost_updates": commits - final.used}


def run_shared_state(replicas: list[int], seconds: float, nats_url: str | None = None) -> list[dict]:
    data_dir = tempfile.mkdtemp(prefix="natsched-bench-")
    server = None if nats_url else EmbeddedServer(port=free_port(), data_dir=data_dir).start()
    try:
        return [asyncio.run(measure(nats_url or server.url, n, seconds)) for n in replicas]
    finally:
        if server:
            server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def print_table(rows: list[dict]) -> None:
    print(f"{'replicas':>8} {'commits/s':>10} {'conflicts/commit':>17} {'lost updates':>13}")
    for r in rows:
        print(f"{r['replicas']:>8} {r['commits_per_s']:>10} {r['conflicts_per_commit']:>17} {r['lost_updates']:>13}")
