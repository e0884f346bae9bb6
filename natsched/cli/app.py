"""The ``natsched`` command line: one parser, one module per command group.

Each group (``natsched.cli.up``, ``.submit``, ``.quota``, ...) adds its subcommands with
``add_parsers(sub)`` and binds each to its handler with ``set_defaults(handler=...)``; ``main``
calls the handler the flags chose and returns its exit code. Settings dataclasses are built in
the handlers, once, from the flags. Nothing outside ``natsched.cli`` imports this package.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

import natsched
from natsched.cli import auth, bench, chaos, cluster, gateway, jobs, quota, route, status, submit, up

GROUPS = (up, submit, quota, route, gateway, status, auth, cluster, bench, chaos, jobs)
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="natsched",
        description="Admission control and cache-aware routing for LLM inference on NATS JetStream.",
    )
    parser.add_argument("--version", action="version", version=f"natsched {natsched.__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from natsched.hosting.runtime import setup_logging

    try:
        args = build_parser().parse_args(argv)
        setup_logging(args.log_level)
        code = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at exit
        return code or 0
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            return _quiet_broken_pipe()
        raise


def _quiet_broken_pipe() -> int:
    """The reader went away (``natsched audit ... | head -1``): exit without a traceback.

    Python flushes stdout again at exit and would report the same broken pipe; pointing stdout
    at /dev/null first is what the Python docs recommend (signal module, "Note on SIGPIPE").
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


if __name__ == "__main__":
    sys.exit(main())
