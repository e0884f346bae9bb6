"""``natsched bench shared-state``: what the admitters' compare-and-swap on ``inflight/usage`` costs.

Each replica (its own connection, like a separate admitter) commits one-token reservations
through :meth:`natsched.admitter.shared.SharedState.change_usage` as fast as it can, for a while. The
benchmark reports commits per second, lost races (conflicts) per commit, and checks that the
final aggregate equals the number of commits: no update lost, nothing admitted twice.
One commit stands for a whole batch of decisions in the admitter, so these numbers bound how
often replicas can decide together, not how many requests they can decide.

``--partitions P``: replica ``i`` commits to partition ``i % P``'s own bucket (``inflight-p<k>``), as
partitioned admitters do (:mod:`natsched.admitter.partition`): what one key's serialisation costs
against keys that commit in parallel, on the same server.
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


def usage_buckets(partitions: int) -> list[str]:
    return [S.BUCKET_INFLIGHT] if partitions == 1 else [S.partition_bucket(k) for k in range(partitions)]


async def _replica(url: str, name: str, seconds: float, bucket: str = S.BUCKET_INFLIGHT) -> tuple[int, int]:
    bus = await Bus.connect(url, name=name)
    try:
        shared = SharedState(bus, name, bucket=bucket)
        await shared.start()
        commits = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await shared.change_usage(lambda u: (u.plus("bench", "default", 1), None))
            commits += 1
        return commits, shared.conflicts
    finally:
        await bus.close()


async def measure(url: str, replicas: int, seconds: float, partitions: int = 1) -> dict:
    setup = await Bus.connect(url, name="bench-shared")
    keys = usage_buckets(partitions)
    try:
        await setup.provision()
        if partitions > 1:
            await setup.set_partitions(partitions)
        for bucket in keys:
            await setup.kv(bucket).put(S.KEY_USAGE, Usage().to_json())
        started = time.monotonic()
        results = await asyncio.gather(*(_replica(url, f"r{i}", seconds, keys[i % len(keys)])
                                         for i in range(replicas)))
        wall = time.monotonic() - started
        used = [Usage.from_json((await setup.kv(bucket).get(S.KEY_USAGE))[0]).used for bucket in keys]
    finally:
        await setup.close()
    commits = sum(c for c, _ in results)
    conflicts = sum(x for _, x in results)
    final = Usage(used=sum(used))
    return {"replicas": replicas, "partitions": partitions, "seconds": round(wall, 2), "commits": commits,
            "commits_per_s": round(commits / wall), "conflicts_per_commit": round(conflicts / max(1, commits), 3),
            "final_used": final.used, "lost_updates": commits - final.used, "used_per_partition": used}


def run_shared_state(replicas: list[int], seconds: float, nats_url: str | None = None,
                     partitions: list[int] = (1,)) -> list[dict]:
    data_dir = tempfile.mkdtemp(prefix="natsched-bench-")
    server = None if nats_url else EmbeddedServer(port=free_port(), data_dir=data_dir).start()
    try:
        return [asyncio.run(measure(nats_url or server.url, n, seconds, p)) for p in partitions for n in replicas]
    finally:
        if server:
            server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def print_table(rows: list[dict]) -> None:
    print(f"{'partitions':>10} {'replicas':>8} {'commits/s':>10} {'conflicts/commit':>17} {'lost updates':>13}")
    for r in rows:
        print(f"{r['partitions']:>10} {r['replicas']:>8} {r['commits_per_s']:>10} {r['conflicts_per_commit']:>17} "
              f"{r['lost_updates']:>13}")
