"""Tokenizers behind one interface: character, word and byte-level BPE (trainable, or
GPT-2's own files), plus pretrained models' tokenizers (``HFTokenizer``). Every one saves to
a single JSON file that ``load_tokenizer`` reads back, whatever its type.

    tok = BPETokenizer.train(text, vocab_size=4096)      # or CharTokenizer.train(text), ...
    tok.save("tok.json")
    same = load_tokenizer("tok.json")                   # a BPETokenizer again
"""

from lucidlm.tokenizers.base import Tokenizer, load_tokenizer
from lucidlm.tokenizers.bpe import GPT2_SPLIT_PATTERN, BPETokenizer
from lucidlm.tokenizers.char import CharTokenizer
from lucidlm.tokenizers.pretrained import HFTokenizer  # imported so load_tokenizer knows "hf"
from lucidlm.tokenizers.tiktoken_bpe import TiktokenTokenizer  # Meta's Llama 3 tokenizer.model
from lucidlm.tokenizers.word import WordTokenizer

train_bpe = BPETokenizer.train  # convenience: train_bpe(text, vocab_size, ...)

__all__ = [
    "GPT2_SPLIT_PATTERN",
    "BPETokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "WordTokenizer",
    "load_tokenizer",
    "train_bpe",
]
