"""`natsched up` as a user runs it: a real process tree, the CLI against it, a clean stop."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from natsched.bus.server import free_port
from tests.factories.core import read_until_up

PY = [sys.executable, "-m", "natsched"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


class Up:
    def __init__(self, tmp_path, port):
        self.port = port
        self.url = f"nats://127.0.0.1:{port}"
        self.data = tmp_path / "data"
        self.proc = subprocess.Popen(
            [*PY, "up", "--workers", "2", "--port", str(port), "--data-dir", str(self.data), "--time-scale", "0.05"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self.lines = read_until_up(self.proc, 30)

    @property
    def pids(self) -> list[int]:
        return [int(m.group(1)) for line in self.lines if (m := re.search(r"\(pid (\d+)\)", line))]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = os.environ | {"NATSCHED_NATS_URL": self.url}
        out = subprocess.run([*PY, *args], env=env, capture_output=True, text=True, timeout=60)
        if check:
            assert out.returncode == 0, out.stderr
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        self.lines += self.proc.stdout.readlines()
        return code


@pytest.fixture
def up(tmp_path):
    u = Up(tmp_path, free_port())
    try:
        yield u
    finally:
        if u.proc.poll() is None:
            u.proc.kill()


def test_up_serves_submit_and_stops_cleanly(up, tmp_path):
    assert [l.split()[1] for l in up.lines if l.startswith("ready:")] == [
        "nats-server", "admitter", "router", "offline", "worker", "worker"]
    pids = up.pids
    assert len(pids) == 5 and all(_alive(p) for p in pids)

    result = json.loads(up.cli("submit", "--tenant", "demo", "--prompt", "hello there", "--max-tokens", "4",
                               "--json").stdout)
    assert result["status"] == "completed" and result["output_tokens"] == 4 and result["worker"] in ("w1", "w2")
    streamed = up.cli("submit", "--tenant", "demo", "--prompt", "again", "--max-tokens", "3", "--stream").stdout
    assert streamed.split() == ["tok0", "tok1", "tok2"]

    up.cli("quota", "set", "--total", "123456")
    assert json.loads(up.cli("quota", "show", "--json").stdout)["total"] == 123456
    up.cli("quota", "set", "--tenant", "acme", "--floor", "0.4", "--weight", "2", "--cap", "50000")
    shown = json.loads(up.cli("quota", "show", "--json").stdout)
    assert shown["tenants"]["acme"] | {"used": 0} == {"floor": 0.4, "weight": 2.0, "cap": 50000, "used": 0, "credit": 0}
    refused = up.cli("quota", "set", "--tenant", "other", "--floor", "0.7", check=False)
    assert refused.returncode == 1 and "refused" in refused.stderr
    assert "other" not in json.loads(up.cli("quota", "show", "--json").stdout)["tenants"]
    up.cli("route", "set", "--policy", "least_loaded")
    assert json.loads(up.cli("route", "show", "--json").stdout)["policy"] == "least_loaded"
    assert up.cli("route", "show").stdout == "policy least_loaded; no canary\n"
    assert "unknown routing policy" in up.cli("route", "set", "--policy", "nope", check=False).stderr
    rejected = up.cli("submit", "--tenant", "demo", "--prompt", "x", "--max-tokens", "0", check=False)
    assert rejected.returncode == 2 and "invalid_max_tokens" in rejected.stderr

    assert up.stop() == 0
    assert "natsched stopped" in up.lines[-1]
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a component outlived natsched up"
    assert (up.data / "jetstream").is_dir()


def test_data_dir_survives_a_restart(tmp_path):
    port = free_port()
    first = Up(tmp_path, port)
    try:
        first.cli("quota", "set", "--total", "4242")
    finally:
        assert first.stop() == 0
    second = Up(tmp_path, port)
    try:
        assert json.loads(second.cli("quota", "show", "--json").stdout)["total"] == 4242
    finally:
        assert second.stop() == 0


def test_port_in_use_is_a_clear_error(up, tmp_path):
    out = subprocess.run([*PY, "up", "--port", str(up.port), "--data-dir", str(tmp_path / "other")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and f"port {up.port}" in out.stderr and "--port" in out.stderr


def test_submit_without_a_server_says_so(tmp_path):
    out = subprocess.run([*PY, "submit", "--tenant", "t", "--prompt", "x", "--nats-url",
                          f"nats://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and out.stderr.startswith("natsched: error: no NATS at ")


def test_every_command_has_help():
    for cmd in (["--help"], ["up", "--help"], ["submit", "--help"], ["worker", "--help"], ["quota", "set", "--help"],
                ["route", "set", "--help"], ["admitter", "--help"], ["router", "--help"]):
        out = subprocess.run([*PY, *cmd], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "usage: natsched" in out.stdout


def test_up_hands_its_model_and_vllm_flags_to_every_worker():
    from natsched.cli.app import build_parser
    from natsched.cli.up import up_settings, vllm_settings
    from natsched.hosting.supervisor import Supervisor

    args = build_parser().parse_args(["up", "--workers", "2", "--engine", "vllm", "--model", "tiny",
                                      "--model-path", "models/tiny", "--max-model-len", "512", "--enforce-eager",
                                      "--dtype", "float32"])
    workers = [c.args for c in Supervisor(up_settings(args)).plan("nats://127.0.0.1:4222") if c.name.startswith("worker")]
    assert len(workers) == 2
    for cmd in workers:
        assert cmd[cmd.index("--model-path") + 1] == "models/tiny" and cmd[cmd.index("--max-model-len") + 1] == "512"
        assert cmd[cmd.index("--model") + 1] == "tiny" and "--enforce-eager" in cmd and "vllm" in cmd
        assert cmd[cmd.index("--dtype") + 1] == "float32"
        assert vllm_settings(build_parser().parse_args(cmd[cmd.index("worker"):])).dtype == "float32"
    bad = build_parser().parse_args(["up", "--workers", "2", "--kv-events-port", "5557"])
    with pytest.raises(ValueError, match="kv-events-port"):
        up_settings(bad)


def test_up_no_credit_reaches_every_admitter_and_credit_is_the_default():
    from natsched.cli.app import build_parser
    from natsched.cli.up import up_settings
    from natsched.hosting.supervisor import Supervisor

    def admitters(*flags):
        args = build_parser().parse_args(["up", "--admitters", "2", *flags])
        return [c.args for c in Supervisor(up_settings(args)).plan("nats://127.0.0.1:4222")
                if c.name.startswith("admitter")]

    assert [("--no-credit" in cmd) for cmd in admitters("--no-credit")] == [True, True]
    assert [("--no-credit" in cmd) for cmd in admitters()] == [False, False]
    parsed = build_parser().parse_args(admitters("--no-credit")[0][admitters("--no-credit")[0].index("admitter"):])
    assert parsed.no_credit is True  # the flag the supervisor passes is one the admitter takes


def test_up_metrics_port_numbers_every_service_from_it_and_refuses_ports_past_the_range():
    from natsched.cli.app import build_parser
    from natsched.cli.up import up_settings
    from natsched.hosting.supervisor import Supervisor

    args = build_parser().parse_args(["up", "--admitters", "2", "--workers", "2", "--gateway", "8100",
                                      "--metrics-port", "9100"])
    sup = Supervisor(up_settings(args))
    kids = sup.plan("nats://127.0.0.1:4222")
    ports = {c.name: int(c.args[c.args.index("--metrics-port") + 1]) for c in kids if "--metrics-port" in c.args}
    assert ports == {"admitter-1": 9100, "admitter-2": 9101, "router": 9102, "worker w1": 9103,
                     "worker w2": 9104, "gateway": 9105}  # the offline runner serves none
    assert sup.metrics_ports == ports
    for kid in kids:  # each flag is one its own command takes
        cmd = kid.args[kid.args.index("--log-level") + 2:]
        if kid.name == "gateway":
            continue  # natsched gateway has its own parser (natsched.cli.gateway), tested with the gateway
        assert build_parser().parse_args(cmd).metrics_port == ports.get(kid.name)
    assert all("--metrics-port" not in c.args for c in Supervisor(up_settings(
        build_parser().parse_args(["up"]))).plan("nats://127.0.0.1:4222"))  # none unless asked
    too_high = build_parser().parse_args(["up", "--workers", "2", "--metrics-port", "65534"])
    with pytest.raises(ValueError, match="4 services need ports 65534..65537"):
        up_settings(too_high)
