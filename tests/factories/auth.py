"""A real nats-server under ``natsched auth init``'s config, and the services each on its own role.

``secured_server`` starts the server with the generated config; ``admin_provisioned`` makes the
streams and buckets as the admin; ``RoleServices.start`` runs admitter, router, one sim worker
and the offline runner, each connected with its own role's credentials (what
``tests/ops/test_auth_roles.py`` and ``tests/ops/test_auth_gateway_jobs.py`` serve requests with).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Iterator

from natsched.admitter.offline import OfflineRunner, OfflineSettings
from natsched.admitter.service import AdmitterService
from natsched.bus.connection import Bus
from natsched.bus.server import EmbeddedServer, free_port
from natsched.ops.auth import AuthFiles, AuthSettings, init
from natsched.router.core import RouterSettings
from natsched.router.service import RouterService, RouterServiceSettings
from natsched.workers.agent import WorkerAgent, WorkerSettings
from natsched.workers.profiles import H100_LLAMA8B
from natsched.workers.simengine import SimEngine


@contextlib.contextmanager
def secured_server(root: Path, **auth) -> Iterator[tuple[EmbeddedServer, AuthFiles]]:
    """``auth init`` into ``root/auth`` (``auth``: :class:`AuthSettings` fields), a server with that config."""
    files = init(AuthSettings(out=root / "auth", **auth))
    server = EmbeddedServer(free_port(), root / "data", config_file=files.config, log_file=root / "nats.log").start()
    try:
        yield server, files
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def admin_provisioned(server: EmbeddedServer, files: AuthFiles, jobs: bool = True) -> AsyncIterator[Bus]:
    """The admin's Bus, after it made every stream and bucket (OUTCOMES and ``jobs`` with ``jobs``)."""
    admin = await Bus.connect(server.url, name="admin", credentials=files.creds("admin"))
    await admin.provision(jobs=jobs)
    try:
        yield admin
    finally:
        await admin.close()


@dataclass
class RoleServices:
    admitter: AdmitterService
    router: RouterService
    worker: WorkerAgent
    runner: OfflineRunner

    @classmethod
    async def start(cls, as_role: Callable[[str], Awaitable[Bus]], worker: str = "w1") -> "RoleServices":
        """Admitter (every batch request degraded: degrade watermark 0), router, a sim worker and
        the offline runner, each on ``await as_role(user)``'s connection."""
        admitter = AdmitterService(await as_role("admitter"))
        await admitter.start()
        admitter.core.settings.degrade_watermark = 0.0  # batch and offline work take the offline path
        router = RouterService(await as_role("router"), RouterServiceSettings(
            core=RouterSettings(policy="least_loaded"), retry_delay_s=0.2))
        await router.start()
        agent = WorkerAgent(await as_role(f"worker-{worker}"), SimEngine(H100_LLAMA8B, block_size=32, time_scale=0.05),
                            WorkerSettings(id=worker, heartbeat_interval_s=0.2))
        await agent.start()
        runner = OfflineRunner(await as_role("offline"), OfflineSettings(poll_s=0.02))
        await runner.start()
        return cls(admitter, router, agent, runner)

    async def stop(self) -> None:
        """The worker leaves; the other services end with their connections."""
        await self.worker.stop()
