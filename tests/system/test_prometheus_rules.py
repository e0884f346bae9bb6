"""The alert rules (compose/prometheus/rules.yml) checked by Debian's promtool, unit-tested on
synthetic series, and one of them driven to firing by a real Prometheus scraping a running
``natsched up`` (issue 25). Debian packages: ``prometheus`` (both binaries)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from natsched.bus.server import free_port
from natsched.client.errors import Rejected
from natsched.client.producer import Client, make_request
from tests.factories.core import read_until_up, wait_for

PROM_DIR = Path(__file__).resolve().parents[2] / "compose" / "prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
FIRING = "NatschedRejectionRateHigh"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rules_and_the_config():
    rules = promtool("check", "rules", str(PROM_DIR / "rules.yml"))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 8 rules found" in rules.stdout
    config = promtool("check", "config", str(PROM_DIR / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr
    assert "1 rule files found" in config.stdout


def test_every_alert_fires_on_its_series_and_not_on_healthy_ones():
    out = promtool("test", "rules", str(PROM_DIR / "rules_test.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    cases = yaml.safe_load((PROM_DIR / "rules_test.yml").read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    alerts = {r["alert"] for g in yaml.safe_load((PROM_DIR / "rules.yml").read_text())["groups"] for r in g["rules"]}
    assert tested == alerts  # each rule has a case where it fires


def test_the_rules_ask_only_for_exported_metrics():
    from tests.system.test_metrics_scrape import EXPECTED

    known = {name for family in EXPECTED.values() for name in family}
    for group in yaml.safe_load((PROM_DIR / "rules.yml").read_text())["groups"]:
        for rule in group["rules"]:
            for metric in re.findall(r"natsched_[a-z_0-9]+", rule["expr"]):
                base = re.sub(r"_(bucket|count|sum|total)$", "", metric)
                assert base in known, f"{rule['alert']} asks for {metric}, which no service exports"


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _end(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def natsched_up(tmp_path):
    port, metrics = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "natsched", "up", "--workers", "1", "--port", str(port),
                             "--data-dir", str(tmp_path / "data"), "--metrics-port", str(metrics),
                             "--time-scale", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = read_until_up(proc, 60)
        assert any("ready: admitter" in l and f"metrics :{metrics}" in l for l in lines), lines
        yield f"nats://127.0.0.1:{port}", metrics
    finally:
        _end(proc)


@pytest.fixture
def prometheus(tmp_path, natsched_up):
    """A real Prometheus scraping the admitter every second, evaluating the rejection-rate rule
    (its ``for`` set to 0 so the test needs no ten minutes) every second."""
    _, metrics = natsched_up
    groups = yaml.safe_load((PROM_DIR / "rules.yml").read_text())["groups"]
    rule = next(r for g in groups for r in g["rules"] if r["alert"] == FIRING)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "test", "rules": [
        dict(rule, **{"for": "0s"})]}]}))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "scrape_configs": [{"job_name": "natsched-admitter",
                            "static_configs": [{"targets": [f"127.0.0.1:{metrics}"]}]}]}))
    web = free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{web}"
    try:
        yield url
    finally:
        _end(proc)


def _query(base: str, expr: str) -> list:
    try:
        return _get(f"{base}/api/v1/query?query={urllib.parse.quote(expr)}")["data"]["result"]
    except OSError:
        return []


def _alert_state(base: str, name: str) -> str | None:
    try:
        alerts = _get(f"{base}/api/v1/alerts")["data"]["alerts"]
    except OSError:
        return None
    return next((a["state"] for a in alerts if a["labels"].get("alertname") == name), None)


async def _reject(client: Client) -> None:
    with pytest.raises(Rejected):
        await client.submit(make_request("demo", "x", max_tokens=0))  # invalid_max_tokens


async def test_a_real_prometheus_fires_the_rejection_rate_alert_on_a_running_natsched(natsched_up, prometheus):
    url, _ = natsched_up
    up = 'up{job="natsched-admitter"}'
    assert await wait_for(lambda: any(r["value"][1] == "1" for r in _query(prometheus, up)), timeout=60)
    assert _alert_state(prometheus, FIRING) is None  # nothing rejected yet: quiet
    client = await Client.connect(url)
    try:
        await _reject(client)
        rejects = 'natsched_admission_decisions_total{decision="reject"}'
        assert await wait_for(lambda: _query(prometheus, rejects), timeout=60)  # the series is scraped once
        for _ in range(3):  # ... and grows between two scrapes: rate() sees it
            await _reject(client)
        assert await wait_for(lambda: _alert_state(prometheus, FIRING) == "firing", timeout=60)
    finally:
        await client.close()
