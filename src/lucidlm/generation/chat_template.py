"""Chat templates: a conversation rendered into the exact text (and ids) the model was tuned on.

An instruction-tuned model was trained on conversations laid out in one exact text format
(ChatML's ``<|im_start|>user ... <|im_end|>`` for SmolLM2). The model ships that format as
a Jinja2 template (GGUF key ``tokenizer.chat_template``); rendering it exactly as Hugging
Face's ``apply_chat_template`` does is what makes the model answer like an assistant.

Templates come from model files, so they are rendered in Jinja2's immutable sandbox (a
template cannot touch Python objects beyond the messages it is given) with limits on time,
size and depth (``template_sandbox.py``). Whatever goes wrong in a template, it is one
``ChatTemplateError`` naming the file the template came from.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

from lucidlm.errors import ChatTemplateError, GenerationError, TokenizerError
from lucidlm.generation.prompt_limits import refuse_past_context
from lucidlm.tokenizers.base import Tokenizer, starts_with_added_bos

# Used when a model has no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Message = dict[str, str]


def chat_template_of(tokenizer: Optional[Tokenizer]) -> str:
    """The tokenizer's own template, or ChatML when it has none (or there is no tokenizer)."""
    return getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE


def render_chat(messages: list[Message], template: Optional[str] = None, *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", source: Optional[str] = None, **extra: Any) -> str:
    """The conversation as the text the model reads (``add_generation_prompt`` ends it with
    the opening of the assistant's turn, so the model's continuation is the answer).
    ``source`` names where the template came from, for error messages. ``**extra``: more
    variables the template reads (``pad_token``, ``tools``, ...), of any type it expects."""
    from lucidlm.generation.template_sandbox import render_bounded

    check_messages(messages, content_may_be_none=True)
    # A key set to None is a key left out, as in transformers (``_normalize_chat_messages``):
    # OpenAI-style messages carry "tool_calls": None, or "content": None when they only call
    # tools, and templates test `'tool_calls' in message` and `if message.content`.
    messages = [_with_reasoning_aliases({key: value for key, value in message.items() if value is not None})
                for message in messages]
    compiled = _compile_or_fail(template or CHATML_TEMPLATE, source)
    # tools/documents are None like in transformers: templates test them with `if tools`.
    values = {"tools": None, "documents": None, **extra, "messages": messages,
              "add_generation_prompt": add_generation_prompt, "bos_token": bos_token, "eos_token": eos_token}
    try:
        text = render_bounded(compiled, values)
    except Exception as exc:  # noqa: BLE001 - the template is a program from a file: all it raises is its fault
        raise ChatTemplateError(_message(source, _problem(exc))) from None
    if messages and not text.strip():
        raise ChatTemplateError(_message(source, "renders the conversation as empty text"))
    return text


def render_chat_for(tokenizer: Tokenizer, messages: list[Message], add_generation_prompt: bool = True) -> str:
    """``render_chat`` with the tokenizer's template and its special-token strings: BOS and EOS,
    and PAD and UNK where the tokenizer has them (transformers passes its special_tokens_map,
    which leaves out the roles a tokenizer lacks, so a template sees them undefined there too)."""
    own = getattr(tokenizer, "chat_template", None)
    optional = {f"{role}_token": _special_string(tokenizer, role) for role in ("pad", "unk")}
    return render_chat(messages, chat_template_of(tokenizer), add_generation_prompt=add_generation_prompt,
                       bos_token=_special_string(tokenizer, "bos"), eos_token=_special_string(tokenizer, "eos"),
                       source=getattr(tokenizer, "chat_template_source", None) if own else None,
                       **{name: text for name, text in optional.items() if text})


def encode_chat(tokenizer: Tokenizer, messages: list[Message], add_generation_prompt: bool = True,
                context: Optional[int] = None) -> list[int]:
    """Render and encode, with the template's special tokens (``<|im_start|>``) as their ids.
    With ``context`` (a model's max_seq_len), a rendered text that cannot fit it is refused
    before it is encoded (``prompt_limits.py``).

    The template writes every special token itself (``{{ bos_token }}`` where the model wants
    one), so the tokenizer's own BOS is not added: transformers' ``apply_chat_template`` encodes
    with ``add_special_tokens=False`` too, and a Llama 3 or Gemma prompt would otherwise start
    with two BOS."""
    if tokenizer is None:
        raise GenerationError("chat needs a tokenizer with a chat template, but model.tokenizer is None.")
    text = render_chat_for(tokenizer, messages, add_generation_prompt)
    if context is not None:
        refuse_past_context(tokenizer, text, context, "the chat prompt")
    try:
        ids = list(tokenizer.encode(text, allowed_special=True))
    except TypeError:  # tokenizers without the allowed_special option always parse specials
        ids = list(tokenizer.encode(text))
    return ids[1:] if starts_with_added_bos(tokenizer, ids) else ids


def check_chat_template(tokenizer: Optional[Tokenizer], system: Optional[str] = None) -> None:
    """Render and encode a first turn, so a chat session the model cannot hold is refused
    before it starts: no tokenizer, a broken template, or a tokenizer that cannot write the
    template's markers (a character-level model trained here has no ``<|im_start|>``)."""
    if tokenizer is None:
        raise GenerationError("this model has no tokenizer, so it cannot chat; use a model that ships one "
                              "(a pretrained name, a .gguf file, or a directory with tokenizer.json).")
    first = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hello"}]
    try:
        encode_chat(tokenizer, first)
    except TokenizerError as exc:
        raise GenerationError(f"this model's tokenizer cannot write its chat template ({exc}); it is not a chat "
                              f"model: continue text with `lucidlm generate` instead.") from None


# ---------------------------------------------------------------------- internals
class _Refused(Exception):
    """raise_exception() called by the template: it does not accept this conversation."""


def _compile_or_fail(template: Any, source: Optional[str]) -> Any:
    from lucidlm.generation.template_sandbox import MAX_TEMPLATE_CHARS

    if not isinstance(template, str):
        raise ChatTemplateError(_message(source, f"is {type(template).__name__}, not text"))
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(_message(source, f"is {len(template)} characters long, more than "
                                                  f"{MAX_TEMPLATE_CHARS} (real ones are a few KB)"))
    try:
        return _compile(template)
    except Exception as exc:  # noqa: BLE001 - Jinja's parser/compiler on untrusted text
        raise ChatTemplateError(_message(source, _problem(exc))) from None


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from jinja2 import nodes

    from lucidlm.generation.template_sandbox import BoundedSandbox, GenerationBlock, TemplateProblem

    # The environment transformers builds for apply_chat_template, with limits.
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlock])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt)[:200])
    tree = env.parse(template)
    for node in tree.find_all((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)):
        tag = {nodes.Extends: "extends", nodes.Include: "include"}.get(type(node), "import")
        raise TemplateProblem(f"uses {{% {tag} %}} (line {node.lineno}), but a chat template must be one "
                              f"self-contained template: lucidlm loads no other template files")
    return env.from_string(tree)


def _problem(exc: Exception) -> str:
    """What the template did, in words, from the exception it raised."""
    import jinja2
    from jinja2.sandbox import SecurityError

    from lucidlm.generation.template_sandbox import MAX_DEPTH, TemplateProblem

    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    if isinstance(exc, TemplateProblem):
        return text
    if isinstance(exc, _Refused):
        return f"refused the conversation: {text}"
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"is not valid Jinja2 (line {exc.lineno}: {text})"
    if isinstance(exc, SecurityError):
        return f"did something the sandbox forbids ({text})"
    if isinstance(exc, jinja2.UndefinedError):
        return f"uses an undefined value ({text})"
    if isinstance(exc, ZeroDivisionError):
        return "divides by zero"
    if isinstance(exc, RecursionError):
        return f"recurses too deeply (more than Python's stack allows; the limit for macros is {MAX_DEPTH})"
    if isinstance(exc, MemoryError):
        return "ran out of memory"
    return f"failed while rendering ({type(exc).__name__}: {text})"


def _message(source: Optional[str], problem: str) -> str:
    where = f"{source}: the chat template" if source else "the chat template"
    fix = (f"Fix the template in {source.split(' (')[0]}, or use a model file whose template works"
           if source else "Fix the template")
    return f"{where} {problem}. {fix}."


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    from lucidlm.generation.template_sandbox import TemplateProblem

    short = lambda v: isinstance(v, str) and len(v) <= 16  # noqa: E731
    if not (indent is None or short(indent) or (isinstance(indent, int) and 0 <= indent <= 16)):
        raise TemplateProblem(f"calls tojson with indent={indent!r}; expected a number from 0 to 16 or a short string")
    if not (separators is None or (isinstance(separators, (list, tuple)) and len(separators) == 2
                                   and all(map(short, separators)))):
        raise TemplateProblem(f"calls tojson with separators={separators!r}; expected two short strings")
    try:
        return json.dumps(value, ensure_ascii=bool(ensure_ascii), indent=indent,
                          separators=tuple(separators) if separators else None, sort_keys=bool(sort_keys))
    except (TypeError, ValueError, RecursionError) as exc:
        raise TemplateProblem(f"calls tojson on a value JSON cannot hold ({' '.join(str(exc).split())[:120]})") \
            from None


def _raise_exception(message: Any) -> None:
    raise _Refused(str(message))


# The names a message's reasoning comes under; templates read the first (Qwen3, DeepSeek-R1) or
# "thinking" (gpt-oss), clients send any of them (vLLM's "reasoning", Ollama's "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(message: dict) -> dict:
    """The message with its reasoning under "reasoning_content" and "thinking" too, as transformers
    passes it (``_alias_reasoning_fields``), so the template finds it under the name it reads."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def check_messages(messages: Any, *, content_may_be_none: bool = False) -> None:
    """Refuse anything but a list of {"role": str, "content": str} dicts; ``content_may_be_none``
    also takes a content of None (or none at all), as an OpenAI message that only calls tools has."""
    contents = (str, type(None)) if content_may_be_none else str
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), contents)
            for m in messages):
        content = "str or None" if content_may_be_none else "str"
        raise GenerationError(f"messages must be a list of {{'role': str, 'content': {content}}} dicts.")


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
