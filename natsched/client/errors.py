"""Errors a producer sees: a request or a batch that did not end well.

::

    ClientError
    ├── ClientSettingsError     a bad Timeouts or Retry value (nothing is sent)
    ├── RequestError            a request that did not end in a result
    │   ├── RequestTimeout      a wait ran out (``reason``: publish, admission, queued, idle, ttft, total)
    │   ├── DuplicateRequest    the request id was already accepted within the dedup window
    │   ├── Rejected            admission refused it (reason code + retry_after)
    │   └── RequestFailed       it was admitted but failed (no worker, engine error, ...)
    └── BatchError              a batch that cannot be submitted or read
        ├── BatchFileError      the batch file cannot be read (bad lines are reported, not raised)
        ├── NotFound            no such batch or job
        └── JobStoreError       the jobs bucket holds something unusable
"""

from __future__ import annotations

from natsched.errors import NatschedError


class ClientError(NatschedError):
    """Root of every producer-side error."""


class RequestError(ClientError):
    """A request that did not end in a result; ``request_id`` says which."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class ClientSettingsError(ClientError, ValueError):
    """A Timeouts or Retry value that makes no sense; raised before anything is sent."""


class RequestTimeout(RequestError):
    """A wait ran out; the message names the stage, ``reason`` says which limit: ``publish``,
    ``admission``, ``queued``, ``idle`` (the stage waits), ``ttft``, ``total``, ``stream_idle``
    (the request's own limits)."""

    def __init__(self, message: str, request_id: str | None = None, reason: str = "timeout") -> None:
        super().__init__(message, request_id)
        self.reason = reason


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


class BatchError(ClientError):
    """A batch that cannot be submitted or read."""


class BatchFileError(BatchError):
    """The batch file cannot be read at all (bad lines are reported, not raised)."""


class NotFound(BatchError):
    """No such batch or job."""


class JobStoreError(BatchError):
    """The jobs bucket holds something that is not a job record."""
