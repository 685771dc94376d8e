"""What a resume checks before it writes anything: that every state file in OUT/checkpoint
is whole and well-formed, and that the checkpoint, the corpus and the tokenizer all belong
to the same run.

A run's identity is recorded when it starts and saved with every checkpoint:

    trainer_state.json  "run": {"corpus_sha256", "tokenizer_sha256", "id"}, and "base_sha256"
                        (the frozen base weights) for a fine-tune that saves only its adapter
    optimizer.safetensors  metadata "run" (the same id) and "step"

``id`` hashes the settings that shape the trajectory (seed, widths, schedule...), the corpus
bytes and the tokenizer's vocabulary, so an optimizer file copied from another run (another
seed, another width) or from another step of this one is recognised as foreign.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch

from lucidlm.errors import CheckpointError
from lucidlm.validation import read_json_object

# trainer_state.json's layout. 2 (2026-12-07): example runs with gradient accumulation draw and
# weigh micro-batches as one big batch (since e2ddad3, 2026-11-27); format 1 files came before.
TRAINER_STATE_FORMAT = 2
DAMAGED = ("the checkpoint is damaged; restore OUT/checkpoint from a copy, or start a new run with another "
           "--out")


# ----------------------------------------------------------------------------- identity

def corpus_sha256(files: Iterable[Path]) -> str:
    """sha256 over the corpus files' names, sizes and bytes, in the order they are read."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{Path(f).name}|{Path(f).stat().st_size}\n".encode())
        with open(f, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 of the tokenizer's serialized vocabulary, merges and special tokens."""
    data = {"type": getattr(tokenizer, "type_name", type(tokenizer).__name__), **tokenizer._to_dict()}
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every tensor of ``model``'s state (name, dtype, shape, bytes), in name order.
    A fine-tune that trains an adapter stores only the adapter: resuming it on other base
    weights would silently continue a different model."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the bytes as stored, no copy
    return h.hexdigest()


def run_identity(fixed_settings: Mapping[str, Any], corpus: str, tokenizer: str,
                 base: Optional[str] = None) -> dict[str, str]:
    """What ``trainer_state.json`` records under "run" (``base``: the frozen base weights' sha256,
    for fine-tunes that save only what they train)."""
    text = json.dumps({"settings": dict(fixed_settings), "corpus": corpus, "tokenizer": tokenizer},
                      sort_keys=True, default=str)
    identity = {"corpus_sha256": corpus, "tokenizer_sha256": tokenizer,
                "id": hashlib.sha256(text.encode()).hexdigest()}
    return identity if base is None else {**identity, "base_sha256": base}


def check_same_data(state: Mapping[str, Any], key: str, current: str, what: str, source: Any,
                    checkpoint: Path) -> None:
    """Refuse when the corpus or tokenizer (``key`` in the saved "run") is not the run's own."""
    saved = (state.get("run") or {}).get(key)
    if saved is not None and saved != current:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: {what} {source} is not the one this run was trained on "
            f"({key} {saved[:12]}... in {checkpoint / 'trainer_state.json'}, now {current[:12]}...). Resume with "
            f"{what} as it was, or start a new run with another --out. Nothing was changed.")


# ----------------------------------------------------------------------------- trainer_state.json

def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer_state.json, every field the resume reads checked (types, ranges, RNG states)."""
    fields = read_json_object(path, CheckpointError, "trainer state", DAMAGED)
    version = fields.format_version("format_version", TRAINER_STATE_FORMAT, to="resume this run")
    step = fields.int("step", low=0)
    fields.int("last_eval_step", default=-1, low=-1, high=step)
    fields.int("world_size", default=1, low=1)
    fields.float("best_val_loss", default=None)
    losses = fields.list("train_losses", default=[])
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses):
        _bad(path, "train_losses", losses, "a list of numbers")
    sampler = fields.raw("data")
    if isinstance(sampler, str):  # random windows: the sampler's generator state
        check_cpu_rng_state(sampler, path, "data")
    elif isinstance(sampler, Mapping):  # whole examples: where in which epoch (its range is checked when applied)
        examples = fields.object("data")
        examples.int("epoch", low=0)
        examples.int("position", low=0)
    else:
        _bad(path, "data", sampler, "the batch sampler's state (an RNG state or an object)")
    train_config = fields.object("train_config", default={})
    accumulation = train_config.data.get("gradient_accumulation_steps", 1)
    if version < 2 and isinstance(sampler, Mapping) and accumulation != 1:
        warnings.warn(f"{path} was saved by a lucidlm before 2026-11-27, which drew and weighed the micro-batches "
                      f"of gradient accumulation otherwise: the resumed run goes on with today's (exact) weighting, "
                      f"so it will not retrace the run the old version would have made.", stacklevel=2)
    run = fields.object("run", default={})
    for key in ("corpus_sha256", "tokenizer_sha256", "id", "base_sha256"):
        run.str(key, default=None)
    torch_states = fields.list("torch_rng", item=str)
    if not torch_states:
        _bad(path, "torch_rng", torch_states, "one RNG state per process")
    for i, text in enumerate(torch_states):
        check_cpu_rng_state(text, path, f"torch_rng[{i}]")
    for i, text in enumerate(fields.list("cuda_rng", default=[], item=str)):
        decode_checked(text, path, f"cuda_rng[{i}]")
    return dict(fields.data)


def decode_checked(text: Any, source: Any, field: str) -> torch.Tensor:
    """A base64 RNG state as a ByteTensor, or CheckpointError naming ``source`` and ``field``."""
    try:
        raw = base64.b64decode(text, validate=True) if isinstance(text, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if not raw:
        _bad(source, field, text, "a base64 RNG state")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def check_cpu_rng_state(text: Any, source: Any, field: str) -> torch.Tensor:
    """A CPU generator state that torch accepts (right size, valid mt19937 state)."""
    state = decode_checked(text, source, field)
    try:
        torch.Generator().set_state(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{source}: field {field!r} is not a CPU RNG state ({str(exc).splitlines()[0]}); "
                              f"{DAMAGED}.") from None
    return state


def _bad(source: Any, field: str, value: Any, wanted: str) -> None:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise CheckpointError(f"{source}: field {field!r} is {shown}; expected {wanted}; {DAMAGED}.")


# ----------------------------------------------------------------------------- optimizer.safetensors

def check_optimizer_state(loaded: Mapping[str, Any], metadata: Mapping[str, str],
                          optimizer: torch.optim.Optimizer, path: Path, state: Optional[Mapping[str, Any]]) -> None:
    """The saved AdamW state fits this optimizer (groups, every moment's shape) and belongs to
    the checkpoint's run and step (``state``: its trainer_state.json)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = loaded["param_groups"]
    sizes = [len(g.get("params", [])) if isinstance(g, Mapping) else -1 for g in groups]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(f"{path}: its parameter groups hold {sizes} parameters, this model's optimizer "
                              f"{[len(g['params']) for g in optimizer.param_groups]}; it was written for another "
                              f"model. Resume with the original settings, or start a new run with another --out.")
    saved = loaded["state"]
    step = int(state.get("step", 0)) if state is not None else None
    if step and not saved:
        raise CheckpointError(f"{path} holds no AdamW moments, but the run is at step {step}; {DAMAGED}.")
    for index in sorted(set(saved) - set(range(len(params)))):
        raise CheckpointError(f"{path}: state.{index} names no parameter of this model ({len(params)} "
                              f"parameters); it was written for another model. {DAMAGED[0].upper() + DAMAGED[1:]}.")
    for index, param in enumerate(params if saved else []):
        slots = saved.get(index, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key not in slots:
                raise CheckpointError(f"{path} lacks the tensor state.{index}.{key}; {DAMAGED}.")
        for key in ("exp_avg", "exp_avg_sq"):
            if tuple(slots[key].shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{path}: state.{index}.{key} has shape {tuple(slots[key].shape)}, but parameter {index} of "
                    f"this model has shape {tuple(param.shape)}; the file comes from a run of another width. "
                    f"Resume with the original settings, or start a new run with another --out.")
        if slots["step"].numel() != 1:
            raise CheckpointError(f"{path}: state.{index}.step has shape {tuple(slots['step'].shape)}, expected "
                                  f"one number; {DAMAGED}.")
    _check_belongs(metadata, path, state)


def _check_belongs(metadata: Mapping[str, str], path: Path, state: Optional[Mapping[str, Any]]) -> None:
    if state is None:
        return
    run_id = (state.get("run") or {}).get("id")
    saved_id, saved_step = metadata.get("run"), metadata.get("step")
    if run_id is not None and saved_id is not None and saved_id != run_id:
        raise CheckpointError(
            f"{path} belongs to another run (run id {saved_id[:12]}...; trainer_state.json has {run_id[:12]}...): "
            f"a file from another seed or settings was copied in. Restore the checkpoint's own optimizer file, or "
            f"start a new run with another --out.")
    if saved_step is not None and saved_step != str(state.get("step")):
        raise CheckpointError(
            f"{path} was saved at step {saved_step}, but trainer_state.json is at step {state.get('step')}: the "
            f"checkpoint's files come from different moments. Restore them together, or start a new run with "
            f"another --out.")


def fixed_settings(config: Any, saved_config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a resume may not change (``config.MAY_CHANGE`` left out)."""
    return {k: v for k, v in saved_config.items() if k not in config.MAY_CHANGE}


__all__ = ["check_cpu_rng_state", "check_optimizer_state", "check_same_data", "corpus_sha256", "fixed_settings",
           "read_trainer_state", "run_identity", "tokenizer_sha256", "weights_sha256"]
