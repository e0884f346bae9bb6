"""The batch producer against a real nats-server: each line submitted once, however often it runs."""

import asyncio
import subprocess
import sys

import orjson
import pytest

from natsched.wire import subjects as S
from natsched.client.batch import BatchClient, request_id
from natsched.client.errors import NotFound
from natsched.bus.provision import ProvisionSettings
from natsched.wire.schema import BatchManifest, Request


def batch_file(n: int = 10, *, bad: dict[int, bytes] | None = None) -> bytes:
    """``n`` prompt lines; ``bad`` replaces some (1-based) lines with raw bytes."""
    lines = [orjson.dumps({"prompt": f"question {i}", "max_tokens": 4}) for i in range(1, n + 1)]
    for line, raw in (bad or {}).items():
        lines[line - 1] = raw
    return b"\n".join(lines) + b"\n"


async def stored_ids(bus) -> list[str]:
    return [Request.decode(data).id for _, data in await bus.stream_messages(S.STREAM_REQUESTS)]


class Interrupt(Exception):
    pass


def interrupt_after(n: int):
    def progress(done: int, total: int) -> None:
        if done >= n:
            raise Interrupt()

    return progress


async def test_running_twice_submits_nothing_twice(bus):
    client = BatchClient(bus)
    first = await client.submit(batch_file(10), "t1")
    again = await client.submit(batch_file(10), "t1")
    assert (first.published, first.already) == (10, 0)
    assert (again.published, again.already, again.batch) == (0, 10, first.batch)
    ids = await stored_ids(bus)
    assert len(ids) == 10 and sorted(ids) == sorted(request_id(first.batch, i, "t1") for i in range(1, 11))


async def test_resume_after_an_interruption_long_after_the_dedup_window(bus):
    # the shortest dedup window the server allows (100 ms), then past it: the server no longer
    # protects us from a second copy; the manifest and the stream must
    await bus.provision(ProvisionSettings(dedup_window_s=0.1))
    client = BatchClient(bus, window=4)
    with pytest.raises(Interrupt):
        await client.submit(batch_file(12), "t1", progress=interrupt_after(8))
    assert len(await stored_ids(bus)) == 8
    await asyncio.sleep(0.3)
    resumed = await client.submit(batch_file(12), "t1", resume=True)
    assert (resumed.published, resumed.already, resumed.resumed) == (4, 8, True)
    ids = await stored_ids(bus)
    assert len(ids) == len(set(ids)) == 12
    manifest = BatchManifest.decode((await bus.kv(S.BUCKET_JOBS).get(S.batch_key(resumed.batch)))[0])
    assert manifest.complete and manifest.submitted == 12


async def test_resume_of_a_file_never_submitted_is_refused(bus):
    with pytest.raises(NotFound, match="nothing to resume"):
        await BatchClient(bus).submit(batch_file(3), "t1", resume=True)
    assert await stored_ids(bus) == []


async def test_malformed_lines_are_reported_and_the_rest_proceeds(bus):
    client = BatchClient(bus)
    data = batch_file(5, bad={2: b"{broken", 4: b'{"prompt": 3}'})
    report = await client.submit(data, "t1")
    assert report.published == 3 and sorted(report.malformed) == [2, 4]
    rows = await client.results(report.batch)
    assert [(r["line"], r["status"]) for r in rows] == [(1, "submitted"), (2, "malformed"), (3, "submitted"),
                                                        (4, "malformed"), (5, "submitted")]
    assert "'prompt' must be a string" in rows[3]["error"]
    status = await client.status(report.batch)
    assert status.counts == {"submitted": 3} and not status.done


async def test_unknown_batch_is_not_found(bus):
    with pytest.raises(NotFound, match="batch bnope not found"):
        await BatchClient(bus).status("bnope")


async def test_rate_limit_rejects_nonsense(bus):
    with pytest.raises(ValueError, match="rate must be > 0"):
        await BatchClient(bus).submit(batch_file(1), "t1", rate=0)


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    command, *rest = args
    return subprocess.run([sys.executable, "-m", "natsched.cli.jobs", command, *rest, "--nats-url", url],
                          capture_output=True, text=True, timeout=120)


def cli2(url: str, command: str, action: str, *rest: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "natsched.cli.jobs", command, action, *rest, "--nats-url", url],
                          capture_output=True, text=True, timeout=120)


async def test_cli_prints_progress_malformed_lines_and_the_batch_id_last(bus, nats_url, tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(batch_file(30, bad={7: b"nope"}))
    done = cli2(nats_url, "batch", "submit", str(path), "--tenant", "t1", "--rate", "1000")
    assert done.returncode == 0, done.stderr
    batch = done.stdout.strip().splitlines()[-1].split()[-1]
    assert batch.startswith("b") and len(await stored_ids(bus)) == 29
    assert f"{path}:7: skipped: not valid JSON" in done.stderr and "29/29" in done.stderr
    status = cli2(nats_url, "batch", "status", batch, "--json")
    assert orjson.loads(status.stdout)["counts"] == {"submitted": 29}
    out = tmp_path / "results.jsonl"
    results = cli2(nats_url, "batch", "results", batch, "--out", str(out))
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert results.returncode == 0 and len(rows) == 30 and rows[6]["status"] == "malformed"
    missing = cli2(nats_url, "batch", "status", "bmissing")
    assert missing.returncode == 2 and "not found" in missing.stderr
