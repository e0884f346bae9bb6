"""``natsched up --router-pools``: one router (or --routers replicas) per pool, every admitter and
router handed the map; and a real process tree routing through a pool."""

import json
import os
import subprocess
import sys

import pytest

from natsched.bus.server import free_port
from natsched.cli.app import build_parser
from natsched.cli.up import up_settings
from natsched.hosting.supervisor import Supervisor
from tests.factories.core import read_until_up

PY = [sys.executable, "-m", "natsched"]
SPEC = "a=ma,mb;b=mc,*"


def _plan(*flags):
    return Supervisor(up_settings(build_parser().parse_args(["up", *flags]))).plan("nats://127.0.0.1:4222")


def test_up_runs_routers_per_pool_and_hands_every_admitter_and_router_the_map():
    kids = _plan("--router-pools", SPEC, "--routers", "2", "--admitters", "2")
    routers = {c.name: c.args for c in kids if c.name.startswith("router")}
    assert sorted(routers) == ["router-a-1", "router-a-2", "router-b-1", "router-b-2"]
    for name, cmd in routers.items():
        assert cmd[cmd.index("--pool") + 1] == name.split("-")[1] and cmd[cmd.index("--pools") + 1] == SPEC
        parsed = build_parser().parse_args(cmd[cmd.index("router"):])  # flags the router command takes
        assert parsed.pool == name.split("-")[1]
    admitters = [c.args for c in kids if c.name.startswith("admitter")]
    assert len(admitters) == 2 and all(cmd[cmd.index("--pools") + 1] == SPEC for cmd in admitters)
    plain = [c for c in _plan() if c.name.startswith("router")]
    assert [c.name for c in plain] == ["router"] and "--pool" not in plain[0].args  # no map: as before
    assert not any("--pools" in c.args for c in _plan())


@pytest.mark.parametrize("flags, says", [
    (["--router-pools", "a.b=m"], "subject token"),
    (["--router-pools", "a=m;b=m"], "two pools"),
    (["--router-pools", "all=m"], "default pool"),
    (["--router-pools", "a=m", "--inline-routing"], "inline"),
])
def test_up_refuses_a_pool_map_it_cannot_run(flags, says):
    with pytest.raises(ValueError, match=says):
        up_settings(build_parser().parse_args(["up", *flags]))


def test_router_refuses_a_bad_pools_spec_before_connecting():
    out = subprocess.run([*PY, "router", "--nats-url", "nats://127.0.0.1:1", "--pool", "a", "--pools", "a=m;b=m"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--pools refused" in out.stderr and "two pools" in out.stderr


def test_up_with_a_router_pool_routes_through_it(tmp_path):
    port = free_port()
    proc = subprocess.Popen([*PY, "up", "--workers", "1", "--port", str(port), "--data-dir", str(tmp_path / "d"),
                             "--time-scale", "0.05", "--router-pools", "a=default"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = read_until_up(proc, 60)
        assert [line.split()[1] for line in lines if line.startswith("ready:")] == [
            "nats-server", "admitter", "router-a", "offline", "worker"]
        env = os.environ | {"NATSCHED_NATS_URL": f"nats://127.0.0.1:{port}"}
        out = subprocess.run([*PY, "submit", "--tenant", "demo", "--prompt", "hello", "--max-tokens", "3", "--json"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["status"] == "completed"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
