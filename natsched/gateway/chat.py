"""The chat template: OpenAI ``messages`` -> (system prompt, prompt). Pure and deterministic.

Template ``natsched-chat-v1`` (documented in the README; change the name if you change it)::

    system_prompt = "<|system|>\\n{content}\\n"  for each *leading* system/developer message
    prompt        = "<|{role}|>\\n{content}\\n"  for every later message, in order
                  + "<|assistant|>\\n"         (the model answers from here)

Why leading system messages go to ``Request.system_prompt``: the router keys its prefix
affinity on the stable prefix (system prompt first), and workers hash the same text, so every
conversation behind one system prompt lands where that prefix is already cached. The worker
concatenates system prompt and prompt, so the engine sees exactly the text above. A system or
developer message later in a conversation is rendered inline with the ``system`` tag.

Roles: ``system``, ``developer`` (treated as ``system``), ``user``, ``assistant``. ``tool`` and
``function`` are refused (the gateway does no tool calling); anything else is an invalid role.
Content is a string or a list of ``{"type": "text", "text": ...}`` parts (joined with no
separator); other part types (images, audio) are refused.
"""

from __future__ import annotations

from typing import Any

from natsched.gateway.errors import BadRequest

TEMPLATE = "natsched-chat-v1"
ROLES = ("system", "developer", "user", "assistant")
_TAG = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def render(messages: Any) -> tuple[str | None, str]:
    """(system_prompt or None, prompt) for a validated ``messages`` list; 400 on anything else."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of {role, content} objects",
                         code="invalid_messages", param="messages")
    system: list[str] = []
    turns: list[str] = []
    for i, message in enumerate(messages):
        role, text = _message(message, i)
        block = f"<|{_TAG[role]}|>\n{text}\n"
        if _TAG[role] == "system" and not turns:
            system.append(block)
        else:
            turns.append(block)
    turns.append("<|assistant|>\n")
    return ("".join(system) or None), "".join(turns)


def _message(message: Any, i: int) -> tuple[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with 'role' and 'content'", code="invalid_messages", param=where)
    role = message.get("role")
    if role in ("tool", "function"):
        raise BadRequest(f"{where}: role '{role}' is not supported (this gateway does no tool calling)",
                         code="unsupported_role", param=f"{where}.role")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(f"{where}: invalid role {role!r}; expected one of {', '.join(ROLES)}",
                         code="invalid_role", param=f"{where}.role")
    if message.get("tool_calls") or message.get("function_call"):
        raise BadRequest(f"{where}: tool calls are not supported", code="unsupported_parameter", param=where)
    return role, _content(message.get("content"), where, role)


def _content(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise BadRequest(f"{where}: 'content' is required", code="invalid_messages", param=f"{where}.content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                                 code="unsupported_content", param=f"{where}.content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where}: 'content' must be a string or an array of text parts",
                     code="invalid_messages", param=f"{where}.content")
