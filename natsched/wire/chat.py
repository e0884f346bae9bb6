"""The one chat template: OpenAI-style ``messages`` -> (system prompt, prompt). Pure and deterministic.

Every path that turns a conversation into a request renders it here: the HTTP gateway
(``/v1/chat/completions``), batch lines with ``messages`` (:mod:`natsched.client.batch`) and the
Python client (``make_request(tenant, messages=...)``). The router keys cache affinity on the
rendered text and workers hash the same text (:mod:`natsched.wire.blocks`), so one conversation
renders to one block-hash chain whichever way it came in, and all of them share KV cache.

Template ``natsched-chat-v2``::

    system_prompt = "<|system|>\\n{content}\\n"  for each *leading* system/developer message
    prompt        = "<|{role}|>\\n{content}\\n"  for every later message, in order
                  + "<|assistant|>\\n"         (the model answers from here)

Why leading system messages go to ``Request.system_prompt``: it is the stable prefix, so every
conversation behind one system prompt lands where that prefix is cached. The worker
concatenates system prompt and prompt, so the engine sees exactly the text above. A system or
developer message later in a conversation is rendered inline with the ``system`` tag.

Content cannot forge a role: the template's tags are the only ``<|`` in the output, because every
``<|`` inside content is written ``<\\|`` (v2; v1 rendered content as it was, so a user typing
``<|system|>`` could open a system turn of their own).

Roles: ``system``, ``developer`` (treated as ``system``), ``user``, ``assistant``. ``tool`` and
``function`` are refused (natsched does no tool calling); anything else is an invalid role.
Content is a string or a list of ``{"type": "text", "text": ...}`` parts (joined with no
separator); other part types (images, audio) are refused. Errors are :class:`ChatError` with an
OpenAI-style ``code`` and the ``param`` at fault, which the gateway answers as a 400.
"""

from __future__ import annotations

from typing import Any

from natsched.wire.errors import ChatError

TEMPLATE = "natsched-chat-v2"
ROLES = ("system", "developer", "user", "assistant")
REFUSED_ROLES = ("tool", "function")
_TAG = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
OPEN, ESCAPED = "<|", "<\\|"


def tag(role: str) -> str:
    """The tag a turn of ``role`` opens with: ``<|user|>\\n``."""
    return f"{OPEN}{_TAG[role]}|>\n"


def escape(text: str) -> str:
    """Content as the template writes it: no ``<|`` of its own, so no tag can be forged."""
    return text.replace(OPEN, ESCAPED) if OPEN in text else text


def render(messages: Any, system_prompt: str | None = None) -> tuple[str | None, str]:
    """(system prompt or None, prompt) of a conversation; :class:`ChatError` on anything malformed.

    ``system_prompt`` (a batch line's or the Python client's field) is a leading system message
    before ``messages``.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty array of {role, content} objects", "invalid_messages",
                        "messages")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ChatError("'system_prompt' must be a string", "invalid_type", "system_prompt")
    system: list[str] = [] if system_prompt is None else [tag("system") + escape(system_prompt) + "\n"]
    turns: list[str] = []
    for i, message in enumerate(messages):
        role, text = _message(message, i)
        block = tag(role) + escape(text) + "\n"
        if _TAG[role] == "system" and not turns:
            system.append(block)
        else:
            turns.append(block)
    turns.append(tag("assistant"))
    return ("".join(system) or None), "".join(turns)


def _message(message: Any, i: int) -> tuple[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ChatError(f"{where} must be an object with 'role' and 'content'", "invalid_messages", where)
    role = message.get("role")
    if role in REFUSED_ROLES:
        raise ChatError(f"{where}: role '{role}' is not supported (natsched does no tool calling)",
                        "unsupported_role", f"{where}.role")
    if not isinstance(role, str) or role not in ROLES:
        raise ChatError(f"{where}: invalid role {role!r}; expected one of {', '.join(ROLES)}", "invalid_role",
                        f"{where}.role")
    if message.get("tool_calls") or message.get("function_call"):
        raise ChatError(f"{where}: tool calls are not supported", "unsupported_parameter", where)
    return role, _content(message.get("content"), where)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise ChatError(f"{where}: 'content' is required", "invalid_messages", f"{where}.content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                                "unsupported_content", f"{where}.content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatError(f"{where}: 'content' must be a string or an array of text parts", "invalid_messages",
                    f"{where}.content")
