"""``natsched bench codec``: what decoding and validating one message costs, natsched's own
validator (:mod:`natsched.wire.validate`) against msgspec's typed msgpack decoder.

Why measure: every message on the bus is decoded and validated once per hop (about 17 messages
per request, issue 27), so its cost is a floor under the scheduler's CPU per request. msgspec
(what vLLM uses for its KV events) decodes msgpack straight into typed structs in C. The
contenders decode the *same bytes* and refuse the same malformed input here: the msgspec
structs mirror the request's and the reply's fields, their wire names, the id rule (as a
pattern) and the cross-field checks that matter on the hot path (prompt or token ids; the
reply subject's shape is checked by the same Python function after decoding, as today).
Timed with ``time.perf_counter`` over many repetitions, best of several rounds.
"""

from __future__ import annotations

import time
from typing import Annotated, Callable

import msgspec

from natsched.wire.errors import MessageError
from natsched.wire.ids import ID_PATTERN
from natsched.wire.schema import Reply, ReplyKind, ReplyStatus, Request
from natsched.wire.subjects import reply_allowed

Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN.pattern)]


class RequestStruct(msgspec.Struct, omit_defaults=True):
    id: Id
    tenant: Id
    cls: str = msgspec.field(name="class", default="online")
    model: str = "default"
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    system_prompt: str | None = None
    kb_version: str | None = None
    max_tokens: int = 128
    expected_output_tokens: int | None = None
    deadline: float | None = None
    reply: str | None = None
    stream: bool = False
    degradable: bool = False
    created: float | None = None
    v: int = 1

    def __post_init__(self) -> None:
        if self.prompt is None and self.prompt_token_ids is None:
            raise ValueError("missing required field 'prompt' (or 'prompt_token_ids')")
        if self.reply is not None and not reply_allowed(self.reply, self.tenant):
            raise ValueError("field 'reply' must be one of the tenant's reply subjects")


class ReplyStruct(msgspec.Struct, omit_defaults=True):
    request_id: Id
    kind: ReplyKind
    status: ReplyStatus | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    index: int | None = None
    worker: str | None = None
    v: int = 1


def samples() -> dict[str, tuple[type, type, bytes]]:
    """The messages timed: (natsched schema, msgspec struct, the encoded bytes)."""
    text = Request(id="req-0123456789", tenant="acme", cls="online", model="llama-3.1-8b",
                   prompt="Explain KV caches in two sentences. " * 20, system_prompt="You are a tutor. " * 30,
                   max_tokens=256, reply="resp.acme.req-0123456789", stream=True, created=1.7e9)
    ids = Request(id="req-0123456790", tenant="acme", cls="online", prompt_token_ids=list(range(100, 4100)),
                  max_tokens=64)
    token = Reply(request_id="req-0123456789", kind=ReplyKind.TOKEN, text=" the", token_ids=[279], index=17,
                  worker="w3")
    return {"request (text)": (Request, RequestStruct, text.encode()),
            "request (4k token ids)": (Request, RequestStruct, ids.encode()),
            "reply (one token)": (Reply, ReplyStruct, token.encode())}


def _best(fn: Callable[[], object], n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best


def run_codec_benchmark(n: int = 20_000, rounds: int = 5) -> list[dict]:
    """Per message: microseconds to decode and validate, both ways, and the ratio."""
    rows = []
    for name, (schema, struct, data) in samples().items():
        decoder = msgspec.msgpack.Decoder(struct)
        ours = _best(lambda: schema.decode(data), n, rounds)
        theirs = _best(lambda: decoder.decode(data), n, rounds)
        rows.append({"message": name, "bytes": len(data), "natsched_us": ours * 1e6, "msgspec_us": theirs * 1e6,
                     "speedup": ours / theirs})
    return rows


def refusals() -> dict[str, tuple[bool, bool]]:
    """Malformed inputs: (natsched refuses, msgspec refuses) for each, so the comparison is fair."""
    bad = {
        "not msgpack": b"\xc1",
        "id with a dot": msgspec.msgpack.encode({"id": "a.b", "tenant": "t", "prompt": "x"}),
        "no prompt": msgspec.msgpack.encode({"id": "a", "tenant": "t"}),
        "max_tokens a string": msgspec.msgpack.encode({"id": "a", "tenant": "t", "prompt": "x", "max_tokens": "9"}),
        "foreign reply subject": msgspec.msgpack.encode({"id": "a", "tenant": "t", "prompt": "x",
                                                         "reply": "$KV.inflight.usage"}),
    }
    decoder = msgspec.msgpack.Decoder(RequestStruct)
    out = {}
    for name, data in bad.items():
        out[name] = (_refused(lambda: Request.decode(data), MessageError),
                     _refused(lambda: decoder.decode(data), (msgspec.DecodeError, msgspec.ValidationError)))
    return out


def _refused(fn: Callable[[], object], errors) -> bool:
    try:
        fn()
    except errors:
        return True
    return False


def codec_table(rows: list[dict]) -> str:
    lines = [f"{'message':<24}{'bytes':>7}{'natsched µs':>13}{'msgspec µs':>12}{'ratio':>7}"]
    for r in rows:
        lines.append(f"{r['message']:<24}{r['bytes']:>7}{r['natsched_us']:>13.2f}{r['msgspec_us']:>12.2f}"
                     f"{r['speedup']:>7.1f}")
    return "\n".join(lines)
