"""From text files to one token array: which files a --data argument names, reading them as
UTF-8, learning a tokenizer on them (char | word | bpe), and encoding every document into one
flat array with an end-of-text token between documents.

This is the part of data preparation that knows about text and tokenizers; ``data.py`` caches
its result on disk (train.bin / val.bin, meta.json) and splits it. ``data.py`` re-exports these
names, so ``from lucidlm.training.data import corpus_files`` still works.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from lucidlm.errors import DataError
from lucidlm.tokenizers import BPETokenizer, CharTokenizer, Tokenizer, WordTokenizer

TOKENIZER_KINDS = ("char", "word", "bpe")
DEFAULT_BPE_VOCAB = 1024


# ----------------------------------------------------------------------------- reading

def corpus_files(source: str | Path, what: str = "training") -> list[Path]:
    """The .txt files a --data argument names: the file itself, or every .txt under a folder.
    ``what`` the text is for, in the errors ("training", "evaluation")."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"folder {path} holds no .txt files; put the {what} text in *.txt files there.")
        return files
    if path.exists():  # a pipe (<(cmd), /dev/stdin) or a device: there, but "does not exist" said otherwise
        raise DataError(f"{what} data {path} is not a regular file or folder (a pipe or a device, which training "
                        f"would read twice); save the text to a file and pass that.")
    raise DataError(f"{what} data {path} does not exist; pass a text file or a folder of .txt files.")


def read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start]
        raise DataError(
            f"{path} is not UTF-8 text: byte 0x{bad:02x} at offset {exc.start} cannot be decoded "
            f"({exc.reason}). Convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
        ) from None


def read_corpus(files: Sequence[Path], what: str = "training") -> list[str]:
    """One string per file; empty files are skipped, an empty corpus is an error (``what``: as
    ``corpus_files``)."""
    texts = [read_text(f) for f in files]
    if not any(t.strip() for t in texts):
        names = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
        purpose = "train on" if what == "training" else "score"
        verb = "holds" if len(files) == 1 else "hold"
        raise DataError(f"the {what} corpus is empty ({names} {verb} no text); add text to {purpose}.")
    return [t for t in texts if t]


# ----------------------------------------------------------------------------- tokenizing

def train_tokenizer(kind: str, text: str, vocab_size: Optional[int] = None, progress: bool = False) -> Tokenizer:
    """A new tokenizer of ``kind`` (char | word | bpe) learned from ``text``."""
    if kind == "char":
        return CharTokenizer.train(text)
    if kind == "word":
        return WordTokenizer.train(text, max_vocab=vocab_size)
    if kind == "bpe":
        return BPETokenizer.train(text, vocab_size or DEFAULT_BPE_VOCAB, progress=progress)
    raise DataError(f"unknown tokenizer {kind!r}; choose one of {', '.join(TOKENIZER_KINDS)}.")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenize_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """All documents as one token array; an end-of-text token (if the tokenizer has one)
    separates documents so the model does not learn to run one file into the next."""
    dtype = token_dtype(tokenizer.vocab_size)
    pieces = []
    for i, text in enumerate(texts):
        if i > 0 and tokenizer.eos_id is not None:
            pieces.append(np.array([tokenizer.eos_id], dtype=dtype))
        # Plain text only: "<|endoftext|>" typed in a corpus is not a document boundary.
        pieces.append(np.asarray(tokenizer.encode(text, allowed_special=False), dtype=dtype))
    return np.concatenate(pieces)


__all__ = ["DEFAULT_BPE_VOCAB", "TOKENIZER_KINDS", "corpus_files", "read_corpus", "read_text", "token_dtype",
           "tokenize_documents", "train_tokenizer"]
