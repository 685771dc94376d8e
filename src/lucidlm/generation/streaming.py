"""Turning a stream of token ids into a stream of text, safely.

Three things make this more than ``decode(id)`` per token:

- A token's text can depend on the token before it: a word-level tokenizer puts a space
  between words, so "the" after "Love" adds " the", not "the". Each token's bytes are what
  decoding it *after its predecessor* adds, so the text always equals decoding all the ids
  at once, minus the prompt's text.
- A byte-level token can hold half of a multi-byte UTF-8 character (an emoji is often
  split over 2-4 tokens). Bytes go through an incremental UTF-8 decoder, which emits a
  character only once all its bytes have arrived.
- Stop strings can span tokens. Text that could still turn out to be the start of a stop
  string is held back until the next tokens decide it; the stop string itself (and
  anything after it) is never emitted.

Generation builds its final ``text`` from the same pieces, so streaming and non-streaming
results are identical by construction.
"""

from __future__ import annotations

import codecs
import copy
from typing import Any, Iterable, Optional, Sequence

from lucidlm.tokenizers.base import Tokenizer


class TextAssembler:
    """Feed token ids one at a time; get back the text that is safe to show so far."""

    def __init__(self, tokenizer: Tokenizer, stop: Optional[Iterable[str]] = None,
                 skip_ids: Iterable[int] = (), prompt_ids: Sequence[int] = ()) -> None:
        """``prompt_ids``: the ids the output continues. Their text is not part of ``text``,
        but they give the first new token its predecessor, and a UTF-8 character split
        between the prompt's last bytes and the output's first ones belongs to the output."""
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.skip_ids = set(skip_ids)  # e.g. EOS: ends generation, is not text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._previous: Optional[int] = None  # the last id decoded (prompt or output)
        # The bytes of a character the prompt began but did not finish (b"" when it ended whole).
        self._dangling = b""
        if len(prompt_ids):
            # Complete characters of the prompt come out here and are dropped; a dangling
            # partial character stays in the decoder, to be completed by the output.
            self._decoder.decode(_decode_bytes(tokenizer, [int(i) for i in prompt_ids]))
            self._dangling = self._decoder.getstate()[0]
            self._previous = int(prompt_ids[-1])
        # how decode(prompt) shows those bytes: one U+FFFD or more, the end of the prompt's text
        self._dangling_shown = self._dangling.decode("utf-8", errors="replace")
        self._text = ""  # everything decoded so far
        self._emitted = 0  # how much of _text has been handed out
        self.stopped = False  # a stop string was found

    def fork(self) -> "TextAssembler":
        """An independent copy, to go on with other tokens (beam search tries several after
        one beam); the tokenizer and stop strings are shared, not copied."""
        twin = copy.copy(self)
        twin._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        twin._decoder.setstate(self._decoder.getstate())
        return twin

    @property
    def text(self) -> str:
        """The text handed out so far (the final text once ``finish`` was called)."""
        return self._text[:self._emitted]

    def add(self, token_id: int) -> str:
        """Decode one more token; return the new text that is safe to emit (maybe "")."""
        if self.stopped or token_id in self.skip_ids:
            return ""
        data = continuation_bytes(self.tokenizer, self._previous, token_id)
        self._text += self._without_prompts_replacement(data, self._decoder.decode(data))
        self._previous = token_id
        return self._release(final=False)

    def finish(self) -> str:
        """Flush: incomplete bytes at the end become U+FFFD, held-back text is released.

        Stop strings are not searched here: the flush adds only the U+FFFD of a character the
        last tokens left unfinished (generation ended first, by length or EOS), which the model
        never wrote. So a "length" or "eos" result keeps the full decode of its ids, as
        transformers' stop strings (matched on the tokens' own text) never see that U+FFFD."""
        if not self.stopped:
            self._text += self._without_prompts_replacement(b"", self._decoder.decode(b"", final=True))
        return self._release(final=True)

    def _without_prompts_replacement(self, data: bytes, decoded: str) -> str:
        """``decoded`` (what ``data`` added), less the U+FFFD(s) of the prompt's dangling bytes if
        the output did not complete their character: ``decode(prompt)`` already ends with them,
        so they are not text the output adds."""
        if not self._dangling:
            return decoded
        started = self._dangling + data
        if not decoded:  # the character is still incomplete: wait for more bytes
            self._dangling = started
            return decoded
        self._dangling = b""
        completed = started.startswith(decoded[0].encode("utf-8"))  # decoded[0] is made of those bytes
        if completed or not decoded.startswith(self._dangling_shown):
            return decoded
        return decoded[len(self._dangling_shown):]

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        start = self._emitted
        # final: every stop string in the tokens' text was found by add(); see finish()
        hits = [] if final else [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back(start)
        self._emitted = end
        return self._text[start:end]

    def _held_back(self, start: int) -> int:
        """Length of the longest tail of the unemitted text that begins some stop string."""
        pending = self._text[start:]
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(pending)), longest, -1):
                if s.startswith(pending[-n:]):
                    longest = n
                    break
        return longest


def continuation_bytes(tokenizer: Any, previous: Optional[int], token_id: int) -> bytes:
    """The bytes ``token_id`` adds to a text whose last token is ``previous`` (None: it is
    the first token): decode the pair, drop what the predecessor alone decodes to.

    Every lucidlm tokenizer decodes a sequence to a function of neighbouring pairs (plain
    concatenation, or words joined by a space, or a leading space dropped from the very
    first token), so one token of context is enough for the result to equal decoding the
    whole sequence at once.
    """
    if previous is None:
        return _decode_bytes(tokenizer, [token_id])
    before = _decode_bytes(tokenizer, [previous])
    pair = _decode_bytes(tokenizer, [previous, token_id])
    if not pair.startswith(before):  # a decoder that rewrites its predecessor: best effort
        return _decode_bytes(tokenizer, [token_id])
    return pair[len(before):]


def _decode_bytes(tokenizer: Any, ids: list[int]) -> bytes:
    """Raw bytes for tokenizers with ``decode_bytes`` (all of lucidlm's); others fall back
    to their text, which cannot split a character."""
    decode_bytes = getattr(tokenizer, "decode_bytes", None)
    if decode_bytes is not None:
        return decode_bytes(ids)
    return tokenizer.decode(ids).encode("utf-8")
