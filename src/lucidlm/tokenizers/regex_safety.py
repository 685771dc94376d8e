"""Refusing tokenizer regexes that backtrack catastrophically, before any text meets them.

A ``tokenizer.json`` carries regexes (the pre-tokenizer's ``Split`` pattern, a normalizer's
``Replace``) that the ``tokenizers`` library runs with Oniguruma. A pattern that nests
unbounded quantifiers, like ``(a+)+$``, takes exponential time on a string such as
``aaaa...b``; Oniguruma stops at its retry limit and the library *panics* (a Rust panic
with a backtrace on stderr). The classic sign is a quantified group whose body can itself
repeat without bound ("star height" above one); real pre-tokenizer regexes (GPT-2, Llama 3,
Qwen 2, GPT-4o) never have one. ``nested_quantifier`` finds it; the rarer overlapping
alternation (``(a|aa)+``) is caught when it panics (see ``HFTokenizer``).
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

from lucidlm.errors import TokenizerError


def check_backend_regexes(backend: Any, source: str) -> None:
    """Refuse a backend whose pre-tokenizer or normalizer regexes nest unbounded quantifiers."""
    for part in ("pre_tokenizer", "normalizer"):
        component = getattr(backend, part, None)
        if component is None:
            continue
        for pattern in _regexes(json.loads(component.__getstate__())):
            problem = nested_quantifier(pattern)
            if problem:
                raise TokenizerError(
                    f"{source}: the {part.replace('_', '-')} regex {_short(pattern)} repeats {problem}, which "
                    f"backtracks exponentially on some text (a ReDoS pattern); real tokenizers never do. Use the "
                    f"model's original tokenizer.json.")


def nested_quantifier(pattern: str) -> Optional[str]:
    """The group (as text) that repeats without bound around another unbounded repeat, or None."""
    stack: list[list[Any]] = []  # [start index, holds an unbounded repeat]
    i, n = 0, len(pattern)
    last_group: Optional[tuple[int, bool]] = None  # the group that just closed: (start, unbounded inside)
    while i < n:
        char = pattern[i]
        if char == "\\":
            i, last_group = i + 2, None
            continue
        if char == "[":
            i, last_group = _skip_class(pattern, i), None
            continue
        if char == "(":
            stack.append([i, False])
            last_group = None
        elif char == ")" and stack:
            start, inner = stack.pop()
            last_group = (start, inner)
            if inner and stack:  # the enclosing group holds that repeat too
                stack[-1][1] = True
            i += 1
            continue
        else:
            width = _unbounded_quantifier(pattern, i)
            if width:
                if last_group is not None and last_group[1]:
                    return pattern[last_group[0]:i + width]
                if stack:
                    stack[-1][1] = True
                i, last_group = i + width, None
                continue
            if char not in "?{":
                last_group = None
        i += 1
    return None


def _unbounded_quantifier(pattern: str, i: int) -> int:
    """Length of the quantifier at ``i`` if it has no upper bound (``+``, ``*``, ``{n,}``), else 0."""
    char = pattern[i]
    if char in "+*":
        return 2 if i + 1 < len(pattern) and pattern[i + 1] in "?+" else 1
    if char == "{":
        end = pattern.find("}", i)
        body = pattern[i + 1:end] if end > 0 else ""
        if body.endswith(",") and body[:-1].isdigit():
            return end - i + 1
    return 0


def _skip_class(pattern: str, i: int) -> int:
    """The index just past the character class opening at ``i`` (classes may nest in Oniguruma)."""
    depth = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            depth += 1
            if pattern.startswith("]", i + 1) or pattern.startswith("^]", i + 1):
                i += 2 if pattern[i + 1] == "]" else 3  # a leading ] is a literal
                continue
        elif char == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _regexes(spec: Any) -> Iterator[str]:
    """Every ``{"Regex": pattern}`` inside a component's JSON."""
    if isinstance(spec, dict):
        for key, value in spec.items():
            if key == "Regex" and isinstance(value, str):
                yield value
            else:
                yield from _regexes(value)
    elif isinstance(spec, list):
        for value in spec:
            yield from _regexes(value)


def _short(pattern: str) -> str:
    return repr(pattern) if len(pattern) <= 80 else repr(pattern[:77] + "...")
