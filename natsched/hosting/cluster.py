"""``natsched cluster up --nodes 3``: a local JetStream cluster on loopback, for tests and small
deployments.

Why a cluster: with 3 nodes every stream and bucket is kept on 3 servers (provisioning picks
replicas = 3 when it sees 3 nodes), so losing one node loses no request: JetStream elects new
leaders (publishes pause for a few seconds) and the Bus's time-budgeted publish retries with
``Nats-Msg-Id`` dedup carry every message across exactly once.

Each node is a child ``nats-server`` (own data dir ``DIR/n<i>``, log ``DIR/n<i>.log``) with a
cluster block listing every node's route; children run in their own session with
PR_SET_PDEATHSIG, so Ctrl-C, SIGTERM or even a SIGKILLed parent leaves no orphan.

Ports: clients ``P, P+1, ...``; routes ``P+2000, P+2001, ...`` (4222 -> 6222, NATS's defaults).

Errors: :class:`ClusterError`, a :class:`natsched.bus.errors.ServerError` (like a single embedded server
that cannot start), so the CLI reports both the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from natsched.bus.connection import Bus
from natsched.bus.errors import ServerError
from natsched.bus.server import (DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SYNC, ClusterMember, EmbeddedServer,
                                  default_data_dir, free_port)

log = logging.getLogger(__name__)

ROUTE_PORT_OFFSET = 2000


class ClusterError(ServerError):
    """The cluster could not be formed (a node did not start, JetStream elected no leader)."""


@dataclass
class ClusterSettings:
    nodes: int = 3
    host: str = DEFAULT_HOST
    base_port: int | None = DEFAULT_PORT  # None: free ports (tests)
    data_dir: Path | None = None  # default: <natsched data dir>/cluster
    name: str = "natsched"
    config_file: Path | None = None  # e.g. natsched auth init's nats-auth.conf, on every node
    credentials: Path | None = None  # used for the readiness check and provisioning (admin)
    ready_timeout_s: float = 30.0  # JetStream's first leader election takes ~5 s
    provision: bool = True
    sync: str = DEFAULT_SYNC  # every node's JetStream sync_interval (natsched.bus.server.SYNC_CHOICES)


class LocalCluster:
    """N nats-server children forming one JetStream cluster; a context manager that stops them."""

    def __init__(self, settings: ClusterSettings) -> None:
        if settings.nodes < 1:
            raise ClusterError("--nodes must be >= 1")
        self.s = settings
        self.data_dir = Path(settings.data_dir) if settings.data_dir else default_data_dir() / "cluster"
        if settings.base_port is None:
            ports = [free_port(settings.host) for _ in range(settings.nodes)]
            routes = [free_port(settings.host) for _ in range(settings.nodes)]
        else:
            ports = [settings.base_port + i for i in range(settings.nodes)]
            routes = [p + ROUTE_PORT_OFFSET for p in ports]
        self.servers = [
            EmbeddedServer(
                port, self.data_dir / f"n{i + 1}", settings.host, log_file=self.data_dir / f"n{i + 1}.log",
                config_file=settings.config_file, sync=settings.sync,
                cluster=ClusterMember(f"n{i + 1}", routes[i], routes, settings.name) if settings.nodes > 1 else None,
            )
            for i, port in enumerate(ports)
        ]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Every node, comma-separated: what ``--nats-url`` and ``Bus.connect`` take."""
        return ",".join(self.urls)

    def node(self, server_name: str) -> EmbeddedServer:
        for s in self.servers:
            if s.cluster is not None and s.cluster.server_name == server_name:
                return s
        raise KeyError(server_name)

    def start(self) -> "LocalCluster":
        try:
            for server in self.servers:
                server.start()
            asyncio.run(self._wait_ready())
        except BaseException:
            self.stop()
            raise
        return self

    async def _wait_ready(self) -> None:
        """Until JetStream answers with every node known (bounded by ``ready_timeout_s``), then provision."""
        deadline = time.monotonic() + self.s.ready_timeout_s
        bus = await Bus.connect(self.url, name="natsched-cluster", connect_budget_s=self.s.ready_timeout_s,
                                credentials=self.s.credentials)
        try:
            last: Exception | None = None
            while time.monotonic() < deadline:
                try:
                    await bus.jetstream_ready()
                    if bus.cluster_nodes() >= self.s.nodes:
                        break
                except Exception as exc:  # no meta leader yet
                    last = exc
                await asyncio.sleep(0.25)
            else:
                raise ClusterError(f"JetStream cluster of {self.s.nodes} not ready within "
                                   f"{self.s.ready_timeout_s:.0f}s: {last}; see the logs in {self.data_dir}")
            if self.s.provision:
                await bus.provision()
        finally:
            await bus.close()

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
