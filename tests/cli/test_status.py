"""``natsched status`` as an operator runs it: a child process against a live cluster."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import orjson
import pytest

from natsched.wire import subjects as S
from tests.factories.stack import start_stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def stack(bus, nats_url):
    s = await start_stack(nats_url, workers=2)
    await bus.kv(S.BUCKET_QUOTAS).put(S.tenant_quota_key("acme"), orjson.dumps({"floor": 0.1, "cap": 1000}))
    try:
        yield s
    finally:
        await s.close()


def _default_sigint() -> None:
    """In the child: Ctrl-C as a terminal gives it. A suite started in the background by a
    non-interactive shell runs with SIGINT ignored (POSIX), which children inherit — and
    a command honours an ignored SIGINT, as it should under ``nohup`` or ``cmd &``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def natsched(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "natsched", *args, cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                preexec_fn=_default_sigint)


async def test_status_prints_workers_tenants_queues_and_rejections(stack, nats_url):
    proc = await natsched("status", "--nats-url", nats_url)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "WORKERS (2)" in text and "TENANTS (1)" in text and "QUEUES  online 0/1000" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  w") and not line.startswith("  worker")}
    assert set(rows) == {"w1", "w2"} and {r[1] for r in rows.values()} == {"healthy"}
    assert "acme" in text and "40000 (10%)" in text and "REJECTIONS (last 5 min)  none" in text


async def test_status_json_is_machine_readable(stack, nats_url):
    proc = await natsched("status", "--nats-url", nats_url, "--json")
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    view = orjson.loads(out)
    assert sorted(w["id"] for w in view["workers"]) == ["w1", "w2"]
    assert view["tenants"][0]["tenant"] == "acme" and view["tenants"][0]["cap"] == 1000


async def test_status_watch_redraws_until_interrupted(stack, nats_url):
    """Both pipes are read to the end: a child blocked writing to a full pipe nobody reads (its
    stderr, on a loaded machine that makes it log) cannot take its Ctrl-C, and hung the test."""
    proc = await natsched("status", "--nats-url", nats_url, "--watch", "0.5")
    err = asyncio.ensure_future(proc.stderr.read())
    out = b""
    while out.count(b"\x1b[H\x1b[2J") < 2:  # two full screens
        chunk = await asyncio.wait_for(proc.stdout.read(4096), 60)
        assert chunk, (await err).decode()
        out += chunk
    proc.send_signal(signal.SIGINT)
    rest, _ = await asyncio.wait_for(asyncio.gather(proc.stdout.read(), proc.wait()), 30)
    out += rest
    assert proc.returncode == 130, (await err).decode()
    assert out.count(b"WORKERS (2)") >= 2


async def test_status_against_no_server_says_so(tmp_path):
    proc = await natsched("status", "--nats-url", "nats://127.0.0.1:1")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and err == b"natsched: error: no NATS at nats://127.0.0.1:1: start `natsched up` or set NATSCHED_NATS_URL\n"


async def test_quota_show_splits_out_credit_and_survives_an_undecodable_usage(bus, nats_url):
    """``used`` counts credit blocks from the moment they are granted: shown apart, so an idle
    cluster's usage is explained. A corrupted usage is a warning, not a traceback."""
    from natsched.admitter.usage import CreditEntry, Usage

    await bus.kv(S.BUCKET_QUOTAS).put(S.tenant_quota_key("acme"), orjson.dumps({"floor": 0.1}))
    usage = Usage(used=700, tenants={"acme": 700}, models={"m": 700}, credits={
        "adm-a": CreditEntry("e1", 1, {("acme", "m"): 400}), "adm-b": CreditEntry("e2", 1, {("acme", "m"): 100})})
    await bus.kv(S.BUCKET_INFLIGHT).put(S.KEY_USAGE, usage.to_json())
    try:
        proc = await natsched("quota", "show", "--json", "--nats-url", nats_url)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        shown = orjson.loads(out)
        assert (shown["used"], shown["credit"]) == (700, 500)
        assert (shown["tenants"]["acme"]["used"], shown["tenants"]["acme"]["credit"]) == (700, 500)

        await bus.kv(S.BUCKET_INFLIGHT).put(S.KEY_USAGE, b"{garbage")
        proc = await natsched("quota", "show", "--nats-url", nats_url)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert "the shared usage cannot be decoded" in err.decode() and "Traceback" not in err.decode()
        assert "in use unknown" in out.decode()
    finally:
        await bus.kv(S.BUCKET_INFLIGHT).delete(S.KEY_USAGE)
        await bus.kv(S.BUCKET_QUOTAS).delete(S.tenant_quota_key("acme"))
