"""compose/ cannot run here (no Docker engine), so it is checked the way it can fail: it parses, each
natsched command is one the CLI accepts, each file it mounts or builds from exists, the NATS config
is one nats-server accepts, the scrape targets are the ports the services serve metrics on, and the
dashboard only asks for metrics the services export."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import orjson
import pytest
import yaml

from natsched.bus.server import find_binary
from natsched.gateway.keys import KeyRing
from natsched.cli.app import build_parser
from tests.system.test_metrics_scrape import EXPECTED

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
SPEC = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
SERVICES = SPEC["services"]
ENV = dict(line.split("=", 1) for line in (COMPOSE / ".env.example").read_text().splitlines()
           if line and not line.startswith("#"))
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::?[-?]([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}, with .env.example as the environment."""
    return _VAR.sub(lambda m: ENV.get(m.group(1)) or m.group(2) or "", value)


def natsched_services() -> dict[str, list[str]]:
    return {name: [interpolate(a) for a in svc["command"]] for name, svc in SERVICES.items()
            if isinstance(svc.get("command"), list) and svc["command"][:1] == ["natsched"]}


def test_the_deployment_has_every_part():
    names = set(SERVICES)
    assert {"nats-1", "nats-2", "nats-3", "admitter-1", "admitter-2", "router-1", "router-2", "gateway",
            "prometheus", "grafana"} <= names
    workers = [n for n, cmd in natsched_services().items() if cmd[1] == "worker"]
    assert len(workers) >= 2
    for name in workers:
        svc = SERVICES[name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
        assert any(v.startswith("models:") for v in svc["volumes"]), f"{name} has no model volume"
        assert "--engine" in (cmd := natsched_services()[name]) and cmd[cmd.index("--engine") + 1] == "vllm"
    gpus = [SERVICES[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0] for n in workers]
    assert len(set(gpus)) == len(gpus), "two workers reserve the same GPU"
    assert "models" in SPEC["volumes"]


@pytest.mark.parametrize("service", sorted(natsched_services()))
def test_every_command_is_a_real_natsched_subcommand_with_real_flags(service):
    argv = natsched_services()[service][1:]
    parser = build_parser()
    parser.exit = _raise  # type: ignore[method-assign]
    for action in parser._subparsers._group_actions:  # every sub-parser raises instead of exiting
        for sub in action.choices.values():
            sub.exit = _raise  # type: ignore[method-assign]
    args = parser.parse_args(argv)  # an unknown subcommand or flag raises here
    assert args.command == argv[0]
    assert args.nats_url.startswith("nats://") and "@nats-" in args.nats_url  # through the auth config
    assert args.metrics_port is not None


def _raise(status=0, message=None):
    raise AssertionError(f"natsched refused the command: {message}")


def test_services_connect_as_their_own_user():
    users = {"admitter": "admitter", "router": "router", "worker": "worker", "gateway": "gateway"}
    for name, cmd in natsched_services().items():
        url = cmd[cmd.index("--nats-url") + 1]
        assert url.startswith(f"nats://{users[cmd[1]]}:"), f"{name} connects as the wrong user: {url}"


def test_every_referenced_file_exists():
    for name, svc in SERVICES.items():
        for volume in svc.get("volumes", []):
            source = interpolate(volume).split(":")[0]
            if source.startswith((".", "/")):
                assert (COMPOSE / source).exists(), f"{name} mounts {source}, which is missing"
        build = svc.get("build")
        if build:
            context = COMPOSE / build["context"]
            dockerfile = context / build["dockerfile"]
            assert dockerfile.is_file()
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for source in line.split()[1:-1]:
                        assert (context / source).exists(), f"{dockerfile} copies {source}, which is missing"
    assert (COMPOSE / "nats" / "auth.conf").is_file()  # included by nats.conf


def test_the_nats_config_is_accepted_by_nats_server():
    env = {**{k: v for k, v in ENV.items()}, **SERVICES["nats-1"]["environment"]}
    env = {k: interpolate(str(v)) for k, v in env.items()}
    out = subprocess.run([find_binary(), "-t", "-c", str(COMPOSE / "nats" / "nats.conf")], env=env,
                         capture_output=True, text=True, cwd=COMPOSE / "nats", timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "is valid" in out.stdout + out.stderr
    conf = (COMPOSE / "nats" / "nats.conf").read_text()
    assert "jetstream" in conf and all(f"nats-{i}:6222" in conf for i in (1, 2, 3))


def test_nats_config_refuses_to_start_without_the_passwords():
    out = subprocess.run([find_binary(), "-t", "-c", str(COMPOSE / "nats" / "nats.conf")],
                         env={"NATS_NAME": "n1"}, capture_output=True, text=True, cwd=COMPOSE / "nats", timeout=30)
    assert out.returncode != 0  # an unset password variable is an error, not an empty password


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    config = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = {f"{name}:{cmd[cmd.index('--metrics-port') + 1]}" for name, cmd in natsched_services().items()}
    assert targets == expected


def test_grafana_dashboard_asks_only_for_exported_metrics():
    dashboard = orjson.loads((COMPOSE / "grafana" / "dashboards" / "natsched.json").read_bytes())
    known = {name for family in EXPECTED.values() for name in family}
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        for metric in re.findall(r"natsched_[a-z_]+", expr):
            base = re.sub(r"_(bucket|count|sum|total)$", "", metric)
            assert base in known, f"dashboard asks for {metric}, which no service exports"
    for wanted in ("natsched_worker_ttft_seconds", "natsched_worker_tpot_seconds",
                   "natsched_admission_queue_wait_seconds", "natsched_admission_decision_latency_seconds",
                   "natsched_routing_decision_latency_seconds"):
        assert any(wanted in e for e in exprs), f"no panel shows {wanted}"
    provider = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "dashboards" / "natsched.yml").read_text())
    mounted = [v for v in SERVICES["grafana"]["volumes"] if v.startswith("./grafana/dashboards:")]
    assert provider["providers"][0]["options"]["path"] == mounted[0].split(":")[1]


def test_example_keys_file_is_one_the_gateway_accepts():
    source = interpolate(SERVICES["gateway"]["volumes"][0]).split(":")[0]
    ring = KeyRing.from_file(COMPOSE / source)
    assert len(ring) == 2 and not ring.is_open


def test_the_parser_used_above_knows_the_new_commands():
    parser = build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"gateway", "status", "admitter", "router", "worker"} <= set(choices)
