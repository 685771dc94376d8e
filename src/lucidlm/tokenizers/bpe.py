"""Byte-level byte-pair encoding (BPE), GPT-2 style, with a trainer.

How encoding works (the same steps as GPT-2 and tiktoken):

1. Special tokens (``<|endoftext|>``) are cut out first; each becomes one id.
2. The rest is split into chunks by a regex (``GPT2_SPLIT_PATTERN``): words with their
   leading space, numbers, punctuation runs, whitespace runs. Merges never cross chunks,
   so " dog" and " dog." share the token for " dog".
3. Each chunk starts as its UTF-8 bytes, one id per byte, so any text can be encoded (with
   a pattern that matches every character, as GPT-2's does: text no match covers is dropped,
   as tiktoken drops it).
4. Repeatedly merge the adjacent pair with the lowest rank (the earliest-learned merge)
   until no pair in the chunk has a merge.

Ids: 0..255 are the 256 single bytes (in ``byte_order``: identity for trained tokenizers,
GPT-2's own order for its files), id ``256 + r`` is the token made by merge ``r``, and the
special tokens come last. So a merge's rank and the id it makes are the same number.

Training (``BPETokenizer.train``) checks its arguments here and runs the trainer in
``bpe_trainer.py``: seed 002's loop - merge the most common pair, repeat - over the chunk
counts instead of the raw text, with pair counts updated incrementally. Reading OpenAI's
GPT-2 files is ``gpt2_files.py``; the O(n log n) merge for long chunks is ``bpe_heap_merge.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import regex

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.base import Tokenizer
from lucidlm.tokenizers.encode_input import check_special_names, check_text, split_chunks
from lucidlm.tokenizers.bpe_heap_merge import merge_by_heap
from lucidlm.tokenizers.bpe_hf_export import bpe_to_hf_json
from lucidlm.tokenizers.bpe_trainer import Pair, count_chunks, learn_merges, merge_pair
from lucidlm.tokenizers.gpt2_files import (  # noqa: F401  (bytes_to_unicode, GPT2_SPLIT_PATTERN re-exported: this module was their home)
    ENDOFTEXT, GPT2_SPLIT_PATTERN, bytes_to_unicode, read_gpt2_files)
from lucidlm.validation import check_int

_ENCODE_CACHE_SIZE = 1 << 16  # chunks remembered; natural text repeats its words a lot
_LONG_CHUNK = 200  # bytes; longer chunks take the O(n log n) merge path (same result)


class BPETokenizer(Tokenizer):
    """Byte-level BPE: a merge list over bytes, a pre-split regex and special tokens."""

    type_name = "bpe"

    def __init__(
        self,
        merges: Sequence[Pair],
        special_tokens: dict[str, int] | None = None,
        *,
        pattern: str = GPT2_SPLIT_PATTERN,
        byte_order: Sequence[int] | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        """``merges[r] = (left_id, right_id)`` makes id ``256 + r``. ``byte_order[i]`` is
        the byte value of id ``i`` (default: id i is byte i). Special ids must follow the
        merges: ``256 + len(merges)``, ``+1``, ..."""
        byte_order = list(range(256)) if byte_order is None else list(byte_order)
        if sorted(byte_order) != list(range(256)):
            raise TokenizerError("byte_order must be a permutation of the 256 byte values")
        n_mergeable = 256 + len(merges)
        specials = dict(special_tokens or {})
        expected = set(range(n_mergeable, n_mergeable + len(specials)))
        if set(specials.values()) != expected:
            raise TokenizerError(
                f"special token ids {sorted(specials.values())} must be exactly "
                f"{n_mergeable}..{n_mergeable + len(specials) - 1}, right after the "
                f"{len(merges)} merges, so every id below vocab_size means something"
            )
        super().__init__(specials, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)
        self.pattern = pattern
        self.byte_order = byte_order
        self.merges: list[Pair] = [(int(a), int(b)) for a, b in merges]

        self._split_regex = regex.compile(pattern)
        self._byte_to_id = [0] * 256  # byte value -> id
        for token_id, byte in enumerate(byte_order):
            self._byte_to_id[byte] = token_id
        # id -> bytes for every id; a merged token is its parts' bytes back to back
        self._vocab: list[bytes] = [bytes([b]) for b in byte_order]
        self._merge_id: dict[Pair, int] = {}  # pair -> new id (= 256 + rank)
        for rank, (left, right) in enumerate(self.merges):
            new_id = 256 + rank
            if not (0 <= left < new_id and 0 <= right < new_id):
                raise TokenizerError(
                    f"merge {rank} = ({left}, {right}) uses an id not made by an earlier "
                    f"merge (must be < {new_id}); the merge list is corrupt or reordered"
                )
            self._merge_id[(left, right)] = new_id
            self._vocab.append(self._vocab[left] + self._vocab[right])
        for name in sorted(specials, key=specials.__getitem__):
            self._vocab.append(name.encode("utf-8"))
        self._cache: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- encoding

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def _encode_ordinary(self, text: str, offset: int) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for chunk in split_chunks(self._split_regex, text):
            chunk_ids = cache.get(chunk)
            if chunk_ids is None:
                chunk_ids = self._encode_chunk(chunk)
                if len(cache) >= _ENCODE_CACHE_SIZE:
                    cache.clear()  # crude bound on memory; refills with frequent chunks
                cache[chunk] = chunk_ids
            ids.extend(chunk_ids)
        return ids

    def _encode_chunk(self, chunk: str) -> list[int]:
        # surrogatepass: a lone surrogate (possible in a Python str) still has bytes to encode
        ids = [self._byte_to_id[b] for b in chunk.encode("utf-8", errors="surrogatepass")]
        if len(ids) > _LONG_CHUNK:
            return self._merge_long(ids)
        merge_id = self._merge_id
        never = len(self._vocab)  # larger than any merge's id, i.e. "no merge"
        while len(ids) >= 2:
            # The pair learned earliest has the smallest new id: apply it everywhere.
            best = min(zip(ids, ids[1:]), key=lambda pair: merge_id.get(pair, never))
            new_id = merge_id.get(best)
            if new_id is None:
                break
            ids = merge_pair(ids, best, new_id)
        return ids

    def _merge_long(self, ids: list[int]) -> list[int]:
        """Same result as the loop in ``_encode_chunk``, in O(n log n) (``bpe_heap_merge.py``)."""
        return merge_by_heap(ids, self._merge_id)

    def _token_bytes(self, token_id: int) -> bytes:
        return self._vocab[token_id]

    def _spells_out_text(self) -> bool:
        # Bytes in, merged ids out; but text the split pattern does not match is dropped
        # (split_chunks), and only GPT-2's pattern is known here to match every character.
        return self.pattern == GPT2_SPLIT_PATTERN

    # ----------------------------------------------------------------- Hugging Face export

    def to_hf_json(self) -> str:
        """This tokenizer as a Hugging Face ``tokenizer.json`` (a str) that ``tokenizers``,
        transformers and ``lucidlm.load`` encode and decode exactly as this one does; ``save_hf``
        writes it. TokenizerError (naming why) when Hugging Face cannot mirror it."""
        return bpe_to_hf_json(self)

    # ----------------------------------------------------------------- save / load

    def _to_dict(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "byte_order": self.byte_order,
            "merges": [list(pair) for pair in self.merges],
            "special_tokens": self.special_tokens,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
        }

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> "BPETokenizer":
        return cls(
            [tuple(pair) for pair in data["merges"]],
            data["special_tokens"],
            pattern=data["pattern"],
            byte_order=data["byte_order"],
            bos_token=data.get("bos_token"),
            eos_token=data.get("eos_token"),
            pad_token=data.get("pad_token"),
        )

    @classmethod
    def from_gpt2_files(
        cls, encoder_json: str | Path, vocab_bpe: str | Path
    ) -> "BPETokenizer":
        """Build GPT-2's tokenizer from OpenAI's ``encoder.json`` and ``vocab.bpe``.

        ``gpt2_files.py`` reads the two files and checks that they agree.
        """
        merges, specials, byte_order = read_gpt2_files(encoder_json, vocab_bpe)
        # GPT-2 uses <|endoftext|> both to start and to end documents; it has no pad token.
        return cls(
            merges, specials, byte_order=byte_order, bos_token=ENDOFTEXT, eos_token=ENDOFTEXT
        )

    # ----------------------------------------------------------------- training

    @classmethod
    def train(
        cls,
        text: str,
        vocab_size: int,
        special_tokens: Sequence[str] = (ENDOFTEXT,),
        *,
        pattern: str = GPT2_SPLIT_PATTERN,
        progress: bool = True,
    ) -> "BPETokenizer":
        """Learn ``vocab_size - 256 - len(special_tokens)`` merges from ``text``.

        Each step merges the most frequent adjacent pair. Ties go to the pair whose
        (left bytes, right bytes) is lexicographically smallest, so training is
        deterministic. Special tokens in ``text`` are cut out first and never merged.
        If the corpus runs out of pairs early, training stops with a warning and the
        vocabulary is smaller than asked.
        """
        check_text(text, "BPETokenizer.train()")  # what encode refuses, no merge may learn
        special_tokens = check_special_names(special_tokens)
        vocab_size = check_int(vocab_size, "vocab_size", TokenizerError)
        minimum = 256 + len(special_tokens) + 1
        if vocab_size < minimum:
            raise TokenizerError(
                f"vocab_size={vocab_size} is too small for byte-level BPE: 256 byte tokens "
                f"+ {len(special_tokens)} special tokens leave no room for a merge; "
                f"use vocab_size >= {minimum}"
            )
        n_merges = vocab_size - 256 - len(special_tokens)
        words, freqs = count_chunks(text, special_tokens, pattern)
        merges = learn_merges(words, freqs, n_merges, progress)
        if len(merges) < n_merges:
            warnings.warn(
                f"BPE training ran out of pairs after {len(merges)} of {n_merges} merges: "
                f"the corpus is too small for vocab_size={vocab_size}; the vocabulary has "
                f"{256 + len(merges) + len(special_tokens)} tokens",
                stacklevel=2,
            )
        specials = {name: 256 + len(merges) + i for i, name in enumerate(special_tokens)}
        eos = ENDOFTEXT if ENDOFTEXT in specials else None
        return cls(merges, specials, pattern=pattern, eos_token=eos)

