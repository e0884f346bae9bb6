"""``natsched up``: run the embedded nats-server and every component as child processes.

Children run in their own session (Ctrl-C reaches only the supervisor, which stops them in
order) and carry PR_SET_PDEATHSIG, so even a supervisor killed with SIGKILL leaves no orphans.
The nats-server's data dir survives a stop; the next ``up`` finds its streams and quotas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bus.connection import Bus
from bus.errors import ServerError
from bus.server import DEFAULT_HOST, DEFAULT_PORT, EmbeddedServer, die_with_parent
from natsched.runtime import READY_PREFIX

log = logging.getLogger(__name__)


async def _provision(url: str) -> None:
    bus = await Bus.connect(url, name="natsched-up")
    try:
        await bus.provision()
    finally:
        await bus.close()

@dataclass
class UpSettings:
    workers: int = 2
    admitters: int = 1
    routers: int = 1
    engine: str = "sim"
    nats_url: str | None = None  # None: run the embedded server
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path | None = None
    policy: str = "natsched"
    time_scale: float = 1.0
    log_level: str = "info"
    ready_timeout_s: float = 60.0
    extra_worker_args: list[str] = field(default_factory=list)
    gateway_port: int | None = None  # also run the HTTP gateway on 127.0.0.1:PORT
    gateway_keys: Path | None = None  # its API keys; None: --insecure-open (local use)


@dataclass
class Child:
    name: str
    args: list[str]
    proc: subprocess.Popen | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    detail: str = ""


class Supervisor:
    def __init__(self, settings: UpSettings) -> None:
        self.s = settings
        self.server: EmbeddedServer | None = None
        self.children: list[Child] = []
        self._stop = threading.Event()

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "natsched", "--log-level", self.s.log_level, *args]

    def plan(self, url: str) -> list[Child]:
        common = ["--nats-url", url]
        kids = []
        for i in range(1, self.s.admitters + 1):
            name = "admitter" if self.s.admitters == 1 else f"admitter-{i}"
            kids.append(Child(name, self._cmd("admitter", *common, "--name", name)))
        for i in range(1, self.s.routers + 1):
            name = "router" if self.s.routers == 1 else f"router-{i}"
            kids.append(Child(name, self._cmd("router", *common, "--name", name, "--policy", self.s.policy)))
        kids.append(Child("offline", self._cmd("offline", *common, "--name", "offline")))
        for i in range(1, self.s.workers + 1):
            args = ["worker", *common, "--id", f"w{i}", "--engine", self.s.engine,
                    "--time-scale", str(self.s.time_scale), *self.s.extra_worker_args]
            kids.append(Child(f"worker w{i}", self._cmd(*args)))
        if self.s.gateway_port is not None:
            auth = ["--keys", str(self.s.gateway_keys)] if self.s.gateway_keys else ["--insecure-open"]
            kids.append(Child("gateway", self._cmd("gateway", *common, "--port", str(self.s.gateway_port), *auth)))
        return kids

    def _spawn(self, child: Child) -> None:
        child.ready.clear()
        child.proc = subprocess.Popen(
            child.args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._read, args=(child, child.proc), daemon=True).start()

    def _read(self, child: Child, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(READY_PREFIX):
                child.detail = line[len(READY_PREFIX):].strip()
                child.ready.set()
            else:
                sys.stdout.write(line)

    def start(self, quiet: bool = False) -> str:
        started = time.monotonic()
        say = (lambda *a, **k: None) if quiet else print
        url = self.s.nats_url
        if url is None:
            self.server = EmbeddedServer(self.s.port, self.s.data_dir, self.s.host).start()
            url = self.server.url
            say(f"ready: nats-server {url} (JetStream, data {self.server.data_dir})", flush=True)
        asyncio.run(_provision(url))  # once, before the components race to create streams
        self.children = self.plan(url)
        for child in self.children:
            self._spawn(child)
        for child in self.children:
            remaining = self.s.ready_timeout_s - (time.monotonic() - started)
            if not child.ready.wait(max(0.1, remaining)):
                code = child.proc.poll() if child.proc else None
                raise ServerError(f"{child.name} was not ready within {self.s.ready_timeout_s:.0f}s"
                                  + (f" (exited with code {code})" if code is not None else ""))
            say(f"ready: {child.name} (pid {child.proc.pid}) {child.detail}".rstrip(), flush=True)
        say(f"natsched is up in {time.monotonic() - started:.1f}s on {url}; "
              "try: natsched submit --tenant demo --prompt 'hello'  (Ctrl-C stops)", flush=True)
        return url

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._stop.set())
        try:
            self.start()
            while not self._stop.wait(0.5):
                self._restart_dead()
            return 0
        finally:
            self.stop()

    def _restart_dead(self) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None and not self._stop.is_set():
                print(f"{child.name} exited with code {child.proc.returncode}; restarting", flush=True)
                time.sleep(1.0)
                self._spawn(child)

    def stop(self, timeout: float = 10.0, quiet: bool = False) -> None:
        """Workers first, then router and admitter, then the server: nothing is left running."""
        for child in reversed(self.children):
            if child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        if self.server is not None:
            self.server.stop()
        if (self.children or self.server) and not quiet:
            print("natsched stopped", flush=True)
        self.children = []
        self.server = None
