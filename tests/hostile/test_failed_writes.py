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


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    fig.add_subplot().plot([1, 2, 3])
    return fig


def test_a_failed_figure_save_keeps_the_saved_figures(tmp_path):
    from lucidlm.inspect.plots import save_figure

    fig = _figure()
    fails_and_keeps(tmp_path / "attention.png", lambda: save_figure(fig, tmp_path / "attention"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention.png", "attention.svg"]


def test_a_failed_loss_plot_keeps_the_last_one(tmp_path):
    from lucidlm.inspect.loss_plot import plot_loss_curves

    records = [{"step": 1, "train_loss": 2.0, "val_loss": 2.1}, {"step": 2, "train_loss": 1.5, "val_loss": 1.7}]
    path = tmp_path / "loss.png"
    fails_and_keeps(path, lambda: plot_loss_curves(records, path, [3.0, 2.0]))
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_failed_length_report_keeps_the_last_one(tmp_path):
    from lucidlm.training.length_report import write_length_report

    fails_and_keeps(tmp_path / "token_lengths.json", lambda: write_length_report([3, 4, 5, 9], 5, tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token_lengths.json", "token_lengths.png"]
