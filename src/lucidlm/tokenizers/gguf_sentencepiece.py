"""A Llama-style sentencepiece-BPE vocabulary (Llama 2, TinyLlama, Mistral 7B), rebuilt from a
GGUF file's token list and scores.

Such a file says ``tokenizer.ggml.model = "llama"`` and stores the tokens, one score each and
usually no merge list. It is rebuilt the way transformers' GGUF loader does
(``gguf_tokenizer_mapping.sentencepiece_tokenizer``, which hands the vocabulary to
``LlamaTokenizer``), so the ids are the ones transformers gives for the same file:

- the merges are the file's, or else every split of a token into two vocabulary tokens,
  ranked by the score of the token they build (higher first; transformers'
  ``generate_merges``);
- text gets a ``▁`` before it (Metaspace, only at the start) and ``▁`` for each space;
  characters outside the vocabulary fall back to ``<0xNN>`` byte tokens;
- decoding maps ``▁`` back to a space, joins byte tokens, and drops the one leading space.

Gemma's files, whose scores do not follow the merge order, are rebuilt by ``sentencepiece.py``.
"""

from __future__ import annotations

from typing import Any, Optional

SPACE = "\u2581"  # sentencepiece's visible space


def llama_backend(tokens: list[str], scores: list[float],
                  merges: Optional[list[tuple[str, str]]] = None) -> tuple[Any, dict[str, int]]:
    """(a ``tokenizers.Tokenizer``, its vocabulary token -> id) for a Llama-style sentencepiece file."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {token: index for index, token in enumerate(tokens)}  # a repeated token keeps its last id, as there
    if merges is None:
        merges = merges_from_scores(tokens, scores, vocab)
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    return backend, vocab


def merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary tokens, ranked by the token's
    score (higher first), then by longer left and right parts; splits of one token in id order.
    This is transformers' ``generate_merges`` with scores, step for step, so ties break alike."""
    ranked: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores)).items():  # a repeated token: its first place, last score
        splits = [(token[:cut], token[cut:], score) for cut in range(1, len(token))
                  if token[:cut] in vocab and token[cut:] in vocab]
        splits.sort(key=lambda split: (vocab[split[0]], vocab[split[1]]))
        ranked.extend(splits)
    ranked.sort(key=lambda split: (split[2], len(split[0]), len(split[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


__all__ = ["llama_backend", "merges_from_scores"]
