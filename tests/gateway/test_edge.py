"""The gateway's edge sheds before a socket costs a bus round trip: raw sockets and curl against a
real gateway (uvicorn on loopback) on a real nats-server.

Slowloris (headers that never end), a body that never ends, too many sockets, oversized headers,
a key over its limit of calls in flight, clients that drop mid-body, /status without the status
key, and the open mode's cross-site and rebinding requests: each gets its refusal, and the
gateway's shed counter says why. Every wait is on an event (an answer, an end of file), never a
sleep: the deadlines are set short so the refusals come quickly.
"""

from __future__ import annotations

import asyncio
import base64
import logging

import orjson
import pytest

from natsched.gateway.keys import Principal
from natsched.wire import codec
from natsched.wire.errors import SchemaError
from natsched.wire.schema import MAX_TOKEN_ID, Request
from tests.factories.core import wait_for
from tests.factories.gateway import ALPHA, BETA, KEYS, start_gateway
from tests.gateway.test_input import curl

OPS = "sk-ops-status-0123456789"


def shed(gw, reason: str) -> float:
    return gw.gateway.metrics.registry.get_sample_value("natsched_gateway_shed_total", {"reason": reason}) or 0.0


async def connect(gw) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = gw.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, everything up to the end of the connection): the gateway closes after a refusal."""
    data = await asyncio.wait_for(reader.read(), 30)
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split()[1]), data


def head(path: str = "/v1/completions", *, length: int | None = None, host: str = "127.0.0.1",
         extra: str = "", key: str | None = ALPHA, ctype: str = "application/json") -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Type: {ctype}"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


@pytest.fixture
async def keyed(bus, nats_url):
    gw = await start_gateway(nats_url, keys={**KEYS, OPS: {"tenant": "ops", "status": True}},
                             header_timeout_s=0.5, body_timeout_s=0.5, max_connections=20, max_per_key=1,
                             max_header_bytes=4096, max_prompt_token_ids=10)
    try:
        yield gw
    finally:
        await gw.close()


@pytest.fixture
async def open_gw(bus, nats_url):
    gw = await start_gateway(nats_url, open_tenant="open", allowed_origins=("http://app.example",))
    try:
        yield gw
    finally:
        await gw.close()


# --- the socket -------------------------------------------------------------------------------
async def test_slowloris_sockets_get_408_and_are_closed(keyed):
    socks = [await connect(keyed) for _ in range(10)]
    for _, writer in socks:  # a request line and one header, then nothing
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        await writer.drain()
    silent, silent_writer = await connect(keyed)  # and one that never sends a byte (held: a dropped writer closes)
    for reader, _ in socks:
        status, body = await answer(reader)
        assert status == 408 and b'"header_timeout"' in body
    assert (await answer(silent))[0] == 408
    assert shed(keyed, "header_timeout") == 11
    assert await wait_for(lambda: not keyed.server.server_state.connections)


async def test_a_body_that_never_ends_gets_408(keyed):
    reader, writer = await connect(keyed)
    writer.write(head(length=1000) + b'{"model": "default", "prompt": "')
    await writer.drain()
    status, body = await answer(reader)
    assert status == 408 and b'"body_timeout"' in body
    assert shed(keyed, "body_timeout") == 1


async def test_sockets_over_the_limit_are_refused_as_they_are_accepted(keyed):
    held = [await connect(keyed) for _ in range(20)]
    assert await wait_for(lambda: len(keyed.server.server_state.connections) == 20)
    reader, writer = await connect(keyed)  # the 21st: answered before it sends anything
    status, body = await answer(reader)
    assert status == 503 and b'"too_many_connections"' in body and b"retry-after: 1" in body
    assert shed(keyed, "connections") == 1
    for _, writer in held:
        writer.close()


async def test_oversized_headers_get_431(keyed):
    reader, writer = await connect(keyed)
    writer.write(head(length=2, extra=f"X-Filler: {'a' * 8000}\r\n") + b"{}")
    await writer.drain()
    assert (await answer(reader))[0] == 431
    assert shed(keyed, "header_too_large") == 1


# --- per key --------------------------------------------------------------------------------
async def test_a_key_over_its_calls_in_flight_gets_429_before_its_body_is_read(keyed):
    slow_reader, slow = await connect(keyed)  # alpha's one call in flight: its body is still coming
    slow.write(head(length=100, key=ALPHA) + b'{"model"')
    await slow.drain()
    assert await wait_for(lambda: keyed.gateway._in_flight.get(_key(ALPHA)) == 1)
    status, headers, payload = await curl(keyed.url + "/v1/completions", key=ALPHA, body=b"{}")
    assert status == 429 and headers["retry-after"] == "1"
    assert orjson.loads(payload)["error"]["code"] == "too_many_concurrent_requests"
    status, _, payload = await curl(keyed.url + "/v1/completions", key=BETA, body=b'{"model": "m", "prompt": "x"}')
    assert status == 503, payload  # another key is not limited by alpha's (no worker serves: 503)
    assert shed(keyed, "per_key") == 1
    assert (await answer(slow_reader))[0] == 408  # the slow body runs out of time; its slot is given back
    assert await wait_for(lambda: _key(ALPHA) not in keyed.gateway._in_flight)


def _key(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()[:16]


async def test_a_client_that_drops_mid_body_is_one_quiet_line(keyed, caplog):
    caplog.set_level(logging.INFO)
    for _ in range(3):
        _, writer = await connect(keyed)
        writer.write(head(length=500) + b'{"model": "default", "pro')
        await writer.drain()
        writer.close()
    assert await wait_for(lambda: shed(keyed, "client_abort") == 3)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not keyed.gateway._in_flight


# --- input bounds ---------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, code", [
    ("[" * 1000 + "1" + "]" * 1000, "invalid_prompt"),  # was a RecursionError: 500 with a traceback
    ("[" * 2000 + "]" * 2000, "invalid_json"),  # deeper than the parser goes
    (f"[{MAX_TOKEN_ID + 1}]", "invalid_prompt"),
    ("[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]", "invalid_prompt"),  # over max_prompt_token_ids
    ("[[1, 2], [3]]", "unsupported_parameter"),
])
async def test_hostile_prompts_are_400s(keyed, prompt, code):
    body = b'{"model": "default", "prompt": ' + prompt.encode() + b"}"
    status, _, payload = await curl(keyed.url + "/v1/completions", key=BETA, body=body)
    assert status == 400 and orjson.loads(payload)["error"]["code"] == code


def test_the_wire_refuses_token_ids_no_engine_has():
    def decoded(ids):  # as a service decodes what a producer (or a batch line) published
        return Request.decode(codec.encode({"v": 1, "id": "r1", "tenant": "t", "class": "online",
                                            "prompt_token_ids": ids}))

    assert decoded([0, MAX_TOKEN_ID]).prompt_token_ids == [0, MAX_TOKEN_ID]
    for bad in ([MAX_TOKEN_ID + 1], [-1], [2**63]):
        with pytest.raises(SchemaError, match="prompt_token_ids"):
            decoded(bad)


# --- /status --------------------------------------------------------------------------------
async def test_status_on_a_keyed_gateway_needs_the_status_key(keyed):
    for path in ("/status", "/status.json"):
        status, headers, _ = await curl(keyed.url + path, key=None)
        assert status == 401 and headers["www-authenticate"].startswith("Basic")
        assert (await curl(keyed.url + path, key=ALPHA))[0] == 403  # a tenant's key: not every tenant's usage
        assert (await curl(keyed.url + path, key=OPS))[0] == 200
        basic = base64.b64encode(f"ops:{OPS}".encode()).decode()
        assert (await curl(keyed.url + path, key=None, headers={"Authorization": f"Basic {basic}"}))[0] == 200


def test_open_principal_counts_as_one_key():
    assert Principal("a", "online", key="x") == Principal("a", "online", key="y")  # keys do not change who


# --- the open mode: CSRF and DNS rebinding ----------------------------------------------------
async def test_open_mode_refuses_cross_site_and_rebound_requests(open_gw):
    body = b'{"model": "default", "prompt": "hi"}'

    async def raw(data: bytes) -> tuple[int, bytes]:
        reader, writer = await connect(open_gw)
        writer.write(data)
        await writer.drain()
        status_line = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        return int(status_line.split()[1]), status_line

    text_plain = head(length=len(body), key=None, ctype="text/plain") + body  # a "simple" cross-site POST
    assert (await raw(text_plain))[0] == 415
    evil_origin = head(length=len(body), key=None, extra="Origin: http://evil.example\r\n") + body
    assert (await raw(evil_origin))[0] == 403
    status, _, payload = await curl(open_gw.url + "/v1/completions", key=None, body=body,
                                    headers={"Host": "rebind.evil.example:8000"})
    assert status == 403 and orjson.loads(payload)["error"]["code"] == "host_not_allowed"
    status, _, _ = await curl(open_gw.url + "/status.json", key=None, headers={"Host": "rebind.evil.example"})
    assert status == 403
    # what is allowed still passes: same host, an allowed origin, localhost (503: no worker serves yet)
    ok_origin = head(length=len(body), key=None, extra="Origin: http://app.example\r\n") + body
    assert (await raw(ok_origin))[0] == 503
    assert (await curl(open_gw.url + "/v1/completions", key=None, body=body, headers={"Host": "localhost:1"}))[0] == 503
    assert (await curl(open_gw.url + "/status.json", key=None))[0] == 200


def test_the_edge_flags_become_settings_and_bad_ones_are_refused():
    from natsched.gateway.errors import ConfigError
    from natsched.cli.gateway import settings_from_args
    from tests.gateway.test_input import gateway_args

    settings, _ = settings_from_args(gateway_args(
        "--insecure-open", "--max-connections", "50", "--header-timeout", "2", "--body-timeout", "3",
        "--idle-timeout", "4", "--max-per-key", "5", "--allowed-host", "box.lan", "--allowed-origin",
        "http://app:3000"))
    assert (settings.max_connections, settings.header_timeout_s, settings.body_timeout_s, settings.idle_timeout_s,
            settings.max_per_key) == (50, 2, 3, 4, 5)
    assert settings.allowed_hosts == ("box.lan",) and settings.allowed_origins == ("http://app:3000",)
    with pytest.raises(ConfigError, match="positive"):
        settings_from_args(gateway_args("--insecure-open", "--header-timeout", "0"))
