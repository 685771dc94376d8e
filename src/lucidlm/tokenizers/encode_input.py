"""What ``Tokenizer.encode`` accepts and how special tokens are cut out of the text first.

``check_text`` refuses what no tokenizer can encode (a non-str, a lone surrogate).
``split_chunks`` cuts text into the pre-tokenizer regex's chunks (BPE encoding and training).
``allowed_special`` decides whether a special token's name in the text is that one id or
ordinary text (tiktoken's choice, because scraped text can hold ``<|endoftext|>``):
``allowed_special_set`` turns the argument into names, and ``split_on_special`` cuts those
names out of the text. Shared by every tokenizer (``base.py``, ``pretrained.py``) and by the
BPE trainer, which must never merge across a special token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from typing import Any, Union

from lucidlm.errors import TokenizerError
from lucidlm.suggest import did_you_mean
from lucidlm.validation import first_surrogate

# True: every special token is recognised; False or an empty set: none is; a set: only those.
# "all" is accepted as a synonym of True so tiktoken-style calls work unchanged.
AllowedSpecial = Union[bool, set[str], frozenset[str], str]

# How many special token names an error message lists: Gemma 3 has 6,249, all of them 99 KB.
NAMES_SHOWN = 20


def check_text(text: object, caller: str = "encode()") -> None:
    """Refuse what no tokenizer can encode: a non-str, or a str holding a lone surrogate (Python
    makes those from bytes that were not UTF-8, e.g. argv or a file read with surrogateescape).
    Trainers check their corpus with it too (``caller``): what encode refuses, no merge may learn."""
    if not isinstance(text, str):
        raise TokenizerError(f"{caller} takes a str, got {type(text).__name__}")
    at = first_surrogate(text)
    if at is not None:
        raise TokenizerError(f"the text is not valid Unicode: a lone surrogate {text[at]!r} at character {at} "
                             f"(usually a byte that was not UTF-8); decode the input as UTF-8 (e.g. "
                             f"errors='replace') or remove it.")


def allowed_special_set(allowed_special: AllowedSpecial, special_tokens: dict[str, int]) -> set[str]:
    """The special token names ``allowed_special`` lets ``encode`` turn into their ids."""
    if allowed_special is True or allowed_special == "all":
        return set(special_tokens)
    if allowed_special is False:
        return set()
    if isinstance(allowed_special, str):  # a lone name would iterate by characters
        raise TokenizerError(
            f"allowed_special={allowed_special!r}: pass True, False, 'all' or a set "
            f"of special token names"
        )
    unknown = set(allowed_special) - set(special_tokens)
    if unknown:
        raise TokenizerError(
            f"allowed_special names {list_names(unknown)}, which are not special tokens of "
            f"this tokenizer; known: {list_names(special_tokens)}"
            f"{did_you_mean(str(min(unknown, key=str)), special_tokens)}"
        )
    return set(allowed_special)


def list_names(names: Iterable[str]) -> str:
    """Names for an error message, sorted: all of them when few, else the first ``NAMES_SHOWN``
    and how many there are."""
    ordered = sorted(names, key=str)  # (a caller's wrong set may hold non-str)
    if len(ordered) <= NAMES_SHOWN:
        return str(ordered)
    shown = ", ".join(map(repr, ordered[:NAMES_SHOWN]))
    return f"[{shown}, ...] ({len(ordered):,} in all)"


def check_special_names(names: Iterable[str]) -> list[str]:
    """The special-token names as a list, refused if one repeats or is empty (the empty string
    would match between every two characters and cut all text apart)."""
    if isinstance(names, str):  # one name would iterate by characters: "<eos>" -> "<", "e", ...
        raise TokenizerError(f"special_tokens must be a list of names, e.g. [{names!r}], not one str {names!r}")
    names = list(names)
    if len(set(names)) != len(names):
        raise TokenizerError(f"special_tokens repeat a name: {names!r}")
    if any(not isinstance(name, str) or not name for name in names):
        raise TokenizerError(f"special_tokens must be non-empty strings; got {names!r}. Drop the empty name.")
    return names


def split_chunks(split_regex: Any, text: str) -> list[str]:
    """The chunks ``split_regex`` (a compiled pre-tokenizer pattern) cuts ``text`` into: each
    whole match, as tiktoken and Hugging Face's ``Split`` take them. ``findall`` gives those
    only for a pattern without capturing groups: with one (``('s|'t)|...``) it returns the
    group's text, '' where the group did not take part, and tuples for two groups. Text no
    match covers is dropped, as tiktoken drops it: a pattern must match every character to
    encode any text."""
    if split_regex.groups == 0:
        return split_regex.findall(text)  # the same whole matches, ~1.3x faster than finditer
    return [match[0] for match in split_regex.finditer(text)]


def compile_special_regex(names: Iterable[str]) -> re.Pattern[str] | None:
    """One regex matching any of ``names``, or None for no names. Longest first, so that a
    special token which is a prefix of another never wins. Cached per set of names."""
    return _special_regex_for(frozenset(names))


@lru_cache(maxsize=32)
def _special_regex_for(names: frozenset[str]) -> re.Pattern[str] | None:
    ordered = sorted(names, key=lambda name: (-len(name), name))
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def split_on_special(
    text: str, allowed: set[str], special_regex: re.Pattern[str] | None = None
) -> Iterator[tuple[int, str, bool]]:
    """Cut the special tokens named in ``allowed`` out of ``text``.

    Yields (start offset, piece, is_special) covering ``text`` in order; pieces between
    specials may be empty. ``special_regex`` must match exactly the names in ``allowed`` (a
    tokenizer's one regex for all its specials, when all are allowed): one that also matched
    a longer, disallowed name would hide an allowed one inside it (``<|a|>`` in ``<|a|>2``).
    """
    if special_regex is None:
        special_regex = compile_special_regex(allowed)
    if not allowed or special_regex is None:
        yield 0, text, False
        return
    pos = 0
    for match in special_regex.finditer(text):
        yield pos, text[pos : match.start()], False
        yield match.start(), match.group(), True
        pos = match.end()
    yield pos, text[pos:], False
