"""A prompt too long for the context, refused before it is tokenized.

Tokenizing costs memory in proportion to the text: a 13 MB prompt took 3.3 GB and seconds to
encode into 10.9 M ids, only to be refused for them (``request.fit_to_context``). The fewest
ids a text can encode to (``Tokenizer.fewest_tokens``: its UTF-8 bytes over the longest
token's, where the tokenizer spells the text out) is a bound that costs one pass over the
text; a prompt whose bound already overflows the context cannot fit, whatever its ids.
"""

from __future__ import annotations

from typing import Any

from lucidlm.errors import GenerationError


def refuse_past_context(tokenizer: Any, text: str, context: int, what: str = "the prompt") -> None:
    """GenerationError if ``text`` needs more than ``context`` tokens whatever it encodes to;
    nothing for a text that may fit (its exact length is ``fit_to_context``'s to check)."""
    if 4 * len(text) <= context:  # the bound is at most the bytes, 4 a character at most: no refusal
        return
    fewest_tokens = getattr(tokenizer, "fewest_tokens", None)
    fewest = fewest_tokens(text) if fewest_tokens is not None else 0
    if fewest > context:
        raise GenerationError(f"{what} is at least {fewest} tokens ({len(text)} characters), longer than the "
                              f"model's context of {context} tokens (max_seq_len); shorten it.")
