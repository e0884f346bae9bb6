"""The gateway's socket-level defences: what a connection may cost before it is an API call.

What uvicorn offers and what it lacks (uvicorn 0.3x-0.5x, its httptools protocol):

- an idle timeout between requests (``timeout_keep_alive``): used, as ``idle_timeout_s``;
- ``limit_concurrency``: a 503 once N connections *or* tasks exist, but only after a request's
  headers have arrived, and the connection stays open: 1,500 sockets that never finish their
  headers are all held (slowloris). Not used: :class:`EdgeProtocol` refuses a connection over
  ``max_connections`` as it is accepted, with one 503 written and the socket closed, before a
  byte is parsed;
- no timeout for the headers (a new connection that sends nothing, or a byte a second, is held
  for ever: the keep-alive timer only starts after a first response) and none for the body (a
  ``Content-Length: 700000`` followed by silence holds the handler and its socket): added, as
  ``header_timeout_s`` (from the connection, or from the first byte of a later request on it,
  to the end of the headers: 408) and ``body_timeout_s`` (from the end of the headers to the
  end of the body: 408, or the connection closed if an answer had begun);
- no bound on the size of the headers with httptools (h11 has
  ``h11_max_incomplete_event_size``): added, ``max_header_bytes`` (431).

Each refusal is one short JSON body in OpenAI's error format, ``Connection: close``, and a
count in ``natsched_gateway_shed_total{reason}``; nothing is logged per refusal (a flood of
them must not become a flood of log lines).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: reasons counted in ``natsched_gateway_shed_total``
SHED_CONNECTIONS = "connections"
SHED_HEADER_TIMEOUT = "header_timeout"
SHED_BODY_TIMEOUT = "body_timeout"
SHED_HEADER_SIZE = "header_too_large"


@dataclass
class EdgeLimits:
    """The per-connection limits :class:`EdgeProtocol` enforces (from :class:`GatewaySettings`)."""

    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 32 * 1024
    shed: Callable[[str], None] = lambda reason: None  # counts a refusal (the gateway's metrics)


def raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error answer, written straight to the socket (no ASGI app involved)."""
    body = orjson.dumps({"error": {"message": message, "type": "service_unavailable" if status == 503
                                   else "invalid_request_error", "param": None, "code": code}})
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            + ("retry-after: 1\r\n" if status == 503 else "") + "connection: close\r\n\r\n")
    return head.encode() + body


#: bytes of a body that may arrive in the same reads as the headers (uvicorn reads 64 KiB at a time)
_READ_SLACK = 64 * 1024

_FULL = raw_response(503, "Service Unavailable", "too many connections to this gateway; retry shortly",
                     "too_many_connections")
_HEAD_SLOW = raw_response(408, "Request Timeout", "the request headers did not arrive in time", "header_timeout")
_BODY_SLOW = raw_response(408, "Request Timeout", "the request body did not arrive in time", "body_timeout")
_HEAD_BIG = raw_response(431, "Request Header Fields Too Large", "the request headers are too large",
                         "header_too_large")


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection limit, header and body deadlines, and a
    header size bound (see the module docstring). ``config.natsched_edge`` holds the limits."""

    def __init__(self, config: Any, server_state: Any, app_state: dict, _loop: Any = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.edge: EdgeLimits = config.natsched_edge
        self._timer: asyncio.TimerHandle | None = None
        self._raw_head = 0  # bytes received since the request began (headers not complete)
        self._parsed_head = 0  # bytes of request line and headers the parser has seen
        self._in_head = True
        self._refused = False

    # --- the connection -----------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        if len(self.connections) >= self.edge.max_connections:
            self._refused = True  # never counted as a connection, never parsed
            self.edge.shed(SHED_CONNECTIONS)
            transport.write(_FULL)
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self.edge.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self.transport.is_closing():
            return
        if self._in_head:
            # httptools buffers a header until it is complete: bound the raw bytes too (with room
            # for the start of a body that came in the same read)
            self._raw_head += len(data)
            if self._raw_head > self.edge.max_header_bytes + _READ_SLACK:
                self._refuse(_HEAD_BIG, SHED_HEADER_SIZE)
                return
        super().data_received(data)

    # --- parser callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._raw_head, self._parsed_head = True, 0, 0
        if self._timer is None:  # a later request on a kept-alive connection: its headers are timed too
            self._arm(self.edge.header_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return
        self._in_head = False
        self._disarm()
        super().on_headers_complete()
        self._arm(self.edge.body_timeout_s, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None and not self.transport.is_closing():
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        if self.cycle is not None and not self.transport.is_closing():
            super().on_message_complete()

    # --- limits ---------------------------------------------------------------------------
    def _count_head(self, n: int) -> None:
        self._parsed_head += n
        if self._parsed_head > self.edge.max_header_bytes and not self.transport.is_closing():
            self._refuse(_HEAD_BIG, SHED_HEADER_SIZE)

    def _head_timed_out(self) -> None:
        self._timer = None
        self._refuse(_HEAD_SLOW, SHED_HEADER_TIMEOUT)

    def _body_timed_out(self) -> None:
        self._timer = None
        started = self.cycle is not None and self.cycle.response_started
        self._refuse(b"" if started else _BODY_SLOW, SHED_BODY_TIMEOUT)

    def _refuse(self, answer: bytes, reason: str) -> None:
        if self.transport.is_closing():
            return
        self.edge.shed(reason)
        if answer:
            self.transport.write(answer)
        self.transport.close()  # connection_lost tells a waiting handler: http.disconnect

    def _arm(self, seconds: float, handler: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, handler)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
