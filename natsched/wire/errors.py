"""Errors of the wire contract: bytes or maps that are not a natsched message.

::

    WireError
    ├── IdError                 an id that is not one subject token (also a ValueError)
    ├── ChatError               chat messages the template cannot render (also a ValueError)
    └── MessageError            a message that cannot be used (never retried)
        ├── DecodeError         bytes that are not valid msgpack / not a map / oversize
        └── SchemaError         a decoded map with a missing or mistyped field
"""

from __future__ import annotations

from natsched.errors import NatschedError


class WireError(NatschedError):
    """Root of every wire-contract error."""


class IdError(WireError, ValueError):
    """An id (tenant, worker, request, batch, ...) that is not one subject token; ``what`` names
    the kind. A ``ValueError`` too: it is a bad argument to a subject builder."""

    def __init__(self, message: str, what: str = "token") -> None:
        super().__init__(message)
        self.what = what


class ChatError(WireError, ValueError):
    """Chat messages :mod:`natsched.wire.chat` cannot render; ``code`` is OpenAI-style
    (``invalid_role``, ``unsupported_content``, ...) and ``param`` names the message at fault."""

    def __init__(self, message: str, code: str = "invalid_messages", param: str | None = "messages") -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class MessageError(WireError):
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
