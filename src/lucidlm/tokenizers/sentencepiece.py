"""Gemma's sentencepiece-BPE vocabulary, rebuilt from a GGUF file's token list.

A Gemma GGUF stores its tokenizer as ``tokenizer.ggml.model = "llama"`` (sentencepiece) with
the tokens in merge order but no merge list. Rebuilding it takes three facts, the ones
transformers' GGUF loader uses (``gguf_tokenizer_mapping.gemma_tokenizer``), so the ids match:

- spaces are spelled ``▁`` inside tokens, but tokens of only whitespace are stored with real
  spaces; they are respelled so the merges built from them line up;
- the merges are every split of a token into two tokens of the vocabulary, ranked by the
  position of the token they build (earlier = learned first), longer left parts first;
- no prefix space is added, unknown characters fall back to ``<0xNN>`` byte tokens, and
  decoding maps ``▁`` back to a space.
"""

from __future__ import annotations

from typing import Any

SPACE = "\u2581"  # sentencepiece's visible space


def gemma_backend(tokens: list[str]) -> tuple[Any, dict[str, int]]:
    """(a ``tokenizers.Tokenizer``, its vocabulary token -> id) for Gemma's token list."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    backend = Backend(BPE(vocab=vocab, merges=merges_from_order(spelled, vocab), fuse_unk=True,
                          unk_token="<unk>", dropout=None, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, vocab


def merges_from_order(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary tokens, for tokens in file
    order (the order sentencepiece learned them in), longest left part first."""
    merges: list[tuple[str, str]] = []
    seen: set[str] = set()
    for token in tokens:
        if token in seen:  # a repeated token ranks where it first appears
            continue
        seen.add(token)
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges
