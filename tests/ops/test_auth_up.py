"""``natsched up --auth-dir``: the embedded server runs ``auth init``'s config, every child its own role.

A real process tree as a user runs it: a request submitted with a producer's credentials completes
through the authenticated stack (and through the gateway, and as a batch of offline work), another
tenant's producer cannot read its reply, no child was ever refused a permission, and a directory
that lacks a credential some child needs is refused before anything starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import orjson
import pytest

from natsched.wire import subjects as S
from natsched.client.batch import BatchClient
from natsched.bus.connection import Bus
from natsched.bus.server import free_port, port_in_use
from natsched.ops.auth import AuthSettings, init
from tests.factories.core import read_until_up, wait_for
from tests.ops.test_auth_permissions import Probe

PY = [sys.executable, "-m", "natsched"]
KEY_A = "sk-tenant-a-0123456789"


def auth_dir(root: Path, workers: list[str]) -> Path:
    init(AuthSettings(out=root / "auth", tenants=["A", "B"], workers=workers, gateway_tenants=["A"]))
    return root / "auth"


def keys_file(root: Path, tenant: str) -> Path:
    path = root / f"keys-{tenant}.json"
    path.write_bytes(orjson.dumps({KEY_A: {"tenant": tenant, "class": "online"}}))
    return path


class AuthUp:
    """``natsched up --auth-dir`` with one worker and the gateway; its stderr kept in a file."""

    def __init__(self, root: Path) -> None:
        self.auth = auth_dir(root, ["w1"])
        self.port, self.gateway_port = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.stderr_path = root / "up.stderr"
        self.stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            [*PY, "up", "--auth-dir", str(self.auth), "--workers", "1", "--port", str(self.port), "--data-dir",
             str(root / "data"), "--time-scale", "0.05", "--gateway", str(self.gateway_port), "--gateway-keys",
             str(keys_file(root, "A"))],
            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.lines = read_until_up(self.proc, 60, "natsched up --auth-dir", self.errors)

    def creds(self, user: str) -> Path:
        return self.auth / "creds" / f"{user}.json"

    def errors(self) -> str:
        return self.stderr_path.read_text(errors="replace")  # written by the children, not by us

    async def cli(self, *args: str) -> subprocess.CompletedProcess:
        env = os.environ | {"NATSCHED_NATS_URL": self.url}
        out = await asyncio.to_thread(subprocess.run, [*PY, *args], env=env, capture_output=True, text=True,
                                      timeout=120)
        assert out.returncode == 0, out.stderr
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        self.lines += self.proc.stdout.readlines()
        self.stderr.close()
        return code


@pytest.fixture
def authup(tmp_path):
    up = AuthUp(tmp_path)
    try:
        yield up
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()
        up.stderr.close()


async def test_up_with_auth_dir_runs_every_child_on_its_own_credentials(authup, tmp_path):
    up = authup
    assert [line.split()[1] for line in up.lines if line.startswith("ready:")] == [
        "nats-server", "admitter", "router", "offline", "worker", "gateway"]
    assert f"auth {up.auth / 'nats-auth.conf'}" in up.lines[0]
    assert "--credentials" in up.lines[-1]  # the hint says how to submit

    # another tenant's producer subscribes to the reply subject A's request will use: refused
    other = await Probe.connect(up.url, up.creds("producer-B"))
    try:
        reply_subject = S.tenant_reply("A", "auth-up-1")
        eavesdrop = await other.nc.subscribe(reply_subject)
        await other._settle()
        assert other._refused("subscription", reply_subject)
        assert await other.subscribe(S.replies_of("A"))

        # A's request, submitted with A's producer credentials, completes through the stack
        out = await up.cli("submit", "--credentials", str(up.creds("producer-A")), "--tenant", "A", "--id",
                           "auth-up-1", "--prompt", "hello through auth", "--max-tokens", "3", "--json")
        result = json.loads(out.stdout)
        assert (result["status"], result["output_tokens"], result["worker"]) == ("completed", 3, "w1")
        await other.nc.flush()  # every reply was routed before A saw its result: none reached B
        assert eavesdrop.pending_msgs == 0 and eavesdrop.delivered == 0
    finally:
        await other.close()

    # the gateway, on its own role, serves a request for its tenant (once it has heard the worker)
    sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{up.gateway_port}/v1", api_key=KEY_A, max_retries=0,
                             timeout=60)
    try:
        assert await wait_for(lambda: _serves(sdk, "default"), timeout=30)
        reply = await sdk.completions.create(model="default", prompt="hello from the gateway", max_tokens=3)
    finally:
        await sdk.close()
    assert reply.choices[0].text.split() == ["tok0", "tok1", "tok2"]

    # a batch of offline work, submitted with A's batch credentials, run by the offline runner
    lines = tmp_path / "batch.jsonl"
    lines.write_bytes(b"".join(orjson.dumps({"prompt": f"offline job {i} " * 5, "max_tokens": 2}) + b"\n"
                               for i in range(2)))
    batch_creds = str(up.creds("batch-A"))
    submitted = json.loads((await up.cli("batch", "submit", str(lines), "--tenant", "A", "--class", "offline",
                                         "--credentials", batch_creds, "--json")).stdout)
    reader = await Bus.connect(up.url, name="batch-A", credentials=up.creds("batch-A"))
    try:
        client = BatchClient(reader)
        assert await wait_for(lambda: _done(client, submitted["batch"]), timeout=90)
    finally:
        await reader.close()
    rows = [json.loads(r) for r in (await up.cli("batch", "results", submitted["batch"], "--out", "-",
                                                 "--credentials", batch_creds)).stdout.splitlines()]
    assert [(r["status"], r["output"].split()) for r in rows] == [("completed", ["tok0", "tok1"])] * 2

    assert up.stop() == 0
    assert "natsched stopped" in up.lines[-1]
    refused = [line for line in up.errors().splitlines() if "permissions violation" in line.lower()]
    assert not refused, f"a component was refused a permission: {refused[:3]}"


async def _serves(sdk: openai.AsyncOpenAI, model: str) -> bool:
    return model in [m.id for m in (await sdk.models.list()).data]


async def _done(client: BatchClient, batch: str) -> bool:
    return (await client.status(batch)).done


def test_up_refuses_an_auth_dir_that_lacks_a_childs_credentials(tmp_path):
    auth = auth_dir(tmp_path, ["w1"])
    port = free_port()

    def up(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*PY, "up", "--auth-dir", str(auth), "--port", str(port), "--data-dir",
                               str(tmp_path / "data"), *args], capture_output=True, text=True, timeout=60)

    two = up("--workers", "2")
    assert two.returncode == 1 and "worker-w2 (for worker w2)" in two.stderr and "--workers w1,w2" in two.stderr
    keys_b = up("--workers", "1", "--gateway", str(free_port()), "--gateway-keys", str(keys_file(tmp_path, "B")))
    assert keys_b.returncode == 1 and "tenant(s) B" in keys_b.stderr and "--gateway-tenants A,B" in keys_b.stderr
    (auth / "creds" / "offline.json").unlink()
    no_runner = up("--workers", "1")
    assert no_runner.returncode == 1 and "offline (for offline)" in no_runner.stderr
    nowhere = up("--workers", "1", "--auth-dir", str(tmp_path / "nothing"))  # the last --auth-dir wins
    assert nowhere.returncode == 1 and "natsched auth init --out" in nowhere.stderr
    assert not port_in_use("127.0.0.1", port)  # refused before the server started
