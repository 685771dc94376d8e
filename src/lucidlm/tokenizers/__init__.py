"""Tokenizers behind one interface: character, word and byte-level BPE (trainable, or
GPT-2's own files). Every one saves to a single JSON file that ``load_tokenizer`` reads.

>>> tok = BPETokenizer.train(text, vocab_size=4096, progress=False)
>>> tok.save("tok.json"); load_tokenizer("tok.json").encode("Hello") == tok.encode("Hello")
True
"""

from lucidlm.tokenizers.base import Tokenizer, load_tokenizer
from lucidlm.tokenizers.bpe import GPT2_SPLIT_PATTERN, BPETokenizer
from lucidlm.tokenizers.char import CharTokenizer
from lucidlm.tokenizers.word import WordTokenizer

train_bpe = BPETokenizer.train  # convenience: train_bpe(text, vocab_size, ...)

__all__ = [
    "GPT2_SPLIT_PATTERN",
    "BPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "WordTokenizer",
    "load_tokenizer",
    "train_bpe",
]
