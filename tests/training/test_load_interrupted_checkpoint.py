"""A run killed between the two renames that swap a new checkpoint in has no OUT/checkpoint,
only OUT/.checkpoint.old-*: ``lucidlm.load(OUT)`` still loads that previous checkpoint, where
it lies (loading moves nothing; the next ``train --resume`` puts it back)."""

from __future__ import annotations

import torch

import lucidlm
from lucidlm.weights.checkpoint import save_model


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


def test_load_reads_the_checkpoint_a_kill_left_mid_swap(tmp_path):
    model = lucidlm.load("shakespeare-char", random_init=True, seed=3)
    run = tmp_path / "run"
    run.mkdir()
    save_model(model, run / "checkpoint")
    (run / "checkpoint").rename(run / ".checkpoint.old-0a1b2c3d-4242-xyz")  # what the kill leaves
    before = _snapshot(run)
    loaded = lucidlm.load(run)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    assert _snapshot(run) == before
