"""Errors raised by the bus layer.

Every error here derives from :class:`BusError`, so a caller can catch the whole family::

    BusError
    ├── MessageError            a message that cannot be used (never retried)
    │   ├── DecodeError         bytes that are not valid msgpack / not a map / oversize
    │   └── SchemaError         a decoded map with a missing or mistyped field
    ├── ConnectError            the NATS server could not be reached within the budget
    ├── ServerError             the embedded nats-server could not be run
    │   └── PortInUseError      its port is already taken
    ├── ProvisionError          a stream or bucket exists with an incompatible config
    ├── ConflictError           a compare-and-swap lost: the key changed since it was read
    ├── SnapshotError           (natsched.bus.snapshot) a bucket read that stopped arriving
    ├── BatchError              (natsched.bus.batch) a batch that cannot be submitted or read
    │   ├── BatchFileError      the batch file cannot be read (bad lines are reported, not raised)
    │   ├── NotFound            no such batch or job
    │   └── JobStoreError       the jobs bucket holds something unusable
    ├── AuditError              (natsched.bus.audit) an audit that cannot be answered
    │   └── AuditNotFound       no record of that request within the retention
    └── RequestError            a producer-side request did not end in a result
        ├── RequestTimeout      a wait ran out (publish ack, admission, first token, result)
        ├── DuplicateRequest    the request id was already accepted within the dedup window
        ├── Rejected            admission refused it (reason code + retry_after)
        └── RequestFailed       it was admitted but failed (no worker, engine error, ...)
"""

from __future__ import annotations


class BusError(Exception):
    """Root of every bus-layer error."""


class MessageError(BusError):
    """A message that cannot be used; handlers dead-letter it instead of retrying."""

    code = "invalid"


class DecodeError(MessageError):
    """Bytes that are not a msgpack map (or are larger than allowed)."""

    code = "malformed"


class SchemaError(MessageError):
    """A decoded message with a missing or mistyped field; ``field`` names it."""

    code = "invalid"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ConnectError(BusError):
    """The NATS server could not be reached within the connect budget."""


class ServerError(BusError):
    """The embedded nats-server could not be started or stopped."""


class PortInUseError(ServerError):
    """The embedded server's port is already taken by another process."""


class ProvisionError(BusError):
    """A stream or bucket could not be created or updated to the expected config."""


class ConflictError(BusError):
    """A conditional KV write lost the race: re-read and decide again."""


class RequestError(BusError):
    """A request that did not end in a result; ``request_id`` says which."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class RequestTimeout(RequestError):
    """A wait ran out; the message names the stage (publish, admission, result)."""


class DuplicateRequest(RequestError):
    """The id was already accepted within the dedup window; it is answered once."""


class Rejected(RequestError):
    """Admission refused the request: ``reason`` is a code, ``retry_after`` seconds."""

    def __init__(self, message: str, request_id: str | None, reason: str, retry_after: float | None) -> None:
        super().__init__(message, request_id)
        self.reason = reason
        self.retry_after = retry_after


class RequestFailed(RequestError):
    """Admitted but not completed: ``reason`` is a code (``no_worker``, ``engine_error`` ...)."""

    def __init__(self, message: str, request_id: str | None, reason: str) -> None:
        super().__init__(message, request_id)
        self.reason = reason


class SnapshotError(BusError):
    """A windowed bucket read (``natsched.bus.snapshot``) got nothing for its stall time with messages pending."""
