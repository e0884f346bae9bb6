"""``natsched cluster up``: a local JetStream cluster in the foreground (:mod:`natsched.hosting.cluster`)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from natsched.bus.server import DEFAULT_PORT
from natsched.cli.options import fail


def add_parsers(sub) -> None:
    from natsched.hosting.cluster import ROUTE_PORT_OFFSET

    cl = sub.add_parser("cluster", help="run a local NATS JetStream cluster",
                        description="Run N nats-server nodes on loopback as one JetStream cluster.")
    cl_sub = cl.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = cl_sub.add_parser("up", help="start the nodes in the foreground; Ctrl-C or SIGTERM stops them",
                           description="Start N clustered nats-server nodes, provision streams and buckets "
                                       "(3 replicas on 3 nodes), print the URLs, stop everything on Ctrl-C/SIGTERM.")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--base-port", type=int, default=DEFAULT_PORT,
                    help=f"client port of the first node (default {DEFAULT_PORT}); routes use +{ROUTE_PORT_OFFSET}")
    up.add_argument("--data-dir", type=Path, default=None, help="parent of the nodes' data dirs "
                                                                "(default ~/.local/share/natsched/cluster)")
    up.add_argument("--auth-config", type=Path, default=None,
                    help="server config from natsched auth init (accounts, permissions, TLS)")
    up.add_argument("--credentials", type=Path, default=None,
                    help="admin credentials file, needed with --auth-config (readiness check, provisioning)")
    up.set_defaults(handler=cmd_cluster)


def cmd_cluster(args, stop: threading.Event | None = None) -> int:
    """Run until SIGINT/SIGTERM (or ``stop``); the nodes stop in every case."""
    from natsched.errors import NatschedError
    from natsched.hosting.cluster import ClusterSettings, LocalCluster

    settings = ClusterSettings(nodes=args.nodes, base_port=args.base_port, data_dir=args.data_dir,
                               config_file=args.auth_config, credentials=args.credentials)
    if settings.config_file is not None and settings.credentials is None:
        return fail("--auth-config needs --credentials (the admin's) to check readiness and provision")
    stop = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(settings)
    try:
        started = time.monotonic()
        cluster.start()
        for server in cluster.servers:
            print(f"ready: nats-server {server.url} (pid {server.proc.pid}, data {server.data_dir})", flush=True)
        print(f"cluster of {settings.nodes} up in {time.monotonic() - started:.1f}s; "
              f"NATSCHED_NATS_URL={cluster.url}  (Ctrl-C stops)", flush=True)
        while not stop.wait(0.5):
            for server in cluster.servers:
                if server.proc is not None and server.proc.poll() is not None:
                    print(f"nats-server {server.url} exited with code {server.proc.returncode}", flush=True)
                    server.proc = None
        return 0
    except NatschedError as exc:
        return fail(str(exc))
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("cluster stopped", flush=True)
