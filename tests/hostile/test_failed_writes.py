"""A write that fails part-way (a full disk, a file-size limit) keeps the file an earlier save
wrote, whole, and leaves no staging file behind: every writer goes through
``lucidlm.staging``'s atomic write. The failure is real, not mocked: the process's file-size
limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the kernel refuse writes past a few bytes with
EFBIG, as a full disk refuses them with ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import resource
import signal
from pathlib import Path

import pytest

from lucidlm import ModelConfig
from lucidlm.tokenizers import CharTokenizer

LIMIT = 64  # bytes: every file below is longer


@contextlib.contextmanager
def file_size_limit(limit: int = LIMIT):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def fails_and_keeps(path: Path, write) -> None:
    """``write()`` once, then again under the limit: it raises EFBIG and ``path`` and its
    directory are exactly as the first write left them."""
    write()
    before = {p.name: p.read_bytes() for p in path.parent.iterdir()}
    assert len(path.read_bytes()) > LIMIT
    with pytest.raises(OSError) as info, file_size_limit():
        write()
    assert info.value.errno == errno.EFBIG
    assert {p.name: p.read_bytes() for p in path.parent.iterdir()} == before


def test_a_failed_tokenizer_save_keeps_the_saved_tokenizer(tmp_path):
    tokenizer = CharTokenizer.train("to be or not to be, that is the question")
    path = tmp_path / "tokenizer.json"
    fails_and_keeps(path, lambda: tokenizer.save(path))
    assert CharTokenizer.load(path).encode("to be") == tokenizer.encode("to be")


def test_a_failed_config_save_keeps_the_saved_config(tmp_path):
    config = ModelConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    path = tmp_path / "config.json"
    fails_and_keeps(path, lambda: config.save(path))
    assert ModelConfig.load(path) == config
