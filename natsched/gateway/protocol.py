"""OpenAI request bodies in, response bodies and stream chunks out. Pure: no I/O.

Accepted and used: ``model``, ``prompt`` (a string, a one-string array, or token ids),
``messages`` (rendered by :mod:`natsched.wire.chat`, the template every path shares), ``max_tokens`` / ``max_completion_tokens``,
``stream``, ``stream_options.include_usage``, ``n`` (1 only). Refused with a 400 naming the
field: multiple prompts, ``n`` > 1, ``echo``, ``logprobs``, ``best_of`` > 1, tools. Sampling
fields (``temperature``, ``top_p``, ``stop``, ``seed``, penalties, ``user``) are accepted and
ignored: workers sample with their engine's settings. Unknown fields are ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from natsched.gateway.errors import BadRequest
from natsched.wire import chat
from natsched.wire.errors import ChatError
from natsched.wire.schema import MAX_TOKEN_ID

CHAT, COMPLETION = "chat", "completion"
MAX_MODEL_NAME = 256
#: the default bound on token ids in one prompt (``GatewaySettings.max_prompt_token_ids``)
MAX_PROMPT_TOKEN_IDS = 131072


@dataclass
class Inference:
    """One validated inference call, ready to become a bus Request."""

    kind: str  # chat | completion
    model: str
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    system_prompt: str | None = None


def parse(kind: str, body: Any, default_max_tokens: int, max_tokens_limit: int,
          max_token_ids: int = MAX_PROMPT_TOKEN_IDS) -> Inference:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip() or len(model) > MAX_MODEL_NAME:
        raise BadRequest("'model' is required: a non-empty string naming a served model (GET /v1/models)",
                         code="invalid_model", param="model")
    inf = Inference(kind=kind, model=model, max_tokens=_max_tokens(kind, body, default_max_tokens, max_tokens_limit))
    inf.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object", code="invalid_type", param="stream_options")
        inf.include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    _refuse_unsupported(body)
    if kind == CHAT:
        try:
            inf.system_prompt, inf.prompt = chat.render(body.get("messages"))
        except ChatError as exc:
            raise BadRequest(str(exc), code=exc.code, param=exc.param) from None
    else:
        inf.prompt, inf.prompt_token_ids = _prompt(body.get("prompt"), max_token_ids)
    return inf


def _max_tokens(kind: str, body: dict, default: int, limit: int) -> int:
    name = "max_completion_tokens" if kind == CHAT and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise BadRequest(f"'{name}' must be an integer from 1 to {limit}, got {value!r}",
                         code="invalid_max_tokens", param=name)
    return value


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{param or name}' must be true or false, got {value!r}", code="invalid_type",
                         param=param or name)
    return value


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest("only n=1 is supported", code="unsupported_parameter", param="n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise BadRequest("only best_of=1 is supported", code="unsupported_parameter", param="best_of")
    for name in ("echo", "logprobs", "top_logprobs", "tools", "functions", "suffix"):
        value = body.get(name)
        if value not in (None, False, [], 0, ""):
            raise BadRequest(f"'{name}' is not supported by this gateway", code="unsupported_parameter", param=name)


def _prompt(prompt: Any, max_token_ids: int) -> tuple[str | None, list[int] | None]:
    """A string, token ids, or a one-element array of either (OpenAI's batch form with one
    prompt): unwrapped once, never recursively (a prompt of 1,000 nested arrays is a 400, not a
    RecursionError)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return None, token_ids(prompt, max_token_ids)
        if len(prompt) > 1 and all(isinstance(x, (str, list)) for x in prompt):
            raise BadRequest("one prompt per request: send an array of several prompts as separate requests",
                             code="unsupported_parameter", param="prompt")
    raise BadRequest("'prompt' is required: a string, or an array of token ids", code="invalid_prompt",
                     param="prompt")


def token_ids(ids: list[int], limit: int) -> list[int]:
    """Token ids as the engines take them: at most ``limit``, each in ``0 .. MAX_TOKEN_ID``."""
    if len(ids) > limit:
        raise BadRequest(f"a prompt of {len(ids)} token ids is over the limit of {limit}", code="invalid_prompt",
                         param="prompt")
    if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        raise BadRequest(f"token ids must be integers from 0 to {MAX_TOKEN_ID}", code="invalid_prompt",
                         param="prompt")
    return list(ids)


# --- responses ---------------------------------------------------------------------------


def finish_reason(engine_reason: str | None) -> str:
    """OpenAI knows ``stop`` and ``length``; anything else an engine says ends as ``stop``."""
    return "length" if engine_reason == "length" else "stop"


def object_id(kind: str, request_id: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + request_id


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(inf: Inference, request_id: str, created: int, text: str, reason: str | None,
                  prompt_tokens: int, output_tokens: int, cached_tokens: int, worker: str | None) -> dict[str, Any]:
    if inf.kind == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason(reason)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
        obj = "text_completion"
    return {"id": object_id(inf.kind, request_id), "object": obj, "created": created, "model": inf.model,
            "choices": [choice], "usage": usage(prompt_tokens, output_tokens, cached_tokens),
            "system_fingerprint": worker}


def chunk(inf: Inference, request_id: str, created: int, text: str | None = None, reason: str | None = None,
          first: bool = False, usage_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: a text delta, the final ``finish_reason`` (``reason`` set), or the usage."""
    if usage_body is not None:
        choices: list[dict[str, Any]] = []
    elif inf.kind == CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else {}
        if text and not first:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None,
                    "finish_reason": finish_reason(reason) if reason is not None else None}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None,
                    "finish_reason": finish_reason(reason) if reason is not None else None}]
    out = {"id": object_id(inf.kind, request_id),
           "object": "chat.completion.chunk" if inf.kind == CHAT else "text_completion",
           "created": created, "model": inf.model, "choices": choices}
    if usage_body is not None:
        out["usage"] = usage_body
    return out


def models_body(models: dict[str, bool], created: int | None = None,
                cards: dict[str, dict] | None = None) -> dict[str, Any]:
    """The OpenAI model list, with vLLM's entry fields (``root``, ``parent``, ``max_model_len``):
    from the engine server's own entry where a worker fronts one (``cards``), else natsched's."""
    created = int(time.time()) if created is None else created
    cards = cards or {}
    data = []
    for m, ready in sorted(models.items()):
        entry = {"id": m, "object": "model", "created": created, "owned_by": "natsched", "root": m, "parent": None,
                 "max_model_len": None}
        entry.update({k: v for k, v in cards.get(m, {}).items() if v is not None or k == "parent"})
        entry["ready"] = ready
        data.append(entry)
    return {"object": "list", "data": data}
