"""What every ``natsched`` command shares: the NATS flags, the one-line error, running a coroutine.

Each command module (``natsched.cli.up``, ``.submit``, ...) adds its own subparsers and binds its
handler with ``set_defaults(handler=...)``; the handler returns the exit code. An error is one
``natsched: error: ...`` line on stderr (exit 1 unless the command says otherwise), never a
traceback, and a client command with no server says how to get one instead of retrying aloud.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Coroutine

from natsched.bus.server import DEFAULT_URL

ENV_URL = "NATSCHED_NATS_URL"
ENV_CREDENTIALS = "NATSCHED_CREDENTIALS"
ENV_SERVER_API_KEY = "NATSCHED_SERVER_API_KEY"  # the API key of the vllm serve processes an agent fronts
CLIENT_CONNECT_BUDGET_S = 5.0  # a command a person waits on: long enough for a server that is starting

Handler = Callable[[argparse.Namespace], int]


def url_flag(p: argparse.ArgumentParser) -> None:
    """``--nats-url`` and ``--credentials``, defaulting to their environment variables."""
    p.add_argument("--nats-url", default=os.environ.get(ENV_URL, DEFAULT_URL),
                   help=f"NATS server URL, or several comma-separated (default: ${ENV_URL} or {DEFAULT_URL})")
    p.add_argument("--credentials", type=Path, default=os.environ.get(ENV_CREDENTIALS),
                   help=f"credentials file from natsched auth init (default: ${ENV_CREDENTIALS})")


def fail(message: str, code: int = 1) -> int:
    print(f"natsched: error: {message}", file=sys.stderr)
    return code


def no_server(url: str) -> str:
    """The one line a client command prints when nothing answers at ``url``."""
    return f"no NATS at {url}: start `natsched up` or set {ENV_URL}"


def run(coro: Coroutine[Any, Any, int | None]) -> int:
    """Run a command's coroutine on the services' loop; a known error becomes one line (exit 1)."""
    import orjson

    from natsched.bus.errors import NoServerError
    from natsched.errors import NatschedError
    from natsched.hosting.runtime import run_loop

    try:
        return run_loop(coro) or 0
    except NoServerError as exc:
        return fail(no_server(exc.url))
    except (NatschedError, ValueError, orjson.JSONDecodeError) as exc:
        return fail(str(exc))


async def connect(args: argparse.Namespace, name: str = "natsched-cli"):
    """A Bus for a client command: a short connect budget, the flags' URL and credentials."""
    from natsched.bus.connection import Bus

    return await Bus.connect(args.nats_url, name=name, connect_budget_s=CLIENT_CONNECT_BUDGET_S,
                             credentials=args.credentials)


def history_parsers(sub, what: str, handler: Handler, description: str) -> None:
    """``rollback [--to REV]`` and ``history`` for a bucket-backed config (``route``, ``quota``)."""
    back = sub.add_parser("rollback", help=f"restore earlier {what} from the bucket's history", description=description)
    url_flag(back)
    back.add_argument("--to", type=int, default=None, metavar="REV", help="the revision to restore (see history)")
    back.set_defaults(handler=handler)
    hist = sub.add_parser("history", help=f"list the {what} revisions the bucket keeps")
    url_flag(hist)
    hist.set_defaults(handler=handler)
