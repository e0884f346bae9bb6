"""The supervisor's start-up: a child that exits before it is ready is started again.

The children here are small Python processes that print the READY line (or exit) the way the
services do: what is tested is the supervisor's handling of real processes, not a service.
"""

from __future__ import annotations

import sys
import time

import pytest

from natsched.bus.errors import ServerError
from natsched.hosting.runtime import READY_PREFIX
from natsched.hosting.supervisor import Child, Supervisor, UpSettings


def flaky_child(tmp_path, failures: int) -> Child:
    """Exits with code 3 on its first ``failures`` starts, then says it is ready and stays up."""
    count = tmp_path / "starts"
    script = (
        "import pathlib, sys, time\n"
        f"p = pathlib.Path({str(count)!r})\n"
        "n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1))\n"
        f"if n < {failures}:\n"
        "    sys.exit(3)\n"
        f"print({READY_PREFIX!r} + 'fine', flush=True)\n"
        "time.sleep(60)\n"
    )
    return Child("flaky", [sys.executable, "-c", script])


def start(sup: Supervisor, child: Child, timeout: float) -> list[str]:
    said: list[str] = []
    sup._spawn(child)
    try:
        sup._await_ready(child, time.monotonic() + timeout, lambda text, **_: said.append(text))
    finally:
        sup.children = [child]
    return said


def test_a_child_that_exits_while_starting_is_started_again(tmp_path):
    sup = Supervisor(UpSettings())
    child = flaky_child(tmp_path, failures=2)
    try:
        said = start(sup, child, timeout=20)
        assert child.ready.is_set() and child.detail == "fine"
        assert said == ["flaky exited with code 3 while starting; starting it again"] * 2
        assert (tmp_path / "starts").read_text() == "3"
    finally:
        sup.stop(timeout=2, quiet=True)


def test_a_child_that_never_gets_ready_fails_the_start_with_its_exit_code(tmp_path):
    sup = Supervisor(UpSettings(ready_timeout_s=3))
    child = flaky_child(tmp_path, failures=1000)
    try:
        with pytest.raises(ServerError, match=r"flaky was not ready within 3s \(exited \d+ times, last with code 3\)"):
            start(sup, child, timeout=3)
        assert int((tmp_path / "starts").read_text()) >= 2  # tried again meanwhile
    finally:
        sup.stop(timeout=2, quiet=True)


# --- the embedded nats-server is supervised too ---------------------------------------------------

def test_up_restarts_a_sigkilled_nats_server_on_its_data_dir_and_serves_again(tmp_path):
    """``natsched up`` as a user runs it: SIGKILL its nats-server; the supervisor starts it again on
    the same port and data dir (its streams and quotas come back) and the services go on."""
    import json
    import os
    import re
    import signal

    from tests.cli.test_up import Up
    from natsched.bus.server import free_port

    up = Up(tmp_path, free_port())
    try:
        up.cli("quota", "set", "--total", "123456")
        first = json.loads(up.cli("submit", "--tenant", "demo", "--prompt", "before", "--max-tokens", "3",
                                  "--json").stdout)
        assert first["status"] == "completed"
        server = next(int(m.group(1)) for line in up.lines
                      if (m := re.match(r"ready: nats-server \S+ \(pid (\d+),", line)))
        os.kill(server, signal.SIGKILL)
        said = []
        for line in up.proc.stdout:  # bounded by the supervisor: it says so, or the test times out
            said.append(line)
            if line.startswith("ready: nats-server") and "restart 1" in line:
                break
        assert any("nats-server exited with code -9" in line for line in said), said
        assert json.loads(up.cli("quota", "show", "--json").stdout)["total"] == 123456  # same data dir
        after = json.loads(up.cli("submit", "--tenant", "demo", "--prompt", "after", "--max-tokens", "3",
                                  "--json").stdout)
        assert after["status"] == "completed"
        assert up.stop() == 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
