"""Chat templates: a conversation rendered into the exact text (and ids) the model was tuned on.

An instruction-tuned model was trained on conversations laid out in one exact text format
(ChatML's ``<|im_start|>user ... <|im_end|>`` for SmolLM2). The model ships that format as
a Jinja2 template (GGUF key ``tokenizer.chat_template``); rendering it exactly as Hugging
Face's ``apply_chat_template`` does is what makes the model answer like an assistant.

Templates come from model files, so they are rendered in Jinja2's immutable sandbox: a
template cannot touch Python objects beyond the messages it is given.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

from lucidlm.errors import GenerationError, TokenizerError

# Used when a model has no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Message = dict[str, str]


def chat_template_of(tokenizer: Any) -> str:
    """The tokenizer's own template, or ChatML when it has none."""
    return getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE


def render_chat(messages: list[Message], template: Optional[str] = None, *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """The conversation as the text the model reads (``add_generation_prompt`` ends it with
    the opening of the assistant's turn, so the model's continuation is the answer)."""
    import jinja2

    _check_messages(messages)
    compiled = _compile(template or CHATML_TEMPLATE)
    try:
        # tools/documents are None like in transformers: templates test them with `if tools`.
        values = {"tools": None, "documents": None, **extra}
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **values)
    except jinja2.TemplateError as exc:
        raise GenerationError(f"the chat template failed to render: {exc}") from exc


def render_chat_for(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = True) -> str:
    """``render_chat`` with the tokenizer's template and its BOS/EOS strings."""
    return render_chat(messages, chat_template_of(tokenizer), add_generation_prompt=add_generation_prompt,
                       bos_token=_special_string(tokenizer, "bos"), eos_token=_special_string(tokenizer, "eos"))


def encode_chat(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
    """Render and encode, with the template's special tokens (``<|im_start|>``) as their ids."""
    if tokenizer is None:
        raise GenerationError("chat needs a tokenizer with a chat template, but model.tokenizer is None.")
    text = render_chat_for(tokenizer, messages, add_generation_prompt)
    try:
        return list(tokenizer.encode(text, allowed_special=True))
    except TypeError:  # tokenizers without the allowed_special option always parse specials
        return list(tokenizer.encode(text))


# ---------------------------------------------------------------------- internals
@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The same environment transformers builds for apply_chat_template.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise GenerationError(f"the chat template is not valid Jinja2 (line {exc.lineno}: {exc.message}).") from exc


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise GenerationError(f"the chat template refused the conversation: {message}")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise GenerationError("messages must be a list of {'role': str, 'content': str} dicts.")


def _special_string(tokenizer: Any, role: str) -> str:
    """The text of the BOS/EOS token ("<|im_start|>"), or "" when there is none."""
    name = getattr(tokenizer, f"{role}_token", None)
    if isinstance(name, str):
        return name
    token_id = getattr(tokenizer, f"{role}_id", None)
    if token_id is None:
        return ""
    try:
        return tokenizer.id_to_token(token_id)
    except (AttributeError, TokenizerError):
        return ""
