"""``natsched bench codec``: what decoding and validating one message costs, natsched's own
validator (:mod:`natsched.wire.validate`) against msgspec's typed msgpack decoder.

Why measure: every message on the bus is decoded and validated once per hop (about 17 messages
per request, issue 27), so its cost is a floor under the scheduler's CPU per request. msgspec
(what vLLM uses for its KV events) decodes msgpack straight into typed structs in C. The
contenders decode the *same bytes* and refuse the same malformed input here: the msgspec
structs are derived from the schema dataclasses (:func:`struct_for`: fields, wire names,
defaults, the id rule as a pattern) and run the schema's own cross-field checks after decoding.
Timed with ``time.perf_counter`` over many repetitions, best of several rounds.
"""

from __future__ import annotations

import dataclasses
import time
import typing
from typing import Annotated, Callable

import msgspec

from natsched.wire.errors import MessageError
from natsched.wire.ids import ID_PATTERN, RequestId, TenantId, WorkerId
from natsched.wire.schema import Reply, ReplyKind, Request

Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN.pattern)]
_IDS = (RequestId, TenantId, WorkerId)


def _hint(tp):
    """A field's annotation for msgspec: ids carry their pattern (also inside ``X | None``)."""
    if tp in _IDS:
        return Id
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [_hint(a) for a in args if a is not type(None)]
        return typing.Optional[rest[0]] if len(rest) == 1 else typing.Union[(*rest, None)]
    return tp


def struct_for(schema: type) -> type:
    """A msgspec struct with the schema's fields, wire names, defaults and id rule, derived from
    the dataclass itself (so it cannot drift from the schema), whose ``__post_init__`` runs the
    schema's own cross-field checks on it."""
    hints = typing.get_type_hints(schema)
    fields, rename = [], {}
    for f in dataclasses.fields(schema):
        tp = _hint(hints[f.name])
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, tp, f.default))
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            fields.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, tp))
        if "wire" in f.metadata:
            rename[f.name] = f.metadata["wire"]
    check = getattr(schema, "__post_init_check__", None)

    def post_init(self) -> None:
        if check is not None:
            try:
                check(self)
            except MessageError as exc:
                raise ValueError(str(exc)) from None

    return msgspec.defstruct(f"{schema.__name__}Struct", fields, rename=rename or None,
                             namespace={"__post_init__": post_init})


RequestStruct = struct_for(Request)
ReplyStruct = struct_for(Reply)


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
