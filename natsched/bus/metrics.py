"""Prometheus metrics of a connection, read from the :class:`~natsched.bus.connection.Bus` at
scrape time (names listed in docs/operations.md).

Why these: an audit record (admission, rescue and routing decisions) is published without the
caller waiting (:meth:`Bus.jpublish_nowait`) and retried in the background; one the server never
stores is the only thing of its request that can be lost, and before this an operator learnt of it
only from an error line in the log. The retrying gauge shows an outage while records can still be
saved; server changes show restarts and fail-overs the connection rode through.

A collector rather than counters the Bus increments: the transport stays free of a registry,
and each service adds its connection to the registry it already serves (:func:`watch`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from natsched.bus.connection import Bus


class BusCollector(Collector):
    """The record and reconnect counts of the connections watched, labelled by connection name."""

    def __init__(self) -> None:
        self.buses: dict[str, Bus] = {}

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        lost = CounterMetricFamily("natsched_bus_records_lost", "Audit records (admission, rescue, routing) "
                                   "the server never stored within their retry budget, or beyond the retry cap",
                                   labels=["connection"])
        retrying = GaugeMetricFamily("natsched_bus_records_retrying",
                                     "Audit records being published again in the background now (an outage)",
                                     labels=["connection"])
        changes = CounterMetricFamily("natsched_bus_server_changes",
                                      "Reconnects that found another server process (a restart or fail-over)",
                                      labels=["connection"])
        for name, bus in self.buses.items():
            lost.add_metric([name], bus.lost_publishes)
            retrying.add_metric([name], bus.records_retrying)
            changes.add_metric([name], bus.server_changes)
        yield from (lost, retrying, changes)


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, BusCollector] = weakref.WeakKeyDictionary()


def watch(registry: CollectorRegistry, bus: Bus) -> None:
    """Export ``bus``'s counts in ``registry``; idempotent (an admitter and the router inside it
    share one registry and one connection)."""
    collector = _collectors.get(registry)
    if collector is None:
        collector = _collectors[registry] = BusCollector()
        registry.register(collector)
    collector.buses[bus.name] = bus
