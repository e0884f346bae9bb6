"""``natsched bench codec``: what decoding and validating one message costs.

Why measure: every message on the bus is decoded and validated once per hop (``natsched bench
stored`` counts the messages a request stores), so its cost is a floor under the scheduler's CPU
per request. The schema engine (:mod:`natsched.wire.validate`) decodes with msgspec into a typed
struct derived from the message's dataclass, then builds the dataclass and runs the message's own
checks. Three columns per message, on the same bytes:

- ``msgpack``: ``msgpack.unpackb`` alone, no check at all (where the hand-written engine that
  msgspec replaced started; it then walked every field in Python: 1.7-6.8x msgspec's cost);
- ``natsched``: ``Schema.decode``, what every service runs;
- ``struct``: msgspec's typed decode alone (the engine's first step, no dataclass, no id checks).

``encode`` is ``Schema.encode``. The malformed inputs are checked to be refused first (a fast
decoder that accepts them would be no contender). Timed with ``time.perf_counter`` over many
repetitions, best of several rounds.
"""

from __future__ import annotations

import time
from typing import Callable

import msgpack
import msgspec

from natsched.wire.errors import MessageError
from natsched.wire.schema import Reply, ReplyKind, Request, Schema


def samples() -> dict[str, tuple[type[Schema], bytes]]:
    """The messages timed: (natsched schema, the encoded bytes)."""
    text = Request(id="req-0123456789", tenant="acme", cls="online", model="llama-3.1-8b",
                   prompt="Explain KV caches in two sentences. " * 20, system_prompt="You are a tutor. " * 30,
                   max_tokens=256, reply="resp.acme.req-0123456789", stream=True, created=1.7e9)
    ids = Request(id="req-0123456790", tenant="acme", cls="online", prompt_token_ids=list(range(100, 4100)),
                  max_tokens=64)
    token = Reply(request_id="req-0123456789", kind=ReplyKind.TOKEN, text=" the", token_ids=[279], index=17,
                  worker="w3")
    return {"request (text)": (Request, text.encode()),
            "request (4k token ids)": (Request, ids.encode()),
            "reply (one token)": (Reply, token.encode())}


def _best(fn: Callable[[], object], n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best


def run_codec_benchmark(n: int = 20_000, rounds: int = 5) -> list[dict]:
    """Per message: microseconds to decode unchecked, to decode and validate, and to encode."""
    rows = []
    for name, (schema, data) in samples().items():
        decoder = schema._engine().decoder
        msg = schema.decode(data)
        unchecked = _best(lambda: msgpack.unpackb(data, raw=False), n, rounds)
        ours = _best(lambda: schema.decode(data), n, rounds)
        struct = _best(lambda: decoder.decode(data), n, rounds)
        rows.append({"message": name, "bytes": len(data), "msgpack_us": unchecked * 1e6, "natsched_us": ours * 1e6,
                     "struct_us": struct * 1e6, "encode_us": _best(msg.encode, n, rounds) * 1e6,
                     "checked_vs_unchecked": ours / unchecked})
    return rows


def refusals() -> dict[str, str | None]:
    """Malformed inputs: the engine's refusal of each (None: accepted, which the command fails on)."""
    bad = {
        "not msgpack": b"\xc1",
        "id with a dot": msgspec.msgpack.encode({"id": "a.b", "tenant": "t", "class": "c", "prompt": "x"}),
        "no prompt": msgspec.msgpack.encode({"id": "a", "tenant": "t", "class": "c"}),
        "max_tokens a string": msgspec.msgpack.encode({"id": "a", "tenant": "t", "class": "c", "prompt": "x",
                                                       "max_tokens": "9"}),
        "a token id past 2^31": msgspec.msgpack.encode({"id": "a", "tenant": "t", "class": "c",
                                                        "prompt_token_ids": [1, 2**32]}),
        "foreign reply subject": msgspec.msgpack.encode({"id": "a", "tenant": "t", "class": "c", "prompt": "x",
                                                         "reply": "$KV.inflight.usage"}),
    }
    out: dict[str, str | None] = {}
    for name, data in bad.items():
        try:
            Request.decode(data)
            out[name] = None
        except MessageError as exc:
            out[name] = str(exc)
    return out


def codec_table(rows: list[dict]) -> str:
    lines = [f"{'message':<24}{'bytes':>7}{'msgpack µs':>12}{'natsched µs':>13}{'struct µs':>11}{'encode µs':>11}"]
    for r in rows:
        lines.append(f"{r['message']:<24}{r['bytes']:>7}{r['msgpack_us']:>12.2f}{r['natsched_us']:>13.2f}"
                     f"{r['struct_us']:>11.2f}{r['encode_us']:>11.2f}")
    return "\n".join(lines)
