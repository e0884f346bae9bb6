"""``natsched up``: run the embedded nats-server and every component as child processes.

Children run in their own session (Ctrl-C reaches only the supervisor, which stops them in
order) and carry PR_SET_PDEATHSIG, so even a supervisor killed with SIGKILL leaves no orphans.
The nats-server's data dir survives a stop; the next ``up`` finds its streams and quotas.

Everything it started is supervised, the embedded nats-server included: a server that dies is
started again on the same port and data dir (JetStream recovers its streams from it; the
services reconnect on their own), a child that dies is started again with the same command.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from natsched.bus.connection import Bus
from natsched.bus.errors import ServerError
from natsched.bus.server import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SYNC, EmbeddedServer, die_with_parent
from natsched.ops.auth import AuthDir, AuthError
from natsched.hosting.runtime import DRAINED_PREFIX, READY_PREFIX
from natsched.wire import subjects as S
from natsched.wire.pools import PoolMap
from natsched.wire.roles import partition_admitter_user

log = logging.getLogger(__name__)


async def _provision(url: str, credentials: Path | None = None, data_dir: Path | None = None,
                     partitions: int = 1, pools: PoolMap | None = None) -> list[str]:
    """Every stream and bucket, the offline runner's included, the partition count and the pool
    map (``pools``, when configured): under auth only the admin may create or change them (the
    services' roles may read stream info and the map, not change them). ``data_dir``: the
    embedded server's, whose disk the limits are sized to (or refused with one line). Returns the
    notes on settings the data dir carries from earlier runs (:mod:`natsched.ops.persisted`)."""
    from natsched.ops.persisted import persisted_notes

    bus = await Bus.connect(url, name="natsched-up", credentials=credentials)
    try:
        if data_dir is not None:
            await bus.fit_to_disk(shutil.disk_usage(data_dir).free)
        await bus.provision(jobs=True)
        from natsched.admitter.move import change_partitions

        # (1: undoes an earlier partitioned run's transform; refused while the old partitions hold work)
        await change_partitions(bus, partitions)
        if pools is not None and pools.configured:
            from natsched.bus.pools import store_pools

            await store_pools(bus, pools)
        return await persisted_notes(bus)
    finally:
        await bus.close()

def router_count(routers: int | None, inline_routing: bool) -> int:
    """``--routers`` as given, else 1 (0 when the admitters route inline); ValueError when no
    process would route."""
    count = routers if routers is not None else (0 if inline_routing else 1)
    if count < 0:
        raise ValueError(f"--routers must be >= 0, got {count}")
    if count == 0 and not inline_routing:
        raise ValueError("--routers 0 needs --inline-routing (someone has to route)")
    return count


@dataclass
class UpSettings:
    workers: int = 2
    admitters: int = 1  # per partition
    partitions: int = 1  # partitioned admission (natsched.admitter.partition): P x admitters processes
    routers: int = 1  # per pool with router_pools
    router_pools: str = ""  # natsched.wire.pools.PoolMap.parse spec; "": one pool of every model
    inline_routing: bool = False  # admitters run with --route (then routers may be 0)
    credit: bool = True  # admitters spend credit reserved ahead (natsched.admitter.credit); False: --no-credit
    engine: str = "sim"
    nats_url: str | None = None  # None: run the embedded server
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path | None = None
    sync: str = DEFAULT_SYNC  # the embedded server's JetStream sync_interval (natsched.bus.server.SYNC_CHOICES)
    policy: str = "natsched"
    time_scale: float = 1.0
    log_level: str = "info"
    ready_timeout_s: float = 60.0
    extra_worker_args: list[str] = field(default_factory=list)
    gateway_port: int | None = None  # also run the HTTP gateway on 127.0.0.1:PORT
    gateway_keys: Path | None = None  # its API keys; None: --insecure-open (local use)
    offline: bool = True  # also run the offline runner
    auth_dir: Path | None = None  # from natsched auth init: the server runs its config, each child its role
    log_dir: Path | None = None  # children's stderr to <log_dir>/<name>.log; None: this process's stderr
    admitter_settings: list[str] = field(default_factory=list)  # --set GROUP.NAME=VALUE for every admitter
    metrics_port: int | None = None  # Prometheus on this port and the next ones: admitters, routers, workers, gateway
    # engine "vllm-server": the servers to front, one worker agent each (``workers`` follows), and
    # their KV-event endpoints and replay sockets in the same order (fewer: the rest run without)
    server_urls: list[str] = field(default_factory=list)
    server_kv_events: list[str] = field(default_factory=list)
    server_kv_replay: list[str] = field(default_factory=list)
    server_leave_s: float | None = None  # a silent server's agent leaves after this (None: the worker's default)
    server_metrics_urls: list[str] = field(default_factory=list)  # their /metrics pages, same order (fewer: URL/metrics)
    server_flavor: str | None = None  # "vllm" / "sglang" (None: the worker's default)

    def __post_init__(self) -> None:
        self.pools = PoolMap.parse(self.router_pools)  # PoolError (a ValueError) names what is wrong
        if self.pools.configured and self.inline_routing:
            raise ValueError("--router-pools with --inline-routing: an inline router routes the default pool only")
        if self.partitions > 1 and self.inline_routing:
            raise ValueError("--partitions with --inline-routing: not wired yet (docs/fleet.md)")
        if self.engine == "vllm-server":
            if not self.server_urls:
                raise ValueError("--engine vllm-server needs --vllm-url URL (once per server)")
            if len(self.server_kv_events) > len(self.server_urls):
                raise ValueError("more --kv-events than --vllm-url: give them in the servers' order")
            if len(self.server_kv_replay) > len(self.server_urls):
                raise ValueError("more --kv-replay than --vllm-url: give them in the servers' order")
            if len(self.server_metrics_urls) > len(self.server_urls):
                raise ValueError("more --vllm-metrics-url than --vllm-url: give them in the servers' order")
            self.workers = len(self.server_urls)
        else:  # flags only an agent in front of a server reads: silently ignored they would mislead
            given = [flag for flag, value in (("--vllm-url", self.server_urls), ("--kv-events", self.server_kv_events),
                                              ("--kv-replay", self.server_kv_replay),
                                              ("--vllm-metrics-url", self.server_metrics_urls),
                                              ("--flavor", self.server_flavor)) if value]
            if given:
                raise ValueError(f"{given[0]} needs --engine vllm-server")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535 - self.metered() + 1:
            raise ValueError(f"--metrics-port {self.metrics_port}: the {self.metered()} services need "
                             f"ports {self.metrics_port}..{self.metrics_port + self.metered() - 1} within 1..65535")

    def metered(self) -> int:
        """How many children serve metrics (the offline runner has none)."""
        return self.admitters * self.partitions + self.router_total() + self.workers + (self.gateway_port is not None)

    def router_total(self) -> int:
        return self.routers * max(1, len(self.pools.pools))


@dataclass
class Child:
    name: str
    args: list[str]
    proc: subprocess.Popen | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    detail: str = ""
    user: str = ""  # the role it connects as under --auth-dir (natsched auth init's user name)
    reader: threading.Thread | None = None  # reads its stdout (READY / DRAINED lines)
    drained: str = ""  # set when it left after an operator's drain (DRAINED line): not restarted


class Supervisor:
    def __init__(self, settings: UpSettings) -> None:
        self.s = settings
        self.server: EmbeddedServer | None = None
        self.children: list[Child] = []
        self._stop = threading.Event()
        self.auth: AuthDir | None = None
        self._open_tenant: str | None = None  # an open gateway's tenant under auth
        self.metrics_ports: dict[str, int] = {}  # child name -> its Prometheus port (metrics_port set)
        self.server_restarts = 0  # how often the embedded server was started again after it died

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "natsched", "--log-level", self.s.log_level, *args]

    def worker_ids(self) -> list[str]:
        """The ids the workers run under: w1, w2, ... (what else sends to them uses these)."""
        return [f"w{i}" for i in range(1, self.s.workers + 1)]

    def plan(self, url: str) -> list[Child]:
        common = ["--nats-url", url]
        kids = []
        for name, part, user in self._admitter_names():
            route = ["--route", "--policy", self.s.policy] if self.s.inline_routing else []
            route += [] if self.s.credit else ["--no-credit"]
            route += [f"--set={a}" for a in self.s.admitter_settings] + part + self._pools_flag()
            kids.append(Child(name, self._cmd("admitter", *common, "--name", name, *route), user=user))
        for name, pool, user in self._router_names():
            kids.append(Child(name, self._cmd("router", *common, "--name", name, "--policy", self.s.policy, *pool,
                                              *self._pools_flag()), user=user))
        if self.s.offline:  # one runner, partitioned or not: it admits each job through its tenant's partition
            split = ["--partitions", str(self.s.partitions)] if self.s.partitions > 1 else []
            kids.append(Child("offline", self._cmd("offline", *common, "--name", "offline", *split), user="offline"))
        for i, wid in enumerate(self.worker_ids()):
            args = ["worker", *common, "--id", wid, "--engine", self.s.engine,
                    "--time-scale", str(self.s.time_scale), *self.s.extra_worker_args, *self._server_args(i)]
            kids.append(Child(f"worker {wid}", self._cmd(*args), user=f"worker-{wid}"))
        if self.s.gateway_port is not None:
            auth = ["--keys", str(self.s.gateway_keys)] if self.s.gateway_keys else ["--insecure-open"]
            if self._open_tenant and not self.s.gateway_keys:
                auth += ["--open-tenant", self._open_tenant]
            kids.append(Child("gateway", self._cmd("gateway", *common, "--port", str(self.s.gateway_port), *auth),
                              user="gateway"))
        if self.auth is not None:
            for kid in kids:
                kid.args += ["--credentials", str(self.auth.creds(kid.user))]
        self._assign_metrics_ports(kids)
        return kids

    def _pools_flag(self) -> list[str]:
        """``--pools SPEC`` for the admitters and routers: each stores the map before it starts.
        Not under ``--auth-dir``: the map is the admin's to write (their roles read it), and
        :func:`_provision` stored it as the admin before any child starts."""
        return ["--pools", self.s.router_pools] if self.s.pools.configured and self.s.auth_dir is None else []

    def _router_names(self) -> list[tuple[str, list[str], str]]:
        """(name, pool flags, user under --auth-dir) of every router: ``router``, ``router-<i>``, or
        with pools ``router-<pool>`` / ``router-<pool>-<i>`` (user ``router-<pool>``: its pool's
        consumer only, natsched.wire.roles.router_role)."""
        n = self.s.routers
        if not self.s.pools.configured:
            return [("router" if n == 1 else f"router-{i}", [], "router") for i in range(1, n + 1)]
        return [(S.pool_router(p) if n == 1 else f"{S.pool_router(p)}-{i}", ["--pool", p], S.pool_router(p))
                for p in sorted(self.s.pools.pools) for i in range(1, n + 1)]

    def _admitter_names(self) -> list[tuple[str, list[str], str]]:
        """(name, partition flags, user under --auth-dir) of every admitter: ``admitter``,
        ``admitter-<i>``, or with partitions ``admitter-p<k>`` / ``admitter-p<k>-<i>`` (each also a
        coordinator candidate; user ``admitter-p<k>``: its partition's consumers and bucket only).
        Inline routing runs as ``scheduler``: an admitter's and a router's permissions together."""
        n, p = self.s.admitters, self.s.partitions
        if p == 1:
            user = "scheduler" if self.s.inline_routing else "admitter"
            return [("admitter" if n == 1 else f"admitter-{i}", [], user) for i in range(1, n + 1)]
        return [(f"admitter-p{k}" if n == 1 else f"admitter-p{k}-{i}",
                 ["--partition", str(k), "--partitions", str(p)], partition_admitter_user(k))
                for k in range(p) for i in range(1, n + 1)]

    def _server_args(self, i: int) -> list[str]:
        """Worker ``i``'s server (engine vllm-server): its URL, KV-event endpoint and replay socket."""
        if self.s.engine != "vllm-server":
            return []
        out = ["--url", self.s.server_urls[i]]
        if i < len(self.s.server_kv_events):
            out += ["--kv-events", self.s.server_kv_events[i]]
        if i < len(self.s.server_kv_replay):
            out += ["--kv-replay", self.s.server_kv_replay[i]]
        if i < len(self.s.server_metrics_urls):
            out += ["--metrics-url", self.s.server_metrics_urls[i]]
        if self.s.server_flavor is not None:
            out += ["--flavor", self.s.server_flavor]
        if self.s.server_leave_s is not None:
            out += ["--unreachable-leave", repr(self.s.server_leave_s)]
        return out

    def _assign_metrics_ports(self, kids: list[Child]) -> None:
        """Consecutive ``--metrics-port``s from ``metrics_port``, in the plan's order."""
        self.metrics_ports = {}
        if self.s.metrics_port is None:
            return
        port = self.s.metrics_port
        for kid in kids:
            if kid.name != "offline":
                kid.args += ["--metrics-port", str(port)]
                self.metrics_ports[kid.name] = port
                port += 1

    def _open_auth(self) -> None:
        """Before anything starts, check ``--auth-dir``: a credentials file for every child and
        the admin (provisioning), and a gateway that may publish for every tenant its keys name."""
        if self.s.auth_dir is None:
            return
        self.auth = auth = AuthDir.open(self.s.auth_dir)
        needs = {"admin": "provisioning", **{kid.user: kid.name for kid in self.plan("")}}
        hint = [f"--workers {','.join(self.worker_ids())}"] if self.s.workers else []
        hint += [f"--partitions {self.s.partitions}"] if self.s.partitions > 1 else []
        hint += [f"--router-pools '{self.s.router_pools}'"] if self.s.pools.configured else []
        auth.require(needs, " ".join(hint))
        if self.s.gateway_port is not None:
            self._open_tenant = self._gateway_tenant(auth.tenants("gateway"))

    def _gateway_tenant(self, served: list[str]) -> str | None:
        """The tenant an open gateway runs as (the first its role serves), after checking that a
        keys file names no tenant the role may not publish for (its requests would be refused)."""
        if not served:
            raise AuthError(f"{self.auth.creds('gateway')} names no tenant to publish for")
        if self.s.gateway_keys is None:
            return served[0]
        from natsched.gateway.errors import ConfigError
        from natsched.gateway.keys import KeyRing

        try:
            named = KeyRing.from_file(self.s.gateway_keys).tenants
        except ConfigError as exc:
            raise AuthError(str(exc)) from None
        unserved = sorted(named - set(served))
        if unserved:
            raise AuthError(f"{self.s.gateway_keys} names tenant(s) {', '.join(unserved)} that the gateway's "
                            f"credentials may not publish for (only {', '.join(served)}): regenerate them with "
                            f"natsched auth init --out {self.auth.root} --gateway-tenants "
                            f"{','.join(sorted(named | set(served)))} --force")
        return None

    def _spawn(self, child: Child) -> None:
        child.ready.clear()
        child.drained = ""
        err = None
        if self.s.log_dir is not None:
            self.s.log_dir.mkdir(parents=True, exist_ok=True)
            err = open(self.s.log_dir / f"{child.name.replace(' ', '-')}.log", "ab")
        try:
            child.proc = subprocess.Popen(
                child.args, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, bufsize=1,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        finally:
            if err is not None:
                err.close()  # the child has its own copy
        child.reader = threading.Thread(target=self._read, args=(child, child.proc), daemon=True)
        child.reader.start()

    def restart(self, child: Child) -> None:
        """Start a child that exited (or was killed) again; ``child.ready`` is set by its READY line.

        The same command, so a worker comes back under its id and finds its durable consumer
        (``natsched chaos`` kills and restarts children). Call it from the thread that will
        outlive the child: PR_SET_PDEATHSIG fires when the *thread* that forked it exits.
        """
        if child.proc is not None and child.proc.poll() is None:
            raise ServerError(f"{child.name} is still running (pid {child.proc.pid})")
        self._spawn(child)

    def _read(self, child: Child, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(READY_PREFIX):
                child.detail = line[len(READY_PREFIX):].strip()
                child.ready.set()
            elif line.startswith(DRAINED_PREFIX):
                child.drained = line[len(DRAINED_PREFIX):].strip() or "drained"
            else:
                sys.stdout.write(line)

    def start(self, quiet: bool = False) -> str:
        started = time.monotonic()
        say = (lambda *a, **k: None) if quiet else print
        url = self.s.nats_url
        self._open_auth()
        if url is None:
            self.server = EmbeddedServer(self.s.port, self.s.data_dir, self.s.host,
                                         config_file=self.auth.config if self.auth else None, sync=self.s.sync,
                                         log_file=self._server_log()).start()
            url = self.server.url
            say(f"ready: nats-server {url} (pid {self.server.proc.pid}, JetStream, data {self.server.data_dir}, "
                f"sync {self.s.sync}" + (f", auth {self.auth.config})" if self.auth else ")"), flush=True)
        admin = self.auth.creds("admin") if self.auth else None
        # once, before the components race to create streams
        notes = asyncio.run(_provision(url, admin, self.server.data_dir if self.server is not None else None,
                                       self.s.partitions, self.s.pools))
        for note in notes:  # a canary or quota set once persists: say so before it applies
            say(f"note: {note}", flush=True)
            log.warning("data dir state: %s", note)
        self.children = self.plan(url)
        for child in self.children:
            self._spawn(child)
        for child in self.children:
            self._await_ready(child, started + self.s.ready_timeout_s, say)
            metrics = f" metrics :{self.metrics_ports[child.name]}" if child.name in self.metrics_ports else ""
            say(f"ready: {child.name} (pid {child.proc.pid}) {child.detail}".rstrip() + metrics, flush=True)
        try_it = ("natsched submit --tenant demo --prompt 'hello'" if self.auth is None else
                  f"natsched submit --credentials {self.auth.creds('producer-TENANT')} --tenant TENANT --prompt 'hello'")
        say(f"natsched is up in {time.monotonic() - started:.1f}s on {url}; try: {try_it}  (Ctrl-C stops)",
            flush=True)
        return url

    def _await_ready(self, child: Child, deadline: float, say) -> None:
        """Until ``child`` says it is ready; one that exits first is started again, as after start-up
        (a cluster still electing leaders can fail a service's first JetStream calls)."""
        exits: list[int] = []
        while not child.ready.wait(max(0.0, min(0.1, deadline - time.monotonic()))):
            code = child.proc.poll() if child.proc else None
            if time.monotonic() >= deadline:
                if code is not None:
                    exits.append(code)
                raise ServerError(f"{child.name} was not ready within {self.s.ready_timeout_s:.0f}s"
                                  + (f" (exited {len(exits)} times, last with code {exits[-1]})" if exits else ""))
            if code is not None and not child.ready.is_set():
                exits.append(code)
                say(f"{child.name} exited with code {code} while starting; starting it again", flush=True)
                log.warning("%s exited with code %s while starting; starting it again", child.name, code)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                self._spawn(child)

    def pids(self) -> dict[str, int]:
        """The system's running processes by name, the embedded nats-server first.

        For what watches them from outside (``bench pipeline`` samples their memory); a server
        given by ``--nats-url`` is not ours and is left out.
        """
        out = {}
        if self.server is not None and self.server.proc is not None:
            out["nats-server"] = self.server.proc.pid
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                out[child.name] = child.proc.pid
        return out

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

    def _server_log(self) -> Path | None:
        if self.s.log_dir is None:
            return None
        self.s.log_dir.mkdir(parents=True, exist_ok=True)
        return self.s.log_dir / "nats-server.log"

    def _restart_dead(self) -> None:
        """The server first (the children need it), then every child that exited; one an operator
        drained stays stopped (``natsched worker drain ID``; the next ``natsched up`` starts it)."""
        if self.server is not None and not self.server.alive() and not self._stop.is_set():
            self.restart_server()
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None and not self._stop.is_set():
                if child.reader is not None:
                    child.reader.join(2.0)  # its last lines (a DRAINED one) are read before we judge
                if child.drained:
                    print(f"{child.name} drained ({child.drained}) and exited; not restarted "
                          "(the next natsched up starts it)", flush=True)
                    log.info("%s drained and exited; not restarted", child.name)
                    child.proc = None
                    continue
                print(f"{child.name} exited with code {child.proc.returncode}; restarting", flush=True)
                time.sleep(1.0)
                self._spawn(child)

    def restart_server(self) -> bool:
        """Start the embedded server again on its port and data dir; False when it failed (the
        next watch tries again: its port may still be held for a moment)."""
        code = self.server.proc.returncode if self.server.proc is not None else None
        print(f"nats-server exited with code {code}; restarting it on {self.server.data_dir}", flush=True)
        log.warning("nats-server exited with code %s; restarting it on %s", code, self.server.data_dir)
        try:
            self.server.start()
        except ServerError as exc:
            print(f"nats-server did not start again: {exc}; retrying", flush=True)
            return False
        self.server_restarts += 1
        print(f"ready: nats-server {self.server.url} (pid {self.server.proc.pid}, restart {self.server_restarts})",
              flush=True)
        return True

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
