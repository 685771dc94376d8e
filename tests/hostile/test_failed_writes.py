"""A write that fails part-way (a full disk, a file-size limit) keeps the file an earlier save
wrote, whole, and leaves no staging file behind: every writer goes through
``lucidlm.staging``'s atomic write. The failure is real, not mocked (``file_limits``)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from file_limits import file_size_limit

from lucidlm import ModelConfig
from lucidlm.tokenizers import CharTokenizer

LIMIT = 64  # bytes: every file below is longer


def fails_and_keeps(path: Path, write) -> None:
    """``write()`` once, then again under the limit: it raises EFBIG and ``path`` and its
    directory are exactly as the first write left them."""
    write()
    before = {p.name: p.read_bytes() for p in path.parent.iterdir()}
    assert len(path.read_bytes()) > LIMIT
    with pytest.raises(OSError) as info, file_size_limit(LIMIT):
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


def test_a_failed_metrics_rewrite_keeps_the_records_and_leaves_no_temporary_file(tmp_path):
    from types import SimpleNamespace

    from lucidlm.training.callbacks import MetricsLog

    records = [{"step": step, "train_loss": 2.0 / step, "val_loss": 2.5 / step} for step in (1, 2, 3, 4)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    records = records[:3]  # a resume from step 3's checkpoint keeps these: step 4's evaluation runs again
    log = MetricsLog(tmp_path, "run")
    before = path.read_bytes()
    with pytest.raises(OSError) as info, file_size_limit(LIMIT):
        log.on_fit_start(SimpleNamespace(last_eval_step=3))  # rewrites the file without step 4
    assert info.value.errno == errno.EFBIG
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"] and path.read_bytes() == before
    trainer = SimpleNamespace(last_eval_step=3)
    log.on_fit_start(trainer)
    assert trainer.metrics == records and path.read_text() == "".join(json.dumps(r) + "\n" for r in records)


def test_a_failed_data_preparation_leaves_no_temporary_file(tmp_path):
    from lucidlm.training.data import META_NAME, prepare_data

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be " * 3)  # 57 tokens: train.bin and val.bin stay under the limit
    tokenizer = CharTokenizer.train(corpus.read_text())  # given: no tokenizer.json is written
    with pytest.raises(OSError) as info, file_size_limit(200):
        prepare_data(corpus, tmp_path / "run", tokenizer)  # meta.json, written last, is over the limit
    assert info.value.errno == errno.EFBIG
    assert sorted(p.name for p in (tmp_path / "run" / "data").iterdir()) == ["train.bin", "val.bin"]
    data = prepare_data(corpus, tmp_path / "run", tokenizer)  # no meta.json: the data is made again
    assert (tmp_path / "run" / "data" / META_NAME).is_file()
    assert tokenizer.decode([int(i) for i in data.train[:5]]) == "to be"


# -- through the CLI: a file too large for the file system is one line, as a full disk is -----------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import lucidlm
    from lucidlm.weights.checkpoint import save_model

    model = lucidlm.load("gpt2", random_init=True, n_layers=1, d_model=16, n_heads=2, max_seq_len=16)
    return save_model(model, tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("to", ["hf", "lucidlm"])
def test_convert_to_a_file_system_too_small_for_the_weights_is_one_line(tiny_dir, tmp_path, to):
    from harness import main_refused

    out = tmp_path / "out"
    with file_size_limit(LIMIT):  # as FAT32 refuses a file over 4 GiB, or `ulimit -f`
        main_refused("convert", str(tiny_dir), str(out), "--to", to,
                     names=[f"File too large while writing {out}", "ulimit -f", "choose another OUT_DIR"],
                     watch=[tiny_dir])
    assert not out.exists() or not list(out.iterdir())  # no staging file left behind
