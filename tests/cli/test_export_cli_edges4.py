"""``convert`` / ``merge`` refuse, before any work, an output directory a model written there
could not be used from: one line naming the problem and the fix, nothing written.

- OUT_DIR holds a training run (RUN/checkpoint): ``lucidlm.load(RUN)`` reads the run's checkpoint
  before any model written beside it, while transformers would read the new one. The run is the
  user's work and stays as it is; so does a training checkpoint given as OUT_DIR itself.
- A directory stands where the save writes a file (``OUT/config.json/``): the save used to fail
  with an internal error after publishing the weights beside the old model's config.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_run import run_cli

import lucidlm
from lucidlm.config import preset
from lucidlm.model.transformer import Transformer
from lucidlm.weights.checkpoint import save_model

CONFIG = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, max_seq_len=32)


def tiny(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("llama", **CONFIG))


def files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def source(tmp_path) -> Path:
    save_model(tiny(1), tmp_path / "new_model")
    return tmp_path / "new_model"


@pytest.mark.parametrize("command", ["convert", "merge"])
def test_a_training_run_as_output_is_refused_and_kept(tmp_path, source, command):
    run = tmp_path / "old_run"
    save_model(tiny(0), run / "checkpoint")  # stands for a finished `lucidlm train --out old_run`
    before = files(run)
    args = ([str(source), str(run), "--to", "hf", "--force"] if command == "convert"
            else ["--model", str(source), "--adapter", str(tmp_path / "adapter"), "--out", str(run), "--to", "hf",
                  "--force"])
    result = run_cli(command, *args)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "holds a training run" in last and str(run / "checkpoint") in last and "choose another" in last, last
    assert files(run) == before  # nothing written beside the run, nothing of it removed


def test_a_training_checkpoint_as_output_is_refused(tmp_path, source):
    run = tmp_path / "run"
    save_model(tiny(0), run / "checkpoint")
    (run / "checkpoint" / "trainer_state.json").write_text('{"step": 3}')
    before = files(run)
    result = run_cli("convert", str(source), str(run / "checkpoint"), "--to", "hf", "--force")
    assert result.returncode == 1, result.stderr
    assert "is a training checkpoint" in result.stderr and "choose another OUT_DIR" in result.stderr
    assert files(run) == before


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_directory_named_like_a_model_file_is_one_clear_error(tmp_path, source, name):
    out = tmp_path / "out"
    if name == "config.json":
        save_model(tiny(0), out)  # an earlier model (lucidlm's format), to be replaced with --force
    (out / name).mkdir(parents=True)
    before = files(out)
    result = run_cli("convert", str(source), str(out), "--to", "hf", "--force")
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "internal error" not in result.stderr
    assert f"cannot write {out / name}" in last and "choose another OUT_DIR" in last, last
    assert files(out) == before  # no new weights beside the old model's config
    if name == "config.json":
        ids = torch.arange(8)[None]
        with torch.no_grad():
            torch.testing.assert_close(lucidlm.load(out)(ids), tiny(0)(ids))
