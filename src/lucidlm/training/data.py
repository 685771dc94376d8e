"""From a text corpus to batches of token windows.

The corpus (one .txt file, or a folder of them) is tokenized ONCE into two flat token
arrays on disk, ``train.bin`` and ``val.bin`` (uint16 when the vocabulary fits, else
uint32), which are memory-mapped: a corpus larger than RAM trains just as well, and a
resumed run reads exactly the same tokens. The split is on the token array: by default
the first 90% trains and the last 10% validates, as in nanoGPT's ``prepare.py``
(``split="tail"``). ``split="interleaved"`` instead holds out every tenth chunk of 1,024
tokens, so validation text comes from all over the corpus: a word-level model on a single
play collection otherwise validates on the last plays' names and words, which the first
90% never shows it.

Reading the text files and tokenizing them is ``corpus.py``; this module caches the result
on disk, splits it and checks it holds enough batches. Batches of windows are drawn from
these arrays by ``batches.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from lucidlm.errors import DataError
from lucidlm.staging import atomic_write_text
from lucidlm.tokenizers import Tokenizer, load_tokenizer
from lucidlm.training.corpus import (  # noqa: F401  (re-exported: this module was their home)
    DEFAULT_BPE_VOCAB, TOKENIZER_KINDS, corpus_files, read_corpus, read_text, token_dtype, tokenize_documents,
    train_tokenizer)
from lucidlm.training.kill_points import kill_point
from lucidlm.validation import read_json_object

MIN_TRAIN_BATCHES = 10  # seed 004 refuses a corpus with fewer distinct batches than this
DATA_DIR_NAME = "data"
META_NAME = "meta.json"


@dataclass
class TokenData:
    """The prepared corpus: memory-mapped token arrays and the tokenizer that made them."""

    train: np.ndarray  # (N_train,) uint16 | uint32
    val: np.ndarray  # (N_val,)
    tokenizer: Tokenizer
    directory: Path
    meta: Optional[dict] = None  # data/meta.json: counts, settings, corpus_sha256, tokenizer_sha256


def _fingerprint(files: Sequence[Path], kind: str, vocab_size: Optional[int], val_fraction: float,
                 split: str = "tail") -> str:
    """Changes when the corpus or the tokenizing choices change, so stale .bin files are redone."""
    h = hashlib.sha256()
    for f in files:
        stat = f.stat()
        h.update(f"{f.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    h.update(f"{kind}|{vocab_size}|{val_fraction}|{split}".encode())
    return h.hexdigest()


SPLITS = ("tail", "interleaved")
SPLIT_CHUNK = 1024  # tokens per chunk for split="interleaved"


def split_tokens(tokens: np.ndarray, val_fraction: float, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token arrays; see the module docstring for the two kinds of split."""
    if split == "tail":
        n_train = int(len(tokens) * (1.0 - val_fraction))
        return tokens[:n_train], tokens[n_train:]
    chunk = np.arange(len(tokens)) // SPLIT_CHUNK
    # Chunk c validates when floor((c+1) f) > floor(c f): a fraction f of the chunks, evenly spread.
    is_val = np.floor((chunk + 1) * val_fraction) > np.floor(chunk * val_fraction)
    return tokens[~is_val], tokens[is_val]


def first_val_chunk(val_fraction: float) -> int:
    """The index of the first chunk ``split_tokens`` holds out with ``split="interleaved"``."""
    chunk = max(0, math.ceil(1 / val_fraction) - 2)  # at most the answer; then the same test as split_tokens
    while not np.floor((chunk + 1) * val_fraction) > np.floor(chunk * val_fraction):
        chunk += 1
    return chunk


def prepare_data(source: str | Path, out_dir: str | Path, tokenizer: str | Tokenizer = "char",
                 vocab_size: Optional[int] = None, val_fraction: float = 0.1,
                 progress: bool = False, split: str = "tail", resume: bool = False,
                 corpus_hash: Optional[str] = None) -> TokenData:
    """Tokenize ``source`` into ``out_dir/data/{train,val}.bin`` (once) and memory-map them.

    ``tokenizer``: a kind to train on the corpus (char | word | bpe), or a tokenizer object
    to encode with as it is (fine-tuning: the pretrained model's own vocabulary).
    A second call with the same corpus and settings reuses the files (and the saved
    tokenizer) instead of tokenizing again. ``resume``: the files must be the run's own
    and whole (a resume refuses rather than rewrite them); ``corpus_hash`` (the corpus
    bytes' sha256, when the caller has it) lets a touched but unchanged corpus be reused.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive), e.g. 0.1.")
    if split not in SPLITS:
        raise DataError(f"unknown split={split!r}; valid options are: {', '.join(SPLITS)}.")
    files = corpus_files(source)
    directory = Path(out_dir) / DATA_DIR_NAME
    given = None if isinstance(tokenizer, str) else tokenizer
    kind = tokenizer if given is None else _tokenizer_identity(given)
    fingerprint = _fingerprint(files, kind, vocab_size, val_fraction, split)
    settings = f"{kind}|{vocab_size}|{val_fraction}|{split}"
    meta = read_meta(directory, strict=resume)
    if meta is not None:
        same = meta["fingerprint"] == fingerprint or (
            corpus_hash is not None and meta.get("corpus_sha256") == corpus_hash and meta.get("settings") == settings)
        if same and _sizes_fit(directory, meta, strict=resume) and _ids_fit(directory, meta, strict=resume):
            return _open(directory, meta, given)
        if resume:
            raise DataError(f"{directory / META_NAME} was written for another corpus or other tokenizing "
                            f"settings than {source} now has; resume with the run's original corpus, or start "
                            f"a new run with another --out.")

    texts = read_corpus(files)
    tok = given if given is not None else train_tokenizer(kind, "\n".join(texts), vocab_size, progress)
    tokens = tokenize_documents(tok, texts)
    train, val = split_tokens(tokens, val_fraction, split)
    n_train = len(train)
    if split == "interleaved" and n_train >= 2 and len(val) < 2:
        needed = first_val_chunk(val_fraction) * SPLIT_CHUNK + 2
        raise DataError(
            f"the corpus {source} has {len(tokens)} tokens, too few for split='interleaved' (--split): it holds "
            f"out whole chunks of {SPLIT_CHUNK} tokens, and at val_fraction (--val-fraction) {val_fraction:g} the "
            f"first held-out chunk starts at token {needed - 2}, so the corpus needs at least {needed} tokens. Pass "
            f"--split tail (the last {val_fraction:g} of the tokens validate), a larger --val-fraction, or more text."
        )
    if n_train < 2 or len(val) < 2:
        raise DataError(
            f"the corpus {source} has only {len(tokens)} tokens, too few to split into training and "
            f"validation data; add more text."
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / META_NAME).unlink(missing_ok=True)  # the files below no longer match it
    train.tofile(directory / "train.bin")
    kill_point("data")  # test seam: train.bin written, the rest not yet
    val.tofile(directory / "val.bin")
    if given is None:
        tok.save(directory / "tokenizer.json")
    from lucidlm.training.resume_checks import corpus_sha256, tokenizer_sha256

    meta = dict(fingerprint=fingerprint, dtype=tokens.dtype.name, n_train=n_train, n_val=len(tokens) - n_train,
                tokenizer=kind, vocab_size=tok.vocab_size, files=[str(f) for f in files], settings=settings,
                corpus_sha256=corpus_hash or corpus_sha256(files), tokenizer_sha256=tokenizer_sha256(tok))
    atomic_write_text(directory / META_NAME, json.dumps(meta, indent=2) + "\n")  # last, whole: the data is complete
    return _open(directory, meta, given)


META_FIX = "delete the folder {directory} and run the command again: it is rebuilt from the corpus"


def read_meta(directory: Path, strict: bool) -> Optional[dict]:
    """data/meta.json checked field by field; None when absent. A damaged one is refused when
    ``strict`` (a resume) and otherwise treated as absent (the data is tokenized again)."""
    path = directory / META_NAME
    if not path.exists():
        return None
    fix = META_FIX.format(directory=directory)
    try:
        fields = read_json_object(path, DataError, "data description", fix)
        meta = dict(fields.data)
        meta.update(fingerprint=fields.str("fingerprint"), dtype=fields.str("dtype", choices=("uint16", "uint32")),
                    n_train=fields.int("n_train", low=1), n_val=fields.int("n_val", low=1),
                    vocab_size=fields.int("vocab_size", low=1), tokenizer=fields.str("tokenizer"))
    except DataError:
        if strict:
            raise
        return None
    return meta


def _sizes_fit(directory: Path, meta: dict, strict: bool) -> bool:
    """train.bin and val.bin hold exactly the tokens meta.json counts."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for name, count in (("train.bin", meta["n_train"]), ("val.bin", meta["n_val"])):
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        if size != count * itemsize:
            if strict:
                raise DataError(f"{path} holds {'no file' if size is None else f'{size} bytes'}, but "
                                f"{directory / META_NAME} says {count} {meta['dtype']} tokens ({count * itemsize} "
                                f"bytes): it is truncated or damaged; {META_FIX.format(directory=directory)}.")
            return False
    if meta["tokenizer"] in TOKENIZER_KINDS and not (directory / "tokenizer.json").is_file():
        if strict:
            raise DataError(f"{directory / 'tokenizer.json'} is missing; {META_FIX.format(directory=directory)}.")
        return False
    return True


def _ids_fit(directory: Path, meta: dict, strict: bool) -> bool:
    """Every id in train.bin and val.bin is below meta.json's vocabulary size (one vectorized
    pass over each memory-mapped file): an id out of range would only fail deep in the model's
    embedding. When not ``strict`` (a new run), damaged files are tokenized again instead."""
    vocab = meta["vocab_size"]
    for name, count in (("train.bin", meta["n_train"]), ("val.bin", meta["n_val"])):
        path = directory / name
        largest = int(np.max(np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(count,))))
        if largest >= vocab:
            if strict:
                raise DataError(f"{path} holds token id {largest}, but the vocabulary has {vocab} ids (0-{vocab - 1}; "
                                f"{directory / META_NAME}): the data is damaged; "
                                f"{META_FIX.format(directory=directory)}.")
            return False
    return True


def _tokenizer_identity(tokenizer: Tokenizer) -> str:
    """Tells a given tokenizer from another: its class, size and what its first ids decode to."""
    pieces = []
    for i in range(min(tokenizer.vocab_size, 512)):
        try:
            pieces.append(tokenizer.decode([i]))
        except Exception:  # a special or unused id some tokenizers refuse to decode alone
            pieces.append(None)
    digest = hashlib.sha256(json.dumps([type(tokenizer).__name__, tokenizer.vocab_size, pieces]).encode())
    return f"given:{digest.hexdigest()[:16]}"


def _open(directory: Path, meta: dict, tokenizer: Optional[Tokenizer] = None) -> TokenData:
    dtype = np.dtype(meta["dtype"])
    train = np.memmap(directory / "train.bin", dtype=dtype, mode="r", shape=(meta["n_train"],))
    val = np.memmap(directory / "val.bin", dtype=dtype, mode="r", shape=(meta["n_val"],))
    return TokenData(train, val, tokenizer or load_tokenizer(directory / "tokenizer.json"), directory, meta)


# ----------------------------------------------------------------------------- batches

def count_batches(n_tokens: int, batch_size: int, block_size: int) -> int:
    """How many distinct (non-overlapping) batches of windows the tokens hold, counted as
    seed 004 does: windows of block_size + 1 tokens, batch_size windows per batch."""
    return (n_tokens // (block_size + 1)) // batch_size


def check_enough_data(data: TokenData, batch_size: int, block_size: int,
                      minimum: int = MIN_TRAIN_BATCHES) -> None:
    """Refuse to train on a corpus that holds fewer than ``minimum`` distinct training
    batches (the model would memorise it) or not one full validation batch."""
    hint = ("use a smaller --block-size or --batch-size, or add more text")
    n_train = count_batches(len(data.train), batch_size, block_size)
    if n_train < minimum:
        raise DataError(
            f"the training split holds only {n_train} distinct batches of {batch_size} x {block_size + 1} "
            f"tokens ({len(data.train)} tokens); at least {minimum} are needed: {hint}."
        )
    n_val = count_batches(len(data.val), batch_size, block_size)
    if n_val < 1:
        raise DataError(
            f"the validation split ({len(data.val)} tokens) does not hold one batch of {batch_size} x "
            f"{block_size + 1} tokens: {hint} (or a larger validation fraction)."
        )
