"""Word-level tokenizer: whitespace-separated words, unknown words -> ``<unk>``.

Seed 004 trains its Shakespeare model on ``corpus.split()`` words with ids from
``enumerate(set(words))``. Two things there are fixed here:

* ``set`` order changes from one Python process to the next (string hashing is salted),
  so its ids are not reproducible; we order words by frequency (most common first), then
  alphabetically.
* its loss masks every target whose id is 0 as padding, which silently drops whatever word
  landed on id 0; here id 0 is a real ``<pad>`` token, so that mask is right.

Decoding joins words with single spaces: the original spacing and newlines are lost, which
is the price of this tokenizer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.base import Tokenizer
from lucidlm.tokenizers.encode_input import check_text
from lucidlm.validation import check_int

PAD, UNK, ENDOFTEXT = "<pad>", "<unk>", "<|endoftext|>"
SPECIALS = (PAD, UNK, ENDOFTEXT)  # ids 0, 1, 2


class WordTokenizer(Tokenizer):
    """``<pad>``=0, ``<unk>``=1, ``<|endoftext|>``=2, then words by falling frequency."""

    type_name = "word"

    def __init__(self, words: Sequence[str]) -> None:
        words = list(words)
        bad = [w for w in words if not w or any(c.isspace() for c in w) or w in SPECIALS]
        if bad:
            raise TokenizerError(
                f"WordTokenizer words must be non-empty, hold no whitespace and not be a "
                f"special token; got {bad[:5]!r}"
            )
        if len(set(words)) != len(words):
            raise TokenizerError("WordTokenizer word list repeats words")
        super().__init__(
            {name: i for i, name in enumerate(SPECIALS)}, eos_token=ENDOFTEXT, pad_token=PAD
        )
        self.words = words
        self._id_to_text = list(SPECIALS) + words
        self._word_to_id = {w: i for i, w in enumerate(self._id_to_text)}

    @classmethod
    def train(
        cls, text: str, *, max_vocab: int | None = None, min_count: int = 1
    ) -> "WordTokenizer":
        """Vocabulary from the whitespace-split words of ``text``.

        ``max_vocab`` caps ``vocab_size`` (the 3 special tokens included); words seen fewer
        than ``min_count`` times are left out. Left-out words encode as ``<unk>``.
        """
        check_text(text, "WordTokenizer.train()")
        if max_vocab is not None:
            max_vocab = check_int(max_vocab, "max_vocab", TokenizerError)
        min_count = check_int(min_count, "min_count", TokenizerError)
        if max_vocab is not None and max_vocab <= len(SPECIALS):
            raise TokenizerError(
                f"max_vocab={max_vocab} leaves no room for words: the {len(SPECIALS)} "
                f"special tokens {SPECIALS} take ids 0..{len(SPECIALS) - 1}; use at least "
                f"{len(SPECIALS) + 1}"
            )
        if min_count < 1:
            raise TokenizerError(f"min_count={min_count} must be at least 1")
        counts = Counter(w for w in text.split() if w not in SPECIALS)
        if not counts:
            raise TokenizerError("WordTokenizer.train got a corpus with no words")
        # Most common first, ties alphabetical: reproducible, unlike seed 004's set() order.
        ranked = sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))
        words = [w for w, c in ranked if c >= min_count]
        if max_vocab is not None:
            words = words[: max_vocab - len(SPECIALS)]
        return cls(words)

    @property
    def unk_id(self) -> int:
        return self.special_tokens[UNK]

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_text)

    def _encode_ordinary(self, text: str, offset: int) -> list[int]:
        unk = self.special_tokens[UNK]
        get = self._word_to_id.get
        # A special token's name typed as a plain word (allowed_special=False) is unknown.
        return [unk if w in SPECIALS else get(w, unk) for w in text.split()]

    def decode_bytes(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> bytes:
        # Words are separate items, so join them with a space rather than concatenating.
        return " ".join(self._id_to_text[i] for i in self._kept(ids, skip_special_tokens)).encode("utf-8")

    def _token_bytes(self, token_id: int) -> bytes:
        return self._id_to_text[token_id].encode("utf-8")

    def _to_dict(self) -> dict[str, Any]:
        return {"special_tokens": list(SPECIALS), "words": self.words}

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> "WordTokenizer":
        if list(data["special_tokens"]) != list(SPECIALS):
            raise TokenizerError(
                f"word tokenizer file has special tokens {data['special_tokens']}, but this "
                f"version of lucidlm uses {list(SPECIALS)}"
            )
        return cls(data["words"])
