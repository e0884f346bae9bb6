"""The router: prefix index, worker registry/state machine, routing policies (pure) + the service.

Pure modules (no nats, no asyncio): ``policy`` (interface), ``core`` (RouterCore), ``index``,
``registry``, ``feedback``, ``costmodel``, ``hashring``, ``deps``, ``policies`` (names and
baselines), ``natsched`` (default policy), ``sglang`` and ``peers`` (peer policies), ``testing``
(factories). ``service`` holds all I/O.
"""
