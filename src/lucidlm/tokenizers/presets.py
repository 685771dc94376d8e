"""Tokenizers that come with an architecture preset: ``lucidlm.load("gpt2", random_init=True)``
carries GPT-2's own BPE, so a seed 002 reader can generate (and train) with real GPT-2 ids.

GPT-2's ``encoder.json`` and ``vocab.bpe`` (MIT, OpenAI's files; LICENSE beside them) ship
inside the package, under ``tokenizers/data/gpt2/``: nothing is downloaded.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Optional

from lucidlm.tokenizers.bpe import BPETokenizer

DATA = Path(__file__).with_name("data")
GPT2_VOCAB_SIZE = 50257


@functools.lru_cache(maxsize=1)
def _gpt2() -> BPETokenizer:
    return BPETokenizer.from_gpt2_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")


def gpt2_tokenizer() -> BPETokenizer:
    """GPT-2's tokenizer (50,257 ids; <|endoftext|> = 50256 begins and ends documents)."""
    return _gpt2()


# preset name -> (the vocabulary size the tokenizer fits, how to build it)
PRESET_TOKENIZERS: dict[str, tuple[int, Callable[[], Any]]] = {
    "gpt2": (GPT2_VOCAB_SIZE, gpt2_tokenizer),
}


def preset_tokenizer(name: str, vocab_size: int) -> Optional[Any]:
    """The tokenizer of preset ``name``, or None when it has none or the vocabulary was resized."""
    entry = PRESET_TOKENIZERS.get(name)
    if entry is None or entry[0] != vocab_size:
        return None
    return entry[1]()
