"""A long text through a Hugging Face ``tokenizers`` backend a piece at a time, with the ids that
one call over the whole text gives.

The backend's ``encode`` holds a whole text's working state at once: alignments per byte, a
string and offsets per token. For SmolLM2's tokenizer that peaked at ~135 bytes of memory per
byte of text (a 10 MB file: 1.7 GB; a 50 MB corpus for ``lucidlm perplexity`` or training:
~8.5 GB), on one thread. Cut where the backend's pre-tokenizer always splits, the pieces give
the ids the whole text gives, so they are encoded a few at a time (``encode_batch``: the
backend's threads share them) and only their ids are kept.

Where every supported pre-tokenizer splits (``CUT``): after a newline that follows a visible
ASCII character and comes before an ASCII letter. Byte-level BPE never merges across a split,
and the pre-tokenizer's regex (GPT-2's, or one of ``VOUCHED_SPLITS`` in
``gguf_tokenizer.PRE_TOKENIZER_SPLITS``: Llama 3, Qwen 2 and 3.5, GPT-4o, tekken) has no
lookbehind or anchor, so from the cut on it matches the same chunks with or without the text
before. Before the cut, in each regex no chunk runs from a newline into a letter
(``\\s+(?!\\S)`` and ``\\s*[\\r\\n]+`` stop at it; a letter run takes no newline before it;
a punctuation run's ``[\\r\\n]*`` tail ends at it), and
the newline, following a character that is not whitespace, is a whitespace run of one: in the
piece, where the text ends after it, it is the same chunk. After a space or ``\\r`` it would not
be (``" \\n"`` at the end of a piece is one chunk, but ``" "`` and ``"\\n"`` before a letter), so
such newlines are not cuts; nor is any place in a text without newlines before letters, which is
then encoded whole.

Which backends (``cuts_safely``): BPE with no dropout, whose pre-tokenizer is one of those
regexes followed by ByteLevel (or ByteLevel with GPT-2's regex), without a prefix space; no
normalizer but NFC (which composes nothing across a newline); no added token holding a newline
(special tokens are found before the pre-tokenizer runs) or taking the spaces on its left. Any
other backend (sentencepiece: each piece would get the leading "▁" of a text's start) encodes
whole.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

from lucidlm.tokenizers.gguf_tokenizer import PRE_TOKENIZER_SPLITS

# The GGUF pre-tokenizer names whose regexes (gguf_tokenizer.PRE_TOKENIZER_SPLITS) the docstring's
# reasoning was checked for, with GPT-2's own; a regex added to that table is not trusted until it is
# added here (and thereby to tests/tokenizers/test_long_text.py's random texts)
VOUCHED_SPLITS = ("llama-bpe", "qwen2", "qwen35", "gpt-4o", "tekken")
LONG_TEXT_CHARS = 1 << 18  # texts up to this long go in one call (a piece costs ~60 us more)
PIECE_CHARS = 1 << 16  # characters per piece, at least: each is cut at the first CUT past this
PIECES_AT_ONCE = 8  # pieces per encode_batch call: ~70 MB of the backend's working state for SmolLM2's
CUT = re.compile(r"(?<=[!-~]\n)(?=[A-Za-z])")  # a newline after a visible ASCII character, before a letter


def cuts_safely(backend: Any) -> bool:
    """Whether ``backend`` (a ``tokenizers.Tokenizer``) gives the same ids for a text and for its
    pieces cut at ``CUT`` (module docstring)."""
    if type(backend.model).__name__ != "BPE" or backend.model.dropout:
        return False
    normalizer = _spec(backend.normalizer)
    if normalizer and normalizer.get("type") != "NFC":
        return False
    pre = _spec(backend.pre_tokenizer)
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1:
        regex_ok = steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex") is True
    else:
        split, last = steps if len(steps) == 2 else ({}, {})
        regex_ok = (split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
                    and split.get("pattern", {}).get("Regex") in {PRE_TOKENIZER_SPLITS[n] for n in VOUCHED_SPLITS}
                    and last.get("type") == "ByteLevel" and last.get("use_regex") is False)
    if not regex_ok or steps[-1].get("add_prefix_space"):
        return False
    # A token flagged normalized is matched in the NFC text, as its content made NFC: one whose
    # decomposed form starts with an ASCII letter (the Kelvin sign "\u212a" is "K"; "é" is "e" and
    # U+0301) can start at a line's first letter ("Kelvin", or "e" and U+0301 that NFC makes "é")
    # and, with lstrip, take the newline before it in the whole text but not at a piece's start.
    added = backend.get_added_tokens_decoder().values()
    contents = [(t.content, t.lstrip) for t in added]
    if normalizer:
        contents += [(unicodedata.normalize("NFD", t.content), t.lstrip) for t in added if t.normalized]
    return not any("\n" in content or (lstrip and content[:1].isascii() and content[:1].isalpha())
                   for content, lstrip in contents)


def pieces(text: str, size: int) -> list[str]:
    """``text`` cut at the first ``CUT`` at or after every ``size`` characters of a piece; the
    pieces join back to ``text``."""
    if size < 1:
        raise ValueError(f"pieces of {size} characters: give at least 1")
    parts, start = [], 0
    while len(text) - start > size:
        cut = CUT.search(text, start + size)
        if cut is None:
            break
        parts.append(text[start:cut.start()])
        start = cut.start()
    parts.append(text[start:])
    return parts


def encode_in_pieces(backend: Any, text: str) -> list[int]:
    """``backend.encode(text, add_special_tokens=False).ids``, for a backend that
    ``cuts_safely``, holding the working state of ``PIECES_AT_ONCE`` pieces at most."""
    parts, ids = pieces(text, PIECE_CHARS), []
    for first in range(0, len(parts), PIECES_AT_ONCE):
        for encoding in backend.encode_batch(parts[first:first + PIECES_AT_ONCE], add_special_tokens=False):
            ids += encoding.ids
    return ids


def _spec(component: Any) -> dict[str, Any]:
    """A backend component's settings, as its tokenizer.json would hold them ({} for None)."""
    return {} if component is None else json.loads(component.__getstate__())
