"""``natsched gateway``: the OpenAI-compatible HTTP gateway; its flags and the settings built from them, once.

The command connects to NATS, starts following worker heartbeats (models, health, ``/status``),
serves HTTP and prints ``READY gateway http://HOST:PORT`` like every natsched service. Building
the ``natsched`` parser imports no HTTP stack: the server is imported when the command runs.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from natsched.cli.options import fail, no_server, url_flag

BAD_SETTING = 2  # exit code of a refused flag, before anything is connected


def add_parsers(sub) -> None:
    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway",
                        description="Serve /v1/completions, /v1/chat/completions (with SSE streaming), /v1/models, "
                                    "/healthz and /status over HTTP; each API key maps to a tenant (--keys).")
    url_flag(gw)
    gw.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    gw.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    gw.add_argument("--keys", type=Path, default=None,
                    help='JSON file {"KEY": {"tenant": "T", "class": "online"}} (keys may be "sha256:<hex>")')
    gw.add_argument("--insecure-open", action="store_true",
                    help="no API keys: every caller is --open-tenant (for a laptop, never a network)")
    gw.add_argument("--open-tenant", default="open", help="the tenant of --insecure-open callers (default open)")
    gw.add_argument("--model", dest="models", action="append", default=[], metavar="NAME",
                    help="a model to list before any worker serves it (repeatable)")
    gw.add_argument("--max-wait", type=float, default=600.0,
                    help="longest a request is held, queued and running, whatever the client's timeout (s)")
    gw.add_argument("--ttft-timeout", type=float, default=None, metavar="S",
                    help="first token within S seconds, unless the x-natsched-ttft-timeout header says (default: none)")
    gw.add_argument("--stream-idle-timeout", type=float, default=None, metavar="S",
                    help="next token of a stream within S seconds, unless x-natsched-stream-idle-timeout says "
                         "(default: none)")
    gw.add_argument("--keepalive", type=float, default=15.0, metavar="S",
                    help="an SSE comment line on a stream quiet for S seconds (default 15)")
    gw.add_argument("--max-body", type=int, default=768 * 1024, help="largest request body in bytes (413 above)")
    gw.add_argument("--default-max-tokens", type=int, default=128, help="max_tokens when a request names none")
    gw.add_argument("--stream-migrations", type=int, default=2, metavar="N",
                    help="a stream whose worker dies goes on from another worker after the tokens it sent, up to "
                         "N times (default 2; 0: such a stream ends with an error)")
    gw.add_argument("--no-status", action="store_true", help="do not serve /status (nor follow decisions for it)")
    edge = gw.add_argument_group("edge limits", "what a connection may cost before it is a call (docs/gateway.md)")
    edge.add_argument("--max-connections", type=int, default=1024,
                      help="open sockets; one more is answered 503 and closed as it is accepted (default 1024)")
    edge.add_argument("--header-timeout", type=float, default=10.0,
                      help="seconds from a connection (or a request's first byte) to its last header: 408 (default 10)")
    edge.add_argument("--body-timeout", type=float, default=30.0,
                      help="seconds from the last header to the end of the body: 408 (default 30)")
    edge.add_argument("--idle-timeout", type=float, default=5.0,
                      help="seconds a kept-alive connection may wait for its next request (default 5)")
    edge.add_argument("--max-per-key", type=int, default=64,
                      help="inference calls in flight per API key; more get 429 (default 64; open: all callers)")
    edge.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=[], metavar="NAME",
                      help="--insecure-open: a Host name to answer besides loopback and --host ('*': any); repeatable")
    edge.add_argument("--allowed-origin", dest="allowed_origins", action="append", default=[], metavar="URL",
                      help="--insecure-open: a browser origin that may call the API (http://app:3000); repeatable")
    gw.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    gw.add_argument("--name", default="gateway", help="connection name on the bus")
    gw.set_defaults(handler=cmd_gateway)


def settings_from_args(args: argparse.Namespace):
    """(GatewaySettings, KeyRing), built once; ConfigError says what is wrong."""
    from natsched.gateway.errors import ConfigError
    from natsched.gateway.keys import KeyRing
    from natsched.gateway.service import GatewaySettings

    if args.keys is not None and args.insecure_open:
        raise ConfigError("--keys and --insecure-open exclude each other")
    if args.keys is None and not args.insecure_open:
        raise ConfigError("no --keys FILE given: refusing to serve without API keys "
                          "(add --insecure-open to let anyone in as one tenant)")
    keys = KeyRing.from_file(args.keys) if args.keys is not None else KeyRing.open(args.open_tenant)
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1-65535, got {args.port}")
    if args.max_wait <= 0 or args.max_body <= 0 or args.default_max_tokens <= 0:
        raise ConfigError("--max-wait, --max-body and --default-max-tokens must be positive")
    limits = (args.max_connections, args.header_timeout, args.body_timeout, args.idle_timeout, args.max_per_key)
    if min(limits) <= 0:
        raise ConfigError("--max-connections, --header-timeout, --body-timeout, --idle-timeout and --max-per-key "
                          "must be positive")
    for flag, value in (("--ttft-timeout", args.ttft_timeout), ("--stream-idle-timeout", args.stream_idle_timeout),
                        ("--keepalive", args.keepalive)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} must be a positive number of seconds, got {value}")
    settings = GatewaySettings(host=args.host, port=args.port, max_body_bytes=args.max_body,
                               default_max_tokens=args.default_max_tokens, max_wait_s=args.max_wait,
                               ttft_timeout_s=args.ttft_timeout, stream_idle_timeout_s=args.stream_idle_timeout,
                               keepalive_s=args.keepalive,
                               models=tuple(args.models), status_page=not args.no_status,
                               metrics_port=args.metrics_port, name=args.name,
                               max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                               body_timeout_s=args.body_timeout, idle_timeout_s=args.idle_timeout,
                               max_per_key=args.max_per_key, allowed_hosts=tuple(args.allowed_hosts),
                               allowed_origins=tuple(args.allowed_origins), stream_migrations=args.stream_migrations)
    return settings, keys


def cmd_gateway(args: argparse.Namespace) -> int:
    """Refuse bad flags in one line before connecting anywhere (exit 2), then serve until a signal."""
    from natsched.bus.errors import NoServerError
    from natsched.errors import NatschedError
    from natsched.gateway.errors import ConfigError
    from natsched.hosting.runtime import run_loop

    try:
        settings, keys = settings_from_args(args)
    except ConfigError as exc:
        return fail(str(exc), BAD_SETTING)
    try:
        return run_loop(_serve(args, settings, keys))
    except NoServerError as exc:
        return fail(no_server(exc.url))
    except (NatschedError, OSError) as exc:
        return fail(str(exc))


async def _serve(args: argparse.Namespace, settings, keys) -> int:
    from natsched.client.producer import Client, Timeouts
    from natsched.gateway.server import GatewayServer
    from natsched.gateway.service import Gateway
    from natsched.hosting.runtime import serve

    holder: dict[str, GatewayServer] = {}

    async def start(bus) -> str:
        client = Client(bus, Timeouts(queued=settings.max_wait_s), migrations=settings.stream_migrations)
        holder["server"] = server = await GatewayServer(Gateway(client, keys, settings)).start()
        who = f"open as tenant {keys.open_principal.tenant}" if keys.is_open else f"{len(keys)} keys"
        return f"{server.url} ({who})"

    async def stop() -> None:
        if "server" in holder:
            await holder["server"].stop()

    await serve(args.nats_url, settings.name, start, stop, credentials=args.credentials)
    return 0
