"""Errors raised by the NATS transport.

Every error here derives from :class:`BusError`::

    BusError
    ├── ConnectError            the NATS server could not be reached within the budget
    │   └── NoServerError       nothing answered at the URL (no server there, or not yet)
    ├── ServerError             the embedded nats-server could not be run
    │   └── PortInUseError      its port is already taken
    ├── ProvisionError          a stream or bucket exists with an incompatible config
    ├── ConflictError           a compare-and-swap lost: the key changed since it was read
    └── SnapshotError           (natsched.bus.snapshot) a bucket read that stopped arriving

Messages that break the wire contract raise :class:`natsched.wire.errors.MessageError`; a
producer's failed request raises :class:`natsched.client.errors.RequestError`.
"""

from __future__ import annotations

from natsched.errors import NatschedError


class BusError(NatschedError):
    """Root of every transport error."""


class ConnectError(BusError):
    """The NATS server could not be reached within the connect budget."""


class NoServerError(ConnectError):
    """Nothing answered at ``url`` within the connect budget (as opposed to a refusal)."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class ServerError(BusError):
    """The embedded nats-server could not be started or stopped."""


class PortInUseError(ServerError):
    """The embedded server's port is already taken by another process."""


class ProvisionError(BusError):
    """A stream or bucket could not be created or updated to the expected config."""


class ConflictError(BusError):
    """A conditional KV write lost the race: re-read and decide again."""


class SnapshotError(BusError):
    """A windowed bucket read (``natsched.bus.snapshot``) got nothing for its stall time with messages pending."""
