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
