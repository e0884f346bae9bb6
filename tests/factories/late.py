"""A TCP proxy in front of a real nats-server that makes JetStream reads see the server "ahead".

Why: a consumer's messages and the answer to a later API request travel on one connection, but
the server may write the answer first: ``consumer info`` then says nothing is pending while the
client has not seen a message yet. That is the window in which nats-py's ``kv.keys()`` /
``kv.history()`` / ``kv.watch()`` decide a bucket is done (nats-io/nats.py#842). On an idle
machine it almost never opens; this proxy holds it open on purpose, so a test can show a reader
does not depend on it. Two things are held back, everything else passes at once and in order:

- server to client, every JetStream delivery (a ``MSG``/``HMSG`` whose reply subject is a
  ``$JS.ACK.`` one), by ``delay_s``: the server has sent it, the client has not seen it;
- client to server, every consumer-info request, by ``info_delay_s``: by the time the server
  answers it, the consumer has pushed what it had, so the answer reports nothing pending.

Nothing is dropped unless ``delay_s`` is None: then deliveries never arrive, and a reader must
fail rather than report an empty bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

#: fields of a message's first line without a reply subject (MSG subject sid size; HMSG subject
#: sid header-size total-size; PUB subject size; HPUB subject header-size total-size)
_PLAIN = {b"MSG": 4, b"HMSG": 5, b"PUB": 3, b"HPUB": 4}


def _frames(buf: bytearray):
    """Complete protocol frames at the front of ``buf`` (removed from it): (frame, first line's
    fields, reply subject or b"")."""
    while True:
        end = buf.find(b"\r\n")
        if end < 0:
            return
        parts = bytes(buf[:end]).split()
        if not parts or parts[0].upper() not in _PLAIN:  # INFO, CONNECT, PING, PONG, SUB, +OK...: one line
            frame = bytes(buf[:end + 2])
            del buf[:end + 2]
            yield frame, parts, b""
            continue
        size = int(parts[-1])
        if len(buf) < end + 2 + size + 2:
            return  # the payload is not all here yet
        frame = bytes(buf[:end + 2 + size + 2])
        del buf[:end + 2 + size + 2]
        op = parts[0].upper()
        reply = parts[3 if op in (b"MSG", b"HMSG") else 2] if len(parts) > _PLAIN[op] else b""
        yield frame, parts, reply


def _delivery(parts: list[bytes], reply: bytes) -> bool:
    return reply.startswith(b"$JS.ACK.")


def _info_request(parts: list[bytes], reply: bytes) -> bool:
    return len(parts) > 1 and parts[0].upper() in (b"PUB", b"HPUB") and b".CONSUMER.INFO." in parts[1]


class LateDeliveries:
    """``async with LateDeliveries(nats_url) as url:`` connect to ``url``; ``held`` counts the
    deliveries held back (a test can check the proxy did its job)."""

    def __init__(self, upstream: str, delay_s: float | None = 0.3, info_delay_s: float = 0.1) -> None:
        host, port = upstream.rsplit("//", 1)[-1].rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.delay_s, self.info_delay_s = delay_s, info_delay_s
        self.held = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self._spawn(self._pipe(reader, up_writer, _info_request, self.info_delay_s))
        self._spawn(self._pipe(up_reader, writer, _delivery, self.delay_s))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    late: Callable[[list[bytes], bytes], bool], delay_s: float | None) -> None:
        """Copy ``reader`` to ``writer`` frame by frame, the ``late`` ones ``delay_s`` later."""
        held: asyncio.Queue = asyncio.Queue()
        self._spawn(self._release(held, writer, delay_s))
        buf = bytearray()
        try:
            while data := await reader.read(65536):
                buf += data
                for frame, parts, reply in _frames(buf):
                    if late(parts, reply):
                        self.held += late is _delivery
                        held.put_nowait((asyncio.get_running_loop().time(), frame))
                    else:
                        writer.write(frame)
                await writer.drain()
        finally:
            writer.close()

    @staticmethod
    async def _release(held: asyncio.Queue, writer: asyncio.StreamWriter, delay_s: float | None) -> None:
        while True:
            arrived, frame = await held.get()
            if delay_s is None:
                continue  # never delivered
            wait = arrived + delay_s - asyncio.get_running_loop().time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(frame)
