"""Errors raised by the NATS transport.

Every error here derives from :class:`BusError`::

    BusError
    ├── ConnectError            the NATS server could not be reached within the budget
    │   └── NoServerError       nothing answered at the URL (no server there, or not yet)
    ├── ServerError             the embedded nats-server could not be run
    │   └── PortInUseError      its port is already taken
    ├── ProvisionError          a stream or bucket exists with an incompatible config
    ├── ConflictError           a compare-and-swap lost: the key changed since it was read
    ├── PublishFailed           a JetStream publish that could not be sent (connection closed, ...)
    │   └── PublishRefused      ... that the server answered with an error (code, err_code)
    ├── SnapshotError           (natsched.bus.snapshot) a bucket read that stopped arriving
    ├── ReadError               (natsched.bus.streams) a stream read that cannot be answered
    │   └── StreamNotFound      the stream (or a bucket's stream) does not exist
    └── BusTimeout              no answer in time (also a builtin ``TimeoutError``)

Services never see a ``nats`` exception from a handle (:mod:`natsched.bus.kv`,
:mod:`natsched.bus.streams`, :class:`natsched.bus.connection.Inbox`): these are what they catch.

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


class ReadError(BusError):
    """A stream read (``natsched.bus.streams``) that cannot be answered: no answer, a stall, no permission."""


class StreamNotFound(ReadError):
    """The stream, or the stream behind a KV bucket, does not exist (has natsched run on this server?)."""


class BusTimeout(BusError, TimeoutError):
    """Nothing arrived in time (a reply on an inbox, a request's answer). Also a ``TimeoutError``, so
    code that waits with ``asyncio.wait_for`` handles both the same way."""


class PublishFailed(BusError):
    """A JetStream publish that failed past its retry budget (the connection closed, no stream)."""


class PublishRefused(PublishFailed):
    """The server answered a JetStream publish with an error: ``code`` is its HTTP-like status,
    ``err_code`` JetStream's own number (e.g. 10071: a conditional publish whose subject moved on)."""

    def __init__(self, message: str, code: int | None = None, err_code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.err_code = err_code
