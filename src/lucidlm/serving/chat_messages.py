"""The chat's ``messages`` in OpenAI's shape, checked and turned into the plain
``{"role", "content"}`` dicts lucidlm's chat templates render (``generation/chat_template.py``).

Content is a string or a list of ``{"type": "text", "text": ...}`` parts, joined as they are
(the templates that take parts themselves concatenate their texts). ``developer`` is OpenAI's
newer name for ``system``, which is what the templates know. Images, audio, files and tool
calls are refused by name: the model reads and writes text only.
"""

from __future__ import annotations

from typing import Any

from lucidlm.serving.api_errors import RequestError
from lucidlm.serving.request_fields import shown
from lucidlm.suggest import did_you_mean

ROLES = ("system", "developer", "user", "assistant")
MESSAGE_FIELDS = ("role", "content", "name")
_TOOLS = "tool calling is not supported: lucidlm serve answers in plain text"
REFUSED_FIELDS = {"tool_calls": _TOOLS, "tool_call_id": _TOOLS, "function_call": _TOOLS,
                  "audio": "audio is not supported: the model reads and writes text only"}
REFUSED_ROLES = {"tool": _TOOLS, "function": _TOOLS}


def template_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as the chat template's ``[{"role", "content"(, "name")}]``."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f'messages={shown(messages)} is invalid: expected a non-empty list of messages, e.g. '
                           f'[{{"role": "user", "content": "Hello"}}].', param="messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise RequestError(f'{where}={shown(message)} is invalid: expected an object such as {{"role": "user", '
                           f'"content": "Hello"}}.', param="messages")
    message = {key: value for key, value in message.items() if value is not None}
    for key in message:
        if key in REFUSED_FIELDS:
            raise RequestError(f"{where}.{key} is not supported: {REFUSED_FIELDS[key]}.", param="messages")
        if key not in MESSAGE_FIELDS:
            raise RequestError(f"unknown field {where}.{key}{did_you_mean(key, MESSAGE_FIELDS) or ''}; a message "
                               f"has {', '.join(MESSAGE_FIELDS)}.", param="messages")
    role = message.get("role")
    if role in REFUSED_ROLES:
        raise RequestError(f"{where}.role={shown(role)} is not supported: {REFUSED_ROLES[role]}.", param="messages")
    if role not in ROLES:
        hint = did_you_mean(role, ROLES) if isinstance(role, str) else ""
        raise RequestError(f"{where}.role={shown(role)} is invalid{hint or ''}; use one of {', '.join(ROLES)}.",
                           param="messages")
    if "content" not in message:
        raise RequestError(f"{where} has no content; give its text as \"content\".", param="messages")
    rendered = {"role": "system" if role == "developer" else role, "content": _text(message["content"], where)}
    if "name" in message:
        if not isinstance(message["name"], str):
            raise RequestError(f"{where}.name={shown(message['name'])} is invalid: expected a string.",
                               param="messages")
        rendered["name"] = message["name"]
    return rendered


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or the texts of its parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content={shown(content)} is invalid: expected a string or a list of "
                           f'{{"type": "text", "text": ...}} parts.', param="messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if isinstance(kind, str) else shown(part)
            raise RequestError(f"{where}.content[{j}] is {what}; lucidlm serve takes text parts only, "
                               f'{{"type": "text", "text": ...}} (the model reads no images, audio or files).',
                               param="messages")
        texts.append(part["text"])
    return "".join(texts)
