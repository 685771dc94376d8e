"""Training checkpoints: everything needed to continue a run exactly where it stopped.

    OUT/checkpoint/lucidlm_config.json   \
    OUT/checkpoint/model.safetensors      > our model directory format (lucidlm.load reads it)
    OUT/checkpoint/tokenizer.json        /
    OUT/checkpoint/optimizer.safetensors AdamW moments per parameter index; param groups as JSON metadata
    OUT/checkpoint/trainer_state.json    step, best val loss, loss history, RNG states, train config

A checkpoint is written into ``OUT/.checkpoint.tmp-XXXX/`` and swapped into place only
when every file is complete, so a crash while saving never costs the last good one.
No pickles anywhere: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lucidlm.errors import CheckpointError
from lucidlm.weights.checkpoint import CONFIG_NAME, WEIGHTS_NAME

CHECKPOINT_DIR = "checkpoint"
OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "trainer_state.json"
TMP_PREFIX = ".checkpoint.tmp-"
OLD_PREFIX = ".checkpoint.old-"


# ----------------------------------------------------------------------------- RNG states

def encode_rng_state(state: torch.Tensor) -> str:
    """A ByteTensor RNG state as base64 text for JSON."""
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def decode_rng_state(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


# ----------------------------------------------------------------------------- optimizer

def save_optimizer(state: dict[str, Any], path: Path) -> None:
    """An optimizer ``state_dict()`` flattened to ``state.{param_index}.{exp_avg|exp_avg_sq|step}``
    tensors; the param groups (lr, betas, weight decay, which indices) go in the metadata."""
    tensors = {}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            tensors[f"state.{index}.{key}"] = value.detach().contiguous().cpu() if torch.is_tensor(value) \
                else torch.tensor(value)
    save_file(tensors, str(path), metadata={"param_groups": json.dumps(state["param_groups"])})


def read_optimizer_file(path: Path) -> dict[str, Any]:
    """The ``state_dict()`` that ``save_optimizer`` wrote."""
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as f:  # safetensors' header: 8-byte length, then JSON with __metadata__
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        groups = json.loads(header["__metadata__"]["param_groups"])
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path} cannot be read ({exc}); the checkpoint is corrupted.") from None
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = tensor
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    loaded = read_optimizer_file(path)
    try:
        optimizer.load_state_dict(loaded)
    except ValueError as exc:
        raise CheckpointError(f"{path} does not fit this model's optimizer ({exc}).") from None


# ----------------------------------------------------------------------------- save / load

def save_checkpoint(out_dir: Path, write_payload: Callable[[Path], None], optimizer_state: dict[str, Any],
                    trainer_state: dict[str, Any]) -> Path:
    """Write OUT/checkpoint atomically: build it beside, then swap directories.
    ``write_payload(directory)`` writes the weights (see ``checkpointer.py``)."""
    out_dir = Path(out_dir)
    final = out_dir / CHECKPOINT_DIR
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=TMP_PREFIX))
    try:
        write_payload(tmp)
        save_optimizer(optimizer_state, tmp / OPTIMIZER_NAME)
        (tmp / STATE_NAME).write_text(json.dumps(trainer_state, indent=1) + "\n")
        _fsync_dir(tmp)
        # A directory cannot be renamed over a non-empty one: move the old one aside, move
        # the new one in, then delete the old. A crash between the two renames leaves the
        # old one under OLD_PREFIX, which find_checkpoint() puts back.
        old = out_dir / f"{OLD_PREFIX}{tmp.name[len(TMP_PREFIX):]}"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _fsync_dir(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def find_checkpoint(out_dir: Path) -> Path | None:
    """OUT/checkpoint if it exists, after recovering from a crash mid-swap; None if there is none."""
    out_dir = Path(out_dir)
    final = out_dir / CHECKPOINT_DIR
    if not final.is_dir():
        olds = sorted(out_dir.glob(f"{OLD_PREFIX}*"))
        if olds and (olds[-1] / STATE_NAME).is_file():
            os.replace(olds[-1], final)
    return final if final.is_dir() else None


def remove_stale_temporaries(out_dir: Path) -> None:
    """Half-written checkpoints left by a killed process."""
    for path in Path(out_dir).glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)


def read_trainer_state(checkpoint: Path, payload: str = WEIGHTS_NAME) -> dict[str, Any]:
    path = checkpoint / STATE_NAME
    needed_files = (CONFIG_NAME, WEIGHTS_NAME) if payload == WEIGHTS_NAME else (payload,)
    for needed in (*needed_files, OPTIMIZER_NAME, STATE_NAME):
        if not (checkpoint / needed).is_file():
            raise CheckpointError(
                f"{checkpoint / needed} is missing: {checkpoint} is not a complete training checkpoint; "
                f"start a new run without --resume."
            )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is corrupted.") from None
