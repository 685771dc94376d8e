"""Character-level tokenizer: one id per Unicode character of a fixed alphabet.

This is seed 002's tokenizer (a list of characters plus an end-of-sequence token) and the
one nanoGPT's shakespeare-char uses: the alphabet is the sorted set of characters of the
training corpus, so ids 0..n-1 are those characters in code-point order and the special
tokens come after them. On tinyshakespeare that gives nanoGPT's exact 65 character ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.base import Tokenizer
from lucidlm.tokenizers.encode_input import check_special_names, check_text

ENDOFTEXT = "<|endoftext|>"
# eos_token not given: ENDOFTEXT when it is one of the special tokens, else none. A sentinel, so
# that an eos_token the caller names but forgot to list (or mistyped) is refused, not dropped.
_DEFAULT_EOS: Any = object()


class CharTokenizer(Tokenizer):
    """One id per character; characters outside the alphabet are an error, not dropped."""

    type_name = "char"

    def __init__(
        self,
        chars: Sequence[str],
        special_tokens: Sequence[str] = (ENDOFTEXT,),
        *,
        eos_token: str | None = _DEFAULT_EOS,
    ) -> None:
        chars = list(chars)
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise TokenizerError(
                f"CharTokenizer alphabet entries must be single characters, got {bad[:5]!r}"
            )
        if len(set(chars)) != len(chars):
            dupes = sorted({c for c in chars if chars.count(c) > 1})
            raise TokenizerError(f"CharTokenizer alphabet repeats characters {dupes!r}")
        special_tokens = check_special_names(special_tokens)
        # Specials go after the characters, as in seed 002 (vocab list, then '<EOS>').
        specials = {name: len(chars) + i for i, name in enumerate(special_tokens)}
        if eos_token is _DEFAULT_EOS:
            eos_token = ENDOFTEXT if ENDOFTEXT in specials else None
        super().__init__(specials, eos_token=eos_token)  # refuses an eos_token not among them
        self.chars = chars
        self._char_to_id = {c: i for i, c in enumerate(chars)}
        self._id_to_text = chars + list(special_tokens)  # id -> the text it stands for

    @classmethod
    def train(
        cls, text: str, special_tokens: Sequence[str] = (ENDOFTEXT,)
    ) -> "CharTokenizer":
        """Alphabet = sorted set of the characters of ``text``."""
        check_text(text, "CharTokenizer.train()")  # a lone surrogate would join the alphabet
        if not text:
            raise TokenizerError(
                "CharTokenizer.train got an empty corpus; pass the text whose characters "
                "should make up the vocabulary"
            )
        return cls(sorted(set(text)), special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_text)

    def _encode_ordinary(self, text: str, offset: int) -> list[int]:
        lookup = self._char_to_id
        try:
            return [lookup[c] for c in text]
        except KeyError:
            # Slow path only to build the message: find the first unknown character.
            pos = next(i for i, c in enumerate(text) if c not in lookup)
            ch = text[pos]
            raise TokenizerError(
                f"character {ch!r} (U+{ord(ch):04X}) at position {offset + pos} is not in "
                f"this CharTokenizer's alphabet of {len(self.chars)} characters; train it "
                f"on text that contains {ch!r} or remove it from the input"
            ) from None

    def _spells_out_text(self) -> bool:
        return True  # one id per character (an unknown one is refused), a special token's name is its bytes

    def _token_bytes(self, token_id: int) -> bytes:
        # surrogatepass: an alphabet may hold a lone surrogate; decode() then shows U+FFFD
        return self._id_to_text[token_id].encode("utf-8", errors="surrogatepass")

    def _to_dict(self) -> dict[str, Any]:
        specials = sorted(self.special_tokens, key=self.special_tokens.__getitem__)
        return {"chars": self.chars, "special_tokens": specials, "eos_token": self.eos_token}

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> "CharTokenizer":
        return cls(data["chars"], data["special_tokens"], eos_token=data["eos_token"])
