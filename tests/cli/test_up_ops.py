"""``natsched up`` as operators meet it: a drained worker stays stopped; state the data dir
carries from earlier runs (quotas, a route canary) is announced at start (issue 25)."""

import time

from natsched.bus.server import free_port
from tests.cli.test_up import Up


def read_until(up: Up, needle: str, timeout: float = 60) -> str:
    """The first stdout line containing ``needle`` (AssertionError if the process ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = up.proc.stdout.readline()
        if not line:
            break
        up.lines.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no line with {needle!r}: {up.lines[-20:]}")


def test_a_drained_worker_is_not_restarted(tmp_path):
    up = Up(tmp_path, free_port())
    try:
        up.cli("worker", "drain", "w1")
        line = read_until(up, "worker w1 drained")
        assert "not restarted" in line and "by=cli" in line
        # w2 still serves
        assert up.cli("submit", "--tenant", "demo", "--prompt", "still here", "--max-tokens", "3").returncode == 0
        # an unknown model: refused by the admitter naming what is served (it was the router's no_worker)
        nope = up.cli("submit", "--tenant", "demo", "--model", "nope", "--prompt", "x", check=False)
        assert nope.returncode == 2 and "unknown_model" in nope.stderr and "served: default" in nope.stderr, \
            (nope.stdout, nope.stderr)
        assert "no_worker" not in nope.stderr
    finally:
        assert up.stop() == 0
    assert not any("worker w1 exited with code" in l for l in up.lines), up.lines


def test_up_announces_quotas_and_a_canary_left_in_the_data_dir(tmp_path):
    port = free_port()
    first = Up(tmp_path, port)
    try:
        assert not any(l.startswith("note:") for l in first.lines)  # a fresh data dir: nothing to say
        first.cli("quota", "set", "--total", "4242", "--set", "admission.aging_s=3")
        first.cli("route", "set", "--policy", "natsched", "--canary", "least_loaded", "--canary-share", "0.1")
    finally:
        assert first.stop() == 0
    second = Up(tmp_path, port)
    try:
        notes = [l for l in second.lines if l.startswith("note:")]
        assert any("quotas set earlier apply: total 4242" in l for l in notes), notes
        assert any("settings set live earlier apply: admission.aging_s=3" in l for l in notes), notes
        assert any("a route canary is live: policy natsched; canary least_loaded on 10% of requests" in l
                   for l in notes), notes
    finally:
        assert second.stop() == 0


def test_up_set_reaches_every_admitter_at_start(tmp_path):
    import subprocess
    import sys

    from tests.factories.core import read_until_up

    # default_total applies while the quotas bucket names no total: the admitter's ready line says it
    proc = subprocess.Popen([sys.executable, "-m", "natsched", "up", "--workers", "1", "--port", str(free_port()),
                             "--data-dir", str(tmp_path / "data"), "--time-scale", "0.05",
                             "--set", "admission.default_total=4321", "--set", "scale.out_wait_s=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = read_until_up(proc, 60)
        admitters = [l for l in lines if l.startswith("ready: admitter")]
        assert admitters and all("total=4321" in l for l in admitters), lines
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
