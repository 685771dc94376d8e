"""A model or adapter saved to "~/..." lands in the home directory, where ``lucidlm.load`` and
``load_adapter`` look for "~/..." (as the CLI, ``TrainConfig`` and every loader read "~"), not in
a directory literally named "~" under the working directory. ``os.path.expanduser`` is the oracle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import lucidlm
from lucidlm.peft import add_lora, load_adapter, save_adapter
from lucidlm.weights.checkpoint import save_model
from lucidlm.weights.hf import save_hf


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


def tiny():
    torch.manual_seed(0)
    return lucidlm.load("llama", random_init=True, n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, vocab_size=32,
                        max_seq_len=16, multiple_of=16)


@pytest.mark.parametrize("save", [save_model, save_hf])
def test_a_model_saved_to_home_loads_from_home(home, save):
    model = tiny()
    assert save(model, "~/m") == Path(os.path.expanduser("~/m"))
    assert os.path.isdir(os.path.expanduser("~/m")) and os.listdir(home / "cwd") == []
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(lucidlm.load("~/m")(ids), model(ids))


def test_an_adapter_saved_to_home_loads_from_home(home):
    model = tiny()
    add_lora(model, r=2, targets=("q", "v"))
    save_adapter(model, "~/a")
    assert os.path.isfile(os.path.join(os.path.expanduser("~/a"), "adapter_config.json"))
    assert os.listdir(home / "cwd") == []
    load_adapter(tiny(), "~/a")
