"""The root of every error natsched raises.

Each package has one root of its own, and every root derives from :class:`NatschedError`, so an
edge (the CLI, the gateway, a service's loop) can catch the whole family in one clause::

    NatschedError
    ├── WireError        (natsched.wire.errors)      a message that breaks the wire contract
    ├── BusError         (natsched.bus.errors)       the NATS transport: connect, server, provision, CAS
    ├── ClientError      (natsched.client.errors)    a producer's request or batch that did not end well
    ├── AuditError       (natsched.audit.records)    an audit that cannot be answered
    ├── AdmitterError    (natsched.admitter.errors)
    ├── RouterError      (natsched.router.errors)
    ├── WorkerError      (natsched.workers.errors)
    ├── SimError         (natsched.sim.errors)
    └── GatewayError     (natsched.gateway.errors)
"""

from __future__ import annotations


class NatschedError(Exception):
    """Root of every natsched error."""
