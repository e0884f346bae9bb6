"""`natsched up --partitions 2` as a user runs it: one admitter process per partition (each a
coordinator candidate), requests of tenants in both partitions completed, and a later plain
`up` on the same data dir stores requests unpartitioned again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from natsched.admitter.budget import partition_of
from natsched.bus.server import free_port
from tests.factories.core import read_until_up

PY = [sys.executable, "-m", "natsched"]


def test_up_plans_one_admitter_per_partition_and_refuses_what_is_not_wired():
    from natsched.cli.app import build_parser
    from natsched.cli.up import up_settings
    from natsched.hosting.supervisor import Supervisor

    args = build_parser().parse_args(["up", "--partitions", "2", "--admitters", "2", "--metrics-port", "9200"])
    kids = Supervisor(up_settings(args)).plan("nats://127.0.0.1:4222")
    admitters = {c.name: c.args for c in kids if c.name.startswith("admitter")}
    assert sorted(admitters) == ["admitter-p0-1", "admitter-p0-2", "admitter-p1-1", "admitter-p1-2"]
    for name, cmd in admitters.items():
        parsed = build_parser().parse_args(cmd[cmd.index("--log-level") + 2:])
        assert (parsed.partition, parsed.partitions) == (int(name[len("admitter-p")]), 2)
    offline = next(c.args for c in kids if c.name == "offline")  # one runner, through the partitions
    assert build_parser().parse_args(offline[offline.index("--log-level") + 2:]).partitions == 2
    plain = Supervisor(up_settings(build_parser().parse_args(["up"]))).plan("nats://127.0.0.1:4222")
    assert [c.name for c in plain if c.name.startswith("admitter")] == ["admitter"]
    assert all("--partitions" not in c.args for c in plain)  # P = 1: the command lines of before
    with pytest.raises(ValueError, match="--partitions must be >= 1"):
        up_settings(build_parser().parse_args(["up", "--partitions", "0"]))
    with pytest.raises(ValueError, match="inline-routing"):
        up_settings(build_parser().parse_args(["up", "--partitions", "2", "--inline-routing"]))


def wait_job(env: dict, job_id: str, limit_s: float = 60.0) -> str:
    """The job's status once final (``natsched jobs show``, polled; the bound is not a timing claim)."""
    import time

    deadline, status = time.monotonic() + limit_s, None
    while time.monotonic() < deadline:
        out = subprocess.run([*PY, "jobs", "show", job_id, "--json"], env=env, capture_output=True, text=True,
                             timeout=60)
        status = json.loads(out.stdout)["status"] if out.returncode == 0 else None
        if status in ("completed", "failed"):
            return status
        time.sleep(0.5)
    return str(status)


def _up(port: int, data, *flags: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([*PY, "up", "--workers", "2", "--port", str(port), "--data-dir", str(data),
                             "--time-scale", "0.05", *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    return proc, read_until_up(proc, 60)


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def test_partitioned_up_completes_requests_of_both_partitions(tmp_path):
    port, data = free_port(), tmp_path / "data"
    env = os.environ | {"NATSCHED_NATS_URL": f"nats://127.0.0.1:{port}"}

    def submit(tenant: str, *flags: str) -> dict:
        out = subprocess.run([*PY, "submit", "--tenant", tenant, "--prompt", "hello", "--max-tokens", "3", "--json",
                              *flags], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    tenants = ["globex", "acme"]
    assert [partition_of(t, 2) for t in tenants] == [0, 1]
    proc, lines = _up(port, data, "--partitions", "2")
    try:
        ready = [line.split()[1] for line in lines if line.startswith("ready:")]
        assert ready[:3] == ["nats-server", "admitter-p0", "admitter-p1"] and "offline" in ready
        for t in tenants:
            assert submit(t)["status"] == "completed"
        for t in tenants:  # degraded work runs too: the offline runner admits it through t's partition
            job = submit(t, "--class", "offline")
            assert job["status"] == "degraded", job
            assert wait_job(env, job["job_id"]) == "completed"
    finally:
        assert _stop(proc) == 0
    proc, _ = _up(port, data)  # the same data dir, unpartitioned: the transform is undone
    try:
        assert submit("acme")["status"] == "completed"
    finally:
        assert _stop(proc) == 0


# --- under natsched auth init --partitions / --router-pools (issue 27) -----------------------------
POOLS = "a=m1;b=*"


def _auth_dir(root, partitions: int = 2):
    from natsched.ops.auth import AuthSettings, init

    init(AuthSettings(out=root / "auth", tenants=["globex", "acme"], workers=["w1"], partitions=partitions,
                      router_pools=POOLS))
    return root / "auth"


def test_up_with_auth_dir_runs_each_partition_and_pool_on_its_own_user(tmp_path):
    from natsched.hosting.supervisor import Supervisor, UpSettings
    from natsched.ops.auth import MissingCredentialsError

    auth = _auth_dir(tmp_path)
    sup = Supervisor(UpSettings(workers=1, partitions=2, router_pools=POOLS, auth_dir=auth))
    sup._open_auth()
    kids = {c.name: c for c in sup.plan("nats://127.0.0.1:4222")}
    assert {n: c.user for n, c in kids.items()} == {
        "admitter-p0": "admitter-p0", "admitter-p1": "admitter-p1", "router-a": "router-a", "router-b": "router-b",
        "offline": "offline", "worker w1": "worker-w1"}
    for kid in kids.values():
        assert kid.args[kid.args.index("--credentials") + 1] == str(auth / "creds" / f"{kid.user}.json")
        assert "--pools" not in kid.args  # the admin stored the map: the roles may only read it
    # a P above the one auth init was given: refused before anything starts, saying how to fix it
    with pytest.raises(MissingCredentialsError, match=r"admitter-p2 \(for admitter-p2\).*--partitions 3"):
        Supervisor(UpSettings(workers=1, partitions=3, router_pools=POOLS, auth_dir=auth))._open_auth()
    with pytest.raises(MissingCredentialsError, match=r"router-c .*--router-pools 'a=m1;c=\*'"):
        Supervisor(UpSettings(workers=1, partitions=2, router_pools="a=m1;c=*", auth_dir=auth))._open_auth()


def test_partitioned_up_with_router_pools_on_auth_init_credentials_completes_both_partitions(tmp_path):
    auth = _auth_dir(tmp_path)
    creds = auth / "creds"
    port, stderr_path = free_port(), tmp_path / "up.stderr"
    env = os.environ | {"NATSCHED_NATS_URL": f"nats://127.0.0.1:{port}"}

    def cli(*args: str, user: str) -> subprocess.CompletedProcess:
        return subprocess.run([*PY, *args, "--credentials", str(creds / f"{user}.json")], env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    def submit(tenant: str, *flags: str) -> dict:
        out = cli("submit", "--tenant", tenant, "--prompt", "hello", "--max-tokens", "3", "--json", *flags,
                  user=f"producer-{tenant}")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([*PY, "up", "--workers", "1", "--port", str(port), "--data-dir", str(tmp_path / "data"),
                                 "--time-scale", "0.05", "--partitions", "2", "--router-pools", POOLS,
                                 "--auth-dir", str(auth)], stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        lines = read_until_up(proc, 180, "natsched up --partitions --router-pools --auth-dir",
                              lambda: stderr_path.read_text(errors="replace")[-2000:])
        ready = [line.split()[1] for line in lines if line.startswith("ready:")]
        assert ready == ["nats-server", "admitter-p0", "admitter-p1", "router-a", "router-b", "offline", "worker"]
        assert f"auth {auth / 'nats-auth.conf'}" in lines[0]
        for tenant in ("globex", "acme"):  # partitions 0 and 1; model default: pool b's router
            result = submit(tenant)
            assert (result["status"], result["output_tokens"], result["worker"]) == ("completed", 3, "w1")
        for tenant in ("globex", "acme"):  # degraded work: the runner admits it through the tenant's partition
            job = submit(tenant, "--class", "offline")
            assert job["status"] == "degraded", job
            assert wait_job(env | {"NATSCHED_CREDENTIALS": str(creds / "admin.json")}, job["job_id"]) == "completed"
        status = cli("status", "--json", user="admin")
        assert status.returncode == 0, status.stderr
        assert [p["partition"] for p in json.loads(status.stdout)["partitions"]] == [0, 1]  # the admin reads them all
    finally:
        assert _stop(proc) == 0
    refused = [line for line in stderr_path.read_text(errors="replace").splitlines()
               if "permissions violation" in line.lower()]
    assert not refused, f"a component was refused a permission: {refused[:3]}"
