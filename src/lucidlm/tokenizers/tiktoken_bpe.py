"""Meta's Llama 3 tokenizer: a tiktoken ``tokenizer.model`` file, encoded the tiktoken way.

The file is one line per token, ``<base64 of the token's bytes> <rank>``; the rank is also
the token's id. There is no merge list: to encode a chunk, start from its single bytes and
repeatedly merge the adjacent pair whose concatenation has the lowest rank, until no
adjacent pair is a token (tiktoken's ``byte_pair_encode``). Chunks come from Llama 3's
pre-tokenizer regex, and Llama 3 appends 256 special tokens after the ranked ones
(``<|begin_of_text|>`` = 128000 in the real file, ``<|eot_id|>``, reserved ones...).
"""

from __future__ import annotations

import base64
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import regex

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.base import Tokenizer
from lucidlm.tokenizers.bpe_heap_merge import merge_pieces_by_heap
from lucidlm.tokenizers.encode_input import check_special_names, split_chunks

LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]  # 256 in all
_LONG_CHUNK = 200  # bytes; longer pieces take the O(n log n) merge path (same result)


def read_tiktoken_file(path: str | Path) -> dict[bytes, int]:
    """token bytes -> rank, from a ``tokenizer.model`` in tiktoken's format."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist.")
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"{path} line {number} is not '<base64 token> <rank>': {line[:60]!r}; this is not a "
                                 f"tiktoken tokenizer.model (Llama 1/2 use sentencepiece files, which this is not for).")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: the ranks are not 0..{len(ranks) - 1} without gaps or repeats.")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: single bytes {missing[:5]} have no token, so some text could not be encoded.")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """Rank-based byte-level BPE over a tiktoken vocabulary, special tokens after it."""

    type_name = "tiktoken"

    def __init__(self, ranks: dict[bytes, int], special_tokens: list[str], pattern: str = LLAMA3_SPLIT_PATTERN,
                 *, bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                 eos_tokens: tuple[str, ...] = ()) -> None:
        n = len(ranks)
        special_tokens = check_special_names(special_tokens)
        super().__init__({name: n + i for i, name in enumerate(special_tokens)}, bos_token=bos_token,
                         eos_token=eos_token)
        self.ranks = ranks
        self.pattern = pattern
        self._split = regex.compile(pattern)
        self._bytes = [b""] * n
        for token, rank in ranks.items():
            self._bytes[rank] = token
        self._special_names = list(special_tokens)
        self.eos_ids = [self.special_tokens[t] for t in eos_tokens]  # generation stops on any
        self._encode_chunk = lru_cache(maxsize=1 << 16)(self._bpe)

    @classmethod
    def from_llama3_file(cls, path: str | Path, instruct: bool = True) -> "TiktokenTokenizer":
        """Llama 3's ``tokenizer.model`` with its 256 special tokens. Generation stops at
        ``<|end_of_text|>`` and, for chat (instruct) models, ``<|eot_id|>`` as well."""
        eos = ("<|end_of_text|>", "<|eot_id|>") if instruct else ("<|end_of_text|>",)
        return cls(read_tiktoken_file(path), LLAMA3_SPECIAL_TOKENS, bos_token="<|begin_of_text|>",
                   eos_token="<|end_of_text|>", eos_tokens=eos)

    @property
    def vocab_size(self) -> int:
        return len(self._bytes) + len(self._special_names)

    def _encode_ordinary(self, text: str, offset: int) -> list[int]:
        ids: list[int] = []
        for chunk in split_chunks(self._split, text):
            ids.extend(self._encode_chunk(chunk.encode("utf-8")))
        return ids

    def _bpe(self, piece: bytes) -> tuple[int, ...]:
        if piece in self.ranks:
            return (self.ranks[piece],)
        parts = [piece[i:i + 1] for i in range(len(piece))]
        if len(parts) > _LONG_CHUNK:  # the loop below is quadratic: same merges in O(n log n)
            ranks = self.ranks
            merged = merge_pieces_by_heap(parts, lambda a, b: ranks.get(a + b), lambda a, b, rank: a + b)
            return tuple(ranks[p] for p in merged)
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                rank = self.ranks.get(parts[i] + parts[i + 1])
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best_rank is None:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        return tuple(self.ranks[p] for p in parts)

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id < len(self._bytes):
            return self._bytes[token_id]
        return self._special_names[token_id - len(self._bytes)].encode("utf-8")

    def _spells_out_text(self) -> bool:
        return self.pattern == LLAMA3_SPLIT_PATTERN  # as BPETokenizer's: the pattern known to match every character

    def _to_dict(self) -> dict[str, Any]:
        return {"ranks": [base64.b64encode(t).decode("ascii") for t in self._bytes], "pattern": self.pattern,
                "special_tokens": self._special_names, "bos_token": self.bos_token, "eos_token": self.eos_token,
                "eos_tokens": [self._special_names[i - len(self._bytes)] for i in self.eos_ids]}

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> "TiktokenTokenizer":
        ranks = {base64.b64decode(t): i for i, t in enumerate(data["ranks"])}
        return cls(ranks, list(data["special_tokens"]), data["pattern"], bos_token=data.get("bos_token"),
                   eos_token=data.get("eos_token"), eos_tokens=tuple(data.get("eos_tokens", ())))
