"""The one wire codec: msgpack maps, with a typed error for anything else.

Why msgpack: compact for token-id lists (ints pack in 1-5 bytes, JSON needs ~6 chars each)
and fast in C. Every message on the bus is a map; a payload that is not one is a
:class:`DecodeError`, never an ``AttributeError`` three frames later.
"""

from __future__ import annotations

from typing import Any

import msgpack

from natsched.wire.errors import DecodeError

#: Default ceiling for one message; nats-server's own default max_payload is 1 MiB.
MAX_MESSAGE_BYTES = 1024 * 1024


def encode(obj: dict[str, Any]) -> bytes:
    """Encode a map. Raises ``TypeError`` for values msgpack cannot carry (a programming error)."""
    return msgpack.packb(obj, use_bin_type=True)


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Decode one message into a map, or raise :class:`DecodeError` saying why not."""
    if len(data) > max_bytes:
        raise DecodeError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    if not data:
        raise DecodeError("empty message")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise DecodeError(f"not valid msgpack: {exc}") from None
    except Exception as exc:  # msgpack raises a few odd ones (e.g. UnpackValueError subclasses)
        raise DecodeError(f"not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"expected a map, got {type(obj).__name__}")
    return obj
