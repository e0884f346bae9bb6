"""The command line as a person meets it: real ``natsched`` processes, their exact output.

``--version``; one line (and exit 1) when no server answers; a closed pipe ends a command
quietly; values are written for people (no ``None``, no dicts) unless ``--json`` asks for JSON;
``quota set`` reports the fields it changed, each as ``old -> new``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import orjson

from natsched.bus.server import free_port
from natsched.wire import subjects as S

ROOT = Path(__file__).resolve().parents[2]
PY = [sys.executable, "-m", "natsched"]


async def natsched(*args: str, stdout=asyncio.subprocess.PIPE) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*PY, *args, cwd=ROOT, stdout=stdout, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, (out or b"").decode(), err.decode()


def test_version_names_the_installed_package():
    out = subprocess.run([*PY, "--version"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"natsched {version('natsched')}\n", "")


async def test_client_commands_without_a_server_print_one_line():
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    commands = [("submit", "--tenant", "t", "--prompt", "x"), ("quota", "show"), ("route", "show"), ("status",),
                ("audit", "--since", "1h"), ("jobs", "list"), ("worker", "drain", "w1"),
                ("gateway", "--insecure-open", "--port", str(free_port()))]
    runs = await asyncio.gather(*(natsched(*cmd, "--nats-url", url) for cmd in commands))
    want = f"natsched: error: no NATS at {url}: start `natsched up` or set NATSCHED_NATS_URL\n"
    for cmd, (code, out, err) in zip(commands, runs):
        assert (code, out, err) == (1, "", want), cmd


async def test_a_closed_pipe_ends_the_command_quietly(bus, nats_url):
    """``natsched audit ... | head -1``: the reader is gone before natsched writes; no traceback."""
    for cmd in (["audit", "--since", "1h", "--nats-url", nats_url], ["--version"], ["--help"]):
        read, write = os.pipe()
        os.close(read)  # no reader left: every write to the pipe fails with EPIPE
        try:
            code, _, err = await natsched(*cmd, stdout=write)
        finally:
            os.close(write)
        assert err == "" and code in (0, 1), (cmd, code, err)


async def test_quota_show_writes_unset_values_as_words(bus, nats_url):
    await bus.kv(S.BUCKET_QUOTAS).put(S.tenant_quota_key("acme"), orjson.dumps({"floor": 0.1}))
    code, out, err = await natsched("quota", "show", "--nats-url", nats_url)
    assert code == 0, err
    assert "None" not in out and "{" not in out and "[" not in out, out
    assert "hard cap none" in out and "dynamic off" in out
    acme = next(line.split() for line in out.splitlines() if line.startswith("acme"))
    assert acme == ["acme", "0.10", "1.00", "-", "0", "0"]
    code, out, _ = await natsched("quota", "show", "--json", "--nats-url", nats_url)
    view = orjson.loads(out)
    assert code == 0 and view["hard_cap"] is None and view["tenants"]["acme"]["cap"] is None


async def test_quota_set_reports_each_change_old_to_new(bus, nats_url):
    code, out, err = await natsched("quota", "set", "--total", "123456", "--tenant", "acme", "--floor", "0.25",
                                    "--nats-url", nats_url)
    assert code == 0, err
    assert out.splitlines() == ["total: 400000 -> 123456", "tenant acme: unset -> floor 0.25, weight 1, cap none"]
    code, out, _ = await natsched("quota", "set", "--tenant", "acme", "--cap", "5000", "--hard-cap", "900000",
                                  "--nats-url", nats_url)
    assert (code, out.splitlines()) == (0, ["hard_cap: none -> 900000", "tenant acme cap: none -> 5000"])
    code, out, _ = await natsched("quota", "set", "--total", "123456", "--nats-url", nats_url)
    assert (code, out) == (0, "quotas unchanged\n")


async def test_route_set_and_show_speak_plainly_and_json_on_request(bus, nats_url):
    code, out, err = await natsched("route", "show", "--nats-url", nats_url)
    assert (code, out) == (0, "routing config not set (routers use their --policy)\n"), err
    code, out, err = await natsched("route", "set", "--policy", "least_loaded", "--canary", "natsched",
                                    "--canary-share", "0.1", "--nats-url", nats_url)
    assert (code, out) == (0, "routing config set: policy least_loaded; canary natsched on 10% of requests\n"), err
    code, out, _ = await natsched("route", "show", "--json", "--nats-url", nats_url)
    assert orjson.loads(out) == {"policy": "least_loaded", "weights": {}, "canary": "natsched", "canary_share": 0.1}


async def test_route_set_takes_learning_and_health_settings_and_refuses_bad_ones(bus, nats_url):
    code, out, err = await natsched("route", "set", "--policy", "natsched", "--learn", '{"tau_s": 20}',
                                    "--health", '{"slow_factor": 3}', "--json", "--nats-url", nats_url)
    assert code == 0, err
    assert orjson.loads(out)["learn"] == {"tau_s": 20} and orjson.loads(out)["health"] == {"slow_factor": 3}
    code, _, err = await natsched("route", "set", "--policy", "natsched", "--learn", '{"tau": 20}',
                                  "--nats-url", nats_url)
    assert code != 0 and "unknown weights ['tau']" in err
    code, out, _ = await natsched("route", "show", "--json", "--nats-url", nats_url)
    assert orjson.loads(out)["learn"] == {"tau_s": 20}  # the refused one was never written
