"""The embedded server and stream provisioning."""

import asyncio
import socket
import time

import pytest
from nats.js import api

from natsched.wire import subjects as S
from natsched.bus.errors import ConnectError, PortInUseError, ProvisionError
from natsched.bus.connection import Bus
from natsched.bus.provision import ProvisionSettings, stream_config
from natsched.bus.server import EmbeddedServer, free_port


def test_port_in_use_gives_a_clear_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port}.*--port"):
            EmbeddedServer(port=port, data_dir=tmp_path).start()


def test_embedded_server_starts_stops_and_keeps_data(tmp_path):
    server = EmbeddedServer(port=free_port(), data_dir=tmp_path / "data")
    with server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=2):
            pass
        proc = server.proc
    assert proc.poll() is not None  # stopped
    assert (tmp_path / "data" / "jetstream").is_dir()


async def test_connect_budget_gives_a_clear_error():
    with pytest.raises(ConnectError, match="could not reach NATS"):
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", connect_budget_s=0.5)


async def test_provisioning_is_idempotent_with_explicit_limits(bus):
    await bus.provision()
    await bus.provision()
    for name in S.STREAMS:
        info = await bus.js.stream_info(name)
        assert info.config.max_age > 0 and info.config.max_bytes > 0
        assert info.config.duplicate_window == 120
    for bucket in S.BUCKETS:
        await bus.js.key_value(bucket)
    work = await bus.js.stream_info(S.STREAM_WORK)
    assert work.config.retention == api.RetentionPolicy.WORK_QUEUE


async def test_changed_limits_are_applied_to_existing_streams(bus):
    settings = ProvisionSettings()
    settings.limits[S.STREAM_DECISIONS].max_age_s = 3600
    await bus.provision(settings)
    assert (await bus.js.stream_info(S.STREAM_DECISIONS)).config.max_age == 3600


async def test_incompatible_existing_stream_is_refused(bus):
    await bus.js.delete_stream(S.STREAM_ADMITTED)
    cfg = stream_config(S.STREAM_ADMITTED, ProvisionSettings())
    cfg.retention = api.RetentionPolicy.LIMITS
    await bus.js.add_stream(cfg)
    with pytest.raises(ProvisionError, match="ADMITTED exists with retention"):
        await bus.provision()


async def test_publishes_and_reads_ride_out_a_server_restart(tmp_path):
    """A node that restarts (or a leader election) costs time, not an error: publishes and
    reads retry within the Bus's budget while the client reconnects."""
    server = EmbeddedServer(port=free_port(), data_dir=tmp_path / "data").start()
    bus = await Bus.connect(server.url, publish_budget_s=20)
    try:
        await bus.provision()
        await bus.jpublish(S.request(S.ONLINE, "t1"), b"before", msg_id="m1")
        server.stop()
        loop = asyncio.get_running_loop()
        restart = loop.run_in_executor(None, lambda: time.sleep(1.0) or server.start())
        ack = await bus.jpublish(S.request(S.ONLINE, "t1"), b"during", msg_id="m2")  # sent while down
        await restart
        assert ack.seq == 2 and not ack.duplicate
        server.stop()
        restart = loop.run_in_executor(None, lambda: time.sleep(1.0) or server.start())
        stored = await bus.stream_messages(S.STREAM_REQUESTS)  # asked while down
        await restart
        assert [data for _, data in stored] == [b"before", b"during"]
    finally:
        await bus.close()
        server.stop()


def test_free_ports_finds_consecutive_ports_that_bind():
    import socket

    from natsched.bus.server import free_ports

    base = free_ports(4)
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(4)]
    try:
        for offset, sock in enumerate(socks):
            sock.bind(("127.0.0.1", base + offset))  # raises if any of them was taken
    finally:
        for sock in socks:
            sock.close()
