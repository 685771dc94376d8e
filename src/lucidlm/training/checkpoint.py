"""Training checkpoints: everything needed to continue a run exactly where it stopped.

    OUT/checkpoint/lucidlm_config.json   \
    OUT/checkpoint/model.safetensors      > our model directory format (lucidlm.load reads it)
    OUT/checkpoint/tokenizer.json        /
    OUT/checkpoint/optimizer.safetensors AdamW moments per parameter index; param groups, run id and
                                         step as metadata
    OUT/checkpoint/trainer_state.json    step, best val loss, loss history, RNG states, train config,
                                         the run's identity (resume_checks.py)

A checkpoint is written into ``OUT/.checkpoint.tmp-<host>-<pid>-XXXX/`` and swapped into place
only when every file is complete, so a crash while saving never costs the last good one.
No pickles anywhere: tensors go to safetensors, everything else to JSON.

The swap (``save_checkpoint``): the complete temporary directory gets the permissions ``mkdir``
would give it (``mkdtemp`` makes it 0700: other users could not read the model), then
``checkpoint/`` is renamed to ``.checkpoint.old-<same suffix>``, the temporary one renamed to
``checkpoint/``, and the old one deleted (a symlinked ``checkpoint/`` is unlinked, never followed:
what it points to stays). A SIGKILL at any point leaves a loadable checkpoint: before the first
rename ``checkpoint/`` is untouched; between the renames the previous one lies complete under
``.checkpoint.old-*``, which ``find_checkpoint`` puts back; after the second, ``checkpoint/`` is
the new one. A kill (or a failure) while the old one is deleted leaves it behind; so there can be
several ``.checkpoint.old-*``, and their names (host-pid-random) do not tell which is newest.
``find_checkpoint`` therefore takes the complete one with the highest step (then the newest),
``weights.checkpoint.previous_checkpoints``, the order ``lucidlm.load`` uses too: both read the
same checkpoint. Leftovers are removed by the next run (``remove_stale_temporaries``), only once a
complete ``checkpoint/`` exists, and only those ``staging.is_stale`` proves abandoned (their
writer, named in the directory's name, is gone), never one a live run is swapping.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lucidlm.errors import CheckpointError
from lucidlm.staging import is_stale, ordinary_mode, owner_alive, owner_marker, remove_entry
from lucidlm.training.kill_points import kill_point
from lucidlm.training.resume_checks import check_optimizer_state
from lucidlm.training.resume_checks import read_trainer_state as _read_checked_state
from lucidlm.weights.checkpoint import (CONFIG_NAME, OLD_CHECKPOINT_PREFIX, OPTIMIZER_STATE_NAME, TRAINER_STATE_NAME,
                                        WEIGHTS_NAME, previous_checkpoints, saved_step)

CHECKPOINT_DIR = "checkpoint"
OPTIMIZER_NAME = OPTIMIZER_STATE_NAME
STATE_NAME = TRAINER_STATE_NAME
TMP_PREFIX = ".checkpoint.tmp-"
OLD_PREFIX = OLD_CHECKPOINT_PREFIX


# ----------------------------------------------------------------------------- RNG states

def encode_rng_state(state: torch.Tensor) -> str:
    """A ByteTensor RNG state as base64 text for JSON."""
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def decode_rng_state(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


# ----------------------------------------------------------------------------- optimizer

def save_optimizer(state: dict[str, Any], path: Path, belongs: Optional[dict[str, str]] = None) -> None:
    """An optimizer ``state_dict()`` flattened to ``state.{param_index}.{exp_avg|exp_avg_sq|step}``
    tensors; the param groups (lr, betas, weight decay, which indices) go in the metadata, with
    ``belongs`` (the run's id and the step) so a resume recognises a file from another run."""
    tensors = {}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            tensors[f"state.{index}.{key}"] = value.detach().contiguous().cpu() if torch.is_tensor(value) \
                else torch.tensor(value)
    save_file(tensors, str(path), metadata={"param_groups": json.dumps(state["param_groups"]), **(belongs or {})})


def read_optimizer(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``state_dict()`` that ``save_optimizer`` wrote, and the file's metadata."""
    fix = "the checkpoint is damaged; restore OUT/checkpoint from a copy, or start a new run with another --out"
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as f:  # safetensors' header: 8-byte length, then JSON with __metadata__
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        metadata = header.get("__metadata__") or {}
        groups = json.loads(metadata["param_groups"])
    except (SafetensorError, OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise CheckpointError(f"{path} cannot be read ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                              f"{fix}.") from None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise CheckpointError(f"{path}: metadata 'param_groups' is not a list of groups with 'params'; {fix}.")
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise CheckpointError(f"{path}: tensor {name!r} is not an optimizer state (state.INDEX.KEY); {fix}.")
        state.setdefault(int(parts[1]), {})[parts[2]] = tensor
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}, metadata


def read_optimizer_file(path: Path) -> dict[str, Any]:
    """The ``state_dict()`` that ``save_optimizer`` wrote."""
    return read_optimizer(path)[0]


# How AdamW runs, not where it is on its trajectory: the resumed run's own choice (--no-fused-adamw,
# no fused kernel for FSDP on CPU), which ``load_state_dict`` would otherwise take from the saved groups.
RUNTIME_OPTIONS = ("fused", "foreach", "capturable")


def keep_runtime_options(loaded: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Give the saved param groups of ``loaded`` the runtime options of ``optimizer`` (built for
    this run), before loading: then ``load_state_dict`` also places each ``step`` as this run's
    kernel wants it (a float32 tensor on the parameter's device for the fused one)."""
    for saved, group in zip(loaded["param_groups"], optimizer.param_groups):  # counts checked to match
        for key in RUNTIME_OPTIONS:
            if key in group:
                saved[key] = group[key]


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path,
                   trainer_state: Optional[dict[str, Any]] = None) -> None:
    """Load after checking the file fits ``optimizer`` and belongs to ``trainer_state``'s run."""
    loaded, metadata = read_optimizer(path)
    check_optimizer_state(loaded, metadata, optimizer, path, trainer_state)
    keep_runtime_options(loaded, optimizer)
    try:
        optimizer.load_state_dict(loaded)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{path} does not fit this model's optimizer ({exc}).") from None


# ----------------------------------------------------------------------------- save / load

def save_checkpoint(out_dir: Path, write_payload: Callable[[Path], None], optimizer_state: dict[str, Any],
                    trainer_state: dict[str, Any]) -> Path:
    """Write OUT/checkpoint atomically: build it beside, then swap directories.
    ``write_payload(directory)`` writes the weights (see ``checkpointer.py``)."""
    out_dir = Path(out_dir)
    final = out_dir / CHECKPOINT_DIR
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=TMP_PREFIX + owner_marker()))  # who writes it: see staging.py
    try:
        write_payload(tmp)
        kill_point("checkpoint")  # test seam: the weights are written, optimizer and state not yet
        run_id = (trainer_state.get("run") or {}).get("id")
        belongs = {"step": str(trainer_state["step"]), **({"run": run_id} if run_id else {})}
        save_optimizer(optimizer_state, tmp / OPTIMIZER_NAME, belongs)
        (tmp / STATE_NAME).write_text(json.dumps(trainer_state, indent=1) + "\n")
        _fsync_dir(tmp)
        os.chmod(tmp, ordinary_mode(0o777))  # as mkdir makes it: mkdtemp's 0700 would hide the model
        for path in tmp.iterdir():  # and the files as open makes them: safetensors writes 0600
            if path.is_file() and not path.is_symlink():
                os.chmod(path, ordinary_mode(0o666))
        # A directory cannot be renamed over a non-empty one: move the old one aside, move
        # the new one in, then delete the old. A crash between the two renames leaves the
        # old one under OLD_PREFIX, which find_checkpoint() puts back.
        old = out_dir / f"{OLD_PREFIX}{tmp.name[len(TMP_PREFIX):]}"
        if final.exists() or final.is_symlink():
            os.replace(final, old)
            kill_point("swap")  # test seam: between the two renames
        os.replace(tmp, final)
        _discard(old)  # left behind if this fails (or a kill cuts it short): see remove_stale_temporaries
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _fsync_dir(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _discard(path: Path) -> None:
    """Delete ``path`` if it exists (a symlink is unlinked, not followed); never raises."""
    try:
        remove_entry(path)
    except OSError:  # already gone, or cannot be deleted: remove_stale_temporaries tries again
        pass


def find_checkpoint(out_dir: Path, restore: bool = True) -> Path | None:
    """OUT/checkpoint if it exists, after recovering from a crash mid-swap (the previous
    checkpoint put back from ``.checkpoint.old-*``: of several, the complete one with the highest
    step); None if there is none. ``restore=False`` moves nothing and returns where the
    checkpoint lies (an old directory when a kill left one)."""
    out_dir = Path(out_dir)
    final = out_dir / CHECKPOINT_DIR
    if not final.is_dir():
        olds = previous_checkpoints(out_dir)  # complete ones first: one that is not is put back only when
        if olds:                              # nothing better exists, so that loading it names what is missing
            if not restore:
                return olds[0]
            os.replace(olds[0], final)
    return final if final.is_dir() else None


def remove_stale_temporaries(out_dir: Path) -> None:
    """Half-written checkpoints left by a killed process (never one a live process is writing),
    and, once a complete OUT/checkpoint exists, previous checkpoints (``.checkpoint.old-*``)
    whose deletion a kill or a failure cut short, when ``staging.is_stale`` proves them abandoned."""
    out_dir = Path(out_dir)
    for path in out_dir.glob(f"{TMP_PREFIX}*"):
        if owner_alive(path.name) is not True:
            _discard(path)
    if saved_step(out_dir / CHECKPOINT_DIR) is None:  # an old one may be the only whole checkpoint
        return
    for path in out_dir.glob(f"{OLD_PREFIX}*"):
        if is_stale(path):
            _discard(path)


def read_trainer_state(checkpoint: Path, payload: str = WEIGHTS_NAME) -> dict[str, Any]:
    """The checkpoint's trainer_state.json, after checking every file of it is there and the
    state's fields are well-formed (``resume_checks.read_trainer_state``)."""
    needed_files = (CONFIG_NAME, WEIGHTS_NAME) if payload == WEIGHTS_NAME else (payload,)
    for needed in (*needed_files, OPTIMIZER_NAME, STATE_NAME):
        if not (checkpoint / needed).is_file():
            raise CheckpointError(
                f"{checkpoint / needed} is missing: {checkpoint} is not a complete training checkpoint; "
                f"start a new run without --resume.")
    return _read_checked_state(checkpoint / STATE_NAME)
