"""The benchmarks' process pool: workers started by a fork server, their state handed over once each.

Why not ``fork``: the bench commands also run inside processes that have threads — the test
session's NATS fixtures, a gateway, OpenTelemetry's exporters. A fork copies only the calling
thread, and every lock another thread held at that instant stays held in the child for good; a
child that then touches one (a log handler, stdio, a queue's feeder) waits forever, and the pool's
``join`` with it. That happened once in the test suite under load. A fork server is a clean
single-threaded process started at the first pool, so its children hold no such lock (it is
Python 3.14's default for the same reason). Where a platform has no fork server, ``spawn``.

What a child needs arrives through the initializer (pickled once per child, not per job), and so
do the parent's log levels: a child does not inherit them, and the benchmarks silence the
services' thousands of per-request lines.

The simulation does not depend on the child's hash seed (a fork server's differs from the
parent's): the same files give the same numbers with one process or many, which
``tests/sim/test_bench_scenarios.py`` checks.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Callable, Iterable
from multiprocessing.context import BaseContext
from multiprocessing.pool import Pool
from typing import Any

#: Modules the fork server imports once, so that each child starts without importing them again.
PRELOAD = ["natsched.sim.bench_routing", "natsched.sim.bench_scenarios"]


def start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def context() -> BaseContext:
    ctx = mp.get_context(start_method())
    if start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def make_pool(processes: int, initializer: Callable[..., None], initargs: tuple = (),
              *, ctx: BaseContext | None = None, loggers: Iterable[str] = ()) -> Pool:
    """A pool of ``processes`` children that each run ``initializer(*initargs)`` first, with the
    parent's levels for ``loggers`` (a queue for progress must come from the same ``ctx``)."""
    ctx = ctx or context()
    levels = {name: logging.getLogger(name).level for name in loggers}
    return ctx.Pool(processes, initializer=_child_init, initargs=(levels, initializer, initargs))


def _child_init(levels: dict[str, int], initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    initializer(*initargs)
