"""What killed or failed checkpoint swaps leave in OUT, and what the next run makes of it:
several ``.checkpoint.old-*`` directories (``--resume`` and ``lucidlm.load`` both take the
complete one with the highest step), stale ones removed once a whole ``checkpoint/`` exists
(never a live run's), a symlinked ``checkpoint/`` unlinked rather than followed, the ordinary
permissions of ``checkpoint/``, and ``--resume`` edge cases (a finished run, a missing OUT,
damaged token files).

Training runs go through ``lucidlm_run`` (forked CLI runs killed at the ``LUCIDLM_TEST_KILL_AT``
seam) from ``test_kill_resume.py``."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_kill_resume import corpus, imported_once, lucidlm_run, saved_state, tiny  # noqa: F401  (fixtures)

import lucidlm
from lucidlm import cli
from lucidlm.staging import owner_marker
from lucidlm.training import checkpoint as ckpt
from lucidlm.training.config import command_line
from lucidlm.weights.checkpoint import CONFIG_NAME, WEIGHTS_NAME, interrupted_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def olds(out: Path) -> list[Path]:
    return sorted(out.glob(f"{ckpt.OLD_PREFIX}*"))


def step_of(path: Path) -> int:
    return json.loads((path / ckpt.STATE_NAME).read_text())["step"]


def test_resume_and_load_take_the_highest_step_of_the_leftovers(corpus, tmp_path, capfd):
    config = tiny(corpus, tmp_path / "run")
    out = Path(config.out_dir)
    lucidlm_run(config, "train", "step:6")  # a checkpoint at step 4
    step4 = shutil.copytree(out / "checkpoint", tmp_path / "step4")
    # What a kill during rmtree(old) (or a failed rmtree) leaves: the previous checkpoint, by a dead process
    leftover = out / f"{ckpt.OLD_PREFIX}{owner_marker(dead_pid())}leftover"
    shutil.copytree(step4, leftover)
    lucidlm_run(config, "train", resume=True, max_iters=9)  # a complete checkpoint/ at step 9
    assert step_of(out / "checkpoint") == 9
    assert olds(out) == []  # the stale leftover is gone once a complete checkpoint/ exists
    step9 = shutil.copytree(out / "checkpoint", tmp_path / "step9")

    lucidlm_run(config, "train", "swap:1", resume=True)  # saving step 12: killed between the two renames
    assert not (out / "checkpoint").exists() and [step_of(p) for p in olds(out)] == [9]
    # Another leftover, older in steps but newer on disk and last by name: neither may win.
    planted = out / f"{ckpt.OLD_PREFIX}~leftover"
    shutil.copytree(step4, planted)
    later = time.time() + 100
    os.utime(planted, (later, later))

    found = interrupted_checkpoint(out)  # what lucidlm.load reads, moving nothing
    assert found != planted and step_of(found) == 9
    loaded, expected = lucidlm.load(str(out)), lucidlm.load(str(step9))
    assert not (out / "checkpoint").exists()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), expected.state_dict().values()))

    capfd.readouterr()
    lucidlm_run(config, "train", resume=True)  # (the forked run prints into pytest's capture)
    assert "resuming at step 9" in capfd.readouterr().out
    assert saved_state(out)["step"] == 12 and len(saved_state(out)["train_losses"]) == 12
    assert olds(out) == [planted]  # nobody's is known dead (no host-pid in its name) and it is fresh: kept


def _complete_checkpoint(directory: Path, step: int) -> Path:
    """The files of a complete training checkpoint (contents only as far as the cleanup looks)."""
    directory.mkdir(parents=True)
    for name in (CONFIG_NAME, WEIGHTS_NAME, ckpt.OPTIMIZER_NAME):
        (directory / name).write_text("{}")
    (directory / ckpt.STATE_NAME).write_text(json.dumps({"step": step}))
    return directory


def test_stale_previous_checkpoints_are_removed_only_when_abandoned(tmp_path):
    out = tmp_path / "run"
    outside = _complete_checkpoint(tmp_path / "outside", 2)  # a checkpoint/ the user had symlinked
    dead = _complete_checkpoint(out / f"{ckpt.OLD_PREFIX}{owner_marker(dead_pid())}a", 3)
    live = _complete_checkpoint(out / f"{ckpt.OLD_PREFIX}{owner_marker()}b", 4)  # this live process's swap
    foreign = _complete_checkpoint(out / f"{ckpt.OLD_PREFIX}0a1b2c3d-4242-c", 5)  # another host's, fresh
    half = out / f"{ckpt.OLD_PREFIX}{owner_marker(dead_pid())}d"  # a deletion cut short
    half.mkdir()
    (half / ckpt.STATE_NAME).write_text(json.dumps({"step": 99}))
    link = out / f"{ckpt.OLD_PREFIX}{owner_marker(dead_pid())}e"
    link.symlink_to(outside, target_is_directory=True)

    ckpt.remove_stale_temporaries(out)  # no checkpoint/ yet: an old one may be the only whole checkpoint
    assert olds(out) == sorted([dead, live, foreign, half, link])
    assert ckpt.find_checkpoint(out, restore=False) == foreign  # the highest complete step; moves nothing
    assert olds(out) == sorted([dead, live, foreign, half, link])

    _complete_checkpoint(out / "checkpoint", 6)
    ckpt.remove_stale_temporaries(out)
    assert olds(out) == sorted([live, foreign])
    assert sorted(p.name for p in outside.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME, ckpt.OPTIMIZER_NAME,
                                                               ckpt.STATE_NAME])  # unlinked, not followed


def _save(out: Path, step: int) -> Path:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()

    def payload(directory: Path) -> None:
        (directory / CONFIG_NAME).write_text("{}")
        (directory / WEIGHTS_NAME).write_text("weights")

    return ckpt.save_checkpoint(out, payload, optimizer.state_dict(), {"step": step})


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_directory_has_ordinary_permissions(tmp_path, umask):
    previous = os.umask(umask)
    try:
        final = _save(tmp_path, 1)
        again = _save(tmp_path, 2)  # and after a swap
    finally:
        os.umask(previous)
    assert final == again == tmp_path / "checkpoint" and step_of(final) == 2
    assert final.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (final / WEIGHTS_NAME).stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_symlinked_checkpoint_is_swapped_out_not_followed(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    elsewhere = tmp_path / "bigdisk"
    (tmp_path / "first").mkdir()
    _save(tmp_path / "first", 1).rename(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    (out / "checkpoint").symlink_to(elsewhere, target_is_directory=True)
    final = _save(out, 2)
    assert not final.is_symlink() and step_of(final) == 2
    assert olds(out) == [] and list(out.glob(f"{ckpt.TMP_PREFIX}*")) == []  # nothing leaked
    assert sorted(p.name for p in elsewhere.iterdir()) == before and step_of(elsewhere) == 1  # left alone


def cli_train(config, capsys, **changes) -> tuple[int, str, str]:
    code = cli.main(shlex.split(command_line(config, "train", **changes))[1:])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_resume_edges_finished_run_missing_out_damaged_tokens(corpus, tmp_path, capsys):
    config = tiny(corpus, tmp_path / "run")
    out = Path(config.out_dir)
    lucidlm_run(config, "train", max_iters=4)
    weights = load_file(str(out / "checkpoint" / WEIGHTS_NAME))

    code, stdout, _ = cli_train(config, capsys, max_iters=4, resume=True)  # nothing left to run
    assert code == 0 and f"model in {out / 'checkpoint'} " in stdout and "None" not in stdout
    assert all(torch.equal(weights[k], v) for k, v in load_file(str(out / "checkpoint" / WEIGHTS_NAME)).items())

    missing = tmp_path / "nope" / "deeper"
    code, _, stderr = cli_train(config, capsys, out_dir=str(missing), resume=True)
    assert code == 1 and f"there is no checkpoint in {missing / 'checkpoint'}" in stderr
    assert not (tmp_path / "nope").exists()  # a refused --resume changes nothing on disk

    train_bin = out / "data" / "train.bin"
    tokens = np.fromfile(train_bin, dtype=np.uint16)
    tokens[len(tokens) // 2] = 60000
    tokens.tofile(train_bin)
    vocab = json.loads((out / "data" / "meta.json").read_text())["vocab_size"]
    code, _, stderr = cli_train(config, capsys, max_iters=8, resume=True)
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "internal error" not in stderr
    assert f"{train_bin} holds token id 60000, but the vocabulary has {vocab} ids" in lines[0]
    assert f"the data is damaged; delete the folder {out / 'data'}" in lines[0]
    assert step_of(out / "checkpoint") == 4  # refused before any step

    shutil.rmtree(out / "data")  # what the line advises: the data is tokenized again, and the run goes on
    code, stdout, _ = cli_train(config, capsys, max_iters=8, resume=True)
    assert code == 0 and step_of(out / "checkpoint") == 8
