"""Durability chosen, not defaulted: the embedded server's sync setting, and streams sized to the
disk they find (or refused with one line)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from natsched.bus.connection import Bus
from natsched.bus.errors import ProvisionError, ServerError
from natsched.bus.provision import GiB, MIN_TOTAL_BYTES, default_limits, fit_to_disk, retention_targets, total_reserved
from natsched.bus.server import DEFAULT_SYNC, SYNC_ALWAYS, SYNC_INTERVAL, EmbeddedServer, free_port


def jetstream_config(sync: str, tmp_path, config_file=None) -> dict:
    monitor = free_port()
    with EmbeddedServer(port=free_port(), data_dir=tmp_path / sync, extra_args=["-m", str(monitor)], sync=sync,
                        config_file=config_file):
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as r:
            return json.load(r)["jetstream"]["config"]


def test_the_embedded_server_fsyncs_every_write_by_default_and_interval_is_the_servers_own(tmp_path):
    assert DEFAULT_SYNC == SYNC_ALWAYS
    assert jetstream_config(SYNC_ALWAYS, tmp_path).get("sync_always") is True
    assert not jetstream_config(SYNC_INTERVAL, tmp_path).get("sync_always")


def test_sync_always_keeps_the_given_config(tmp_path):
    """The generated config includes the given one (auth init's): its settings still apply."""
    conf = tmp_path / "given.conf"
    conf.write_text("max_payload: 123456\n")
    monitor = free_port()
    with EmbeddedServer(port=free_port(), data_dir=tmp_path / "d", extra_args=["-m", str(monitor)],
                        config_file=conf):
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as r:
            varz = json.load(r)
    assert varz["max_payload"] == 123456 and varz["jetstream"]["config"]["sync_always"] is True


def test_an_unknown_sync_setting_is_refused(tmp_path):
    with pytest.raises(ServerError, match="sync must be one of always, interval"):
        EmbeddedServer(port=free_port(), data_dir=tmp_path, sync="sometimes")


def test_limits_that_fit_are_left_alone_and_a_small_disk_scales_them_all_alike():
    assert fit_to_disk(100 * GiB) == {}
    fitted = fit_to_disk(2 * GiB)
    assert set(fitted) == set(retention_targets())
    assert total_reserved(fitted) <= 2 * GiB * 0.75 * 0.5
    for target, limits in fitted.items():
        assert limits.max_age_s == default_limits(target).max_age_s  # ages kept, sizes shrunk
        assert limits.max_bytes < default_limits(target).max_bytes


def test_a_disk_too_small_is_refused_with_one_line():
    with pytest.raises(ProvisionError) as exc:
        fit_to_disk(MIN_TOTAL_BYTES)
    assert "\n" not in str(exc.value) and "GiB free" in str(exc.value)


@pytest.fixture
def small_server(tmp_path):
    """A server whose JetStream store is 1 GB: the defaults (~10 GiB of limits) do not fit."""
    conf = tmp_path / "small.conf"
    conf.write_text("jetstream { max_file_store: 1GB }\n")
    server = EmbeddedServer(port=free_port(), data_dir=tmp_path / "small", config_file=conf,
                            sync=SYNC_INTERVAL).start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_server_without_room_is_a_clear_provision_error(small_server):
    bus = await Bus.connect(small_server.url)
    try:
        with pytest.raises(ProvisionError, match="has no room left.*natsched retention set"):
            await bus.provision()
    finally:
        await bus.close()


async def test_limits_fitted_to_the_disk_are_stored_and_every_provisioning_uses_them(small_server):
    bus = await Bus.connect(small_server.url)
    try:
        fitted = await bus.fit_to_disk(int(2.4 * GiB))  # 0.9 GiB for natsched
        assert fitted and await bus.stored_overrides() == fitted
        await bus.provision(jobs=True)  # a service's own provisioning: the stored limits, not the defaults
        assert await bus.fit_to_disk(int(2.4 * GiB)) == {}  # fits now: nothing rewritten
    finally:
        await bus.close()


def test_up_on_a_server_without_room_says_so_in_one_line(small_server, tmp_path):
    out = subprocess.run([sys.executable, "-m", "natsched", "up", "--nats-url", small_server.url, "--workers", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "has no room left" in out.stderr
