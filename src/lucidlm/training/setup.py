"""What both recipes do before the loop starts (litgpt's shared utilities, in one place):
pick the device and dtype, check the output directory, find and check a checkpoint to
resume, and build AdamW."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from lucidlm import devices
from lucidlm.errors import CheckpointError
from lucidlm.outputs import check_name_lengths, foreign_entries
from lucidlm.training import checkpoint as ckpt
from lucidlm.training.distributed import DistributedContext, barrier


# What a lucidlm run writes in OUT: a directory holding any of these is a run, not a stranger's folder.
RUN_ENTRIES = (ckpt.CHECKPOINT_DIR, "data", "metrics.jsonl", "loss.png", "token_lengths.json")
RUN_DIRS = (ckpt.CHECKPOINT_DIR, "data")  # the others are files


def resolve_device(device: str) -> str:
    """auto = CUDA if available, else CPU; any other name is checked by lucidlm's one device
    helper (``--device foo``, ``gpu``, ``cuda`` on a CPU-only torch, ``cuda:7``) before training."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(devices.resolve_device(device))


def autocast_dtype(dtype: str, device: torch.device) -> Optional[torch.dtype]:
    """bf16 autocast by default only on CUDA. On CPU it is opt-in (``dtype="bfloat16"``): with
    AVX512-BF16 or AMX it trains ~2-3x faster (benchmarks/bench_train_shakespeare.py), but
    float32 stays the default there because it is exact, and because CPUs without AVX-512 train
    ~15x slower in bfloat16 (see ``precision_warning``)."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return None


def precision_warning(autocast: Optional[torch.dtype], device: torch.device) -> Optional[str]:
    """One line when ``--dtype bfloat16`` will make a CPU run far slower instead of faster, or None.
    Measured on an AMD EPYC (AVX2 only): nanoGPT's Shakespeare run trains at ~840 tok/s under
    bf16 autocast against ~12,400 in float32, every matmul taking torch's generic bf16 loop."""
    if autocast is not torch.bfloat16 or device.type != "cpu" or devices.cpu_multiplies_bfloat16():
        return None
    return ("warning: --dtype bfloat16 on this CPU: it has no AVX-512, which torch's fast bfloat16 matmul "
            "(oneDNN) needs, so bfloat16 matrices go through a generic loop, 5-30x slower than float32 (not "
            "faster). Leave --dtype at "
            "auto (float32 on CPU) unless you are checking mixed precision.")


def check_writable(out_dir: Path) -> None:
    """Fail before any training if checkpoints could not be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        raise CheckpointError(
            f"cannot write to the output directory {out_dir} ({exc.strerror or exc}); choose a writable --out."
        ) from None


def resolved(path: Optional[str]) -> Optional[str]:
    return str(Path(path).expanduser().resolve()) if path else path


def open_run(out_dir: Path, resume: bool, ctx: DistributedContext,
             payload: str = "model.safetensors") -> Optional[tuple[Path, dict[str, Any]]]:
    """Check OUT before training. Returns (checkpoint dir, its trainer state) to resume, or
    None for a new run. A new run never overwrites a checkpoint; --resume needs one."""
    if ctx.is_main:
        check_name_lengths(out_dir, "--out")  # before anything asks the file system about it
        _refuse_entries_in_the_way(out_dir)
        foreign = foreign_entries(out_dir, RUN_ENTRIES)
        if foreign and not resume:  # never train into (and later overwrite files in) someone else's folder
            raise CheckpointError(
                f"--out {out_dir} already holds files that are not from a lucidlm run ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty directory for --out.")
        if resume and ckpt.find_checkpoint(out_dir, restore=False) is None:
            _no_checkpoint(out_dir)  # before anything is created or moved: a refusal changes nothing on disk
        check_writable(out_dir)
        found = ckpt.find_checkpoint(out_dir)  # puts back the one a kill mid-swap moved aside
        ckpt.remove_stale_temporaries(out_dir)  # after: of several moved aside, the best is back in place
        if found is not None and not resume:
            raise CheckpointError(
                f"{out_dir} already holds a training checkpoint ({found}); pass --resume to continue it, or "
                f"choose another --out.")
    barrier(ctx)
    if not resume:
        return None
    found = out_dir / ckpt.CHECKPOINT_DIR
    if not found.is_dir():
        _no_checkpoint(out_dir)
    return found, ckpt.read_trainer_state(found, payload)


def _refuse_entries_in_the_way(out_dir: Path) -> None:
    """A file where a run keeps a directory (TensorFlow's index file is named "checkpoint"), or a
    directory where it writes a file: the names make OUT look like a run, and the run would delete
    the file at its first checkpoint, or fail on it after training (a folder named loss.png)."""
    for name in RUN_ENTRIES:
        path = out_dir / name
        if path.exists() and path.is_dir() != (name in RUN_DIRS):
            kind = "a file" if name in RUN_DIRS else "a directory"
            raise CheckpointError(f"--out {out_dir} holds {path}, {kind}, where a lucidlm run keeps its own: the run "
                                  f"would replace it or fail on it. Move it, or choose a new or empty directory for "
                                  f"--out.")


def _no_checkpoint(out_dir: Path) -> None:
    raise CheckpointError(
        f"--resume: there is no checkpoint in {out_dir / ckpt.CHECKPOINT_DIR}; train without --resume first (or "
        f"point --out at the run to continue).")


def with_checkpoint(result: Any, out_dir: Path, ctx: DistributedContext) -> Any:
    """``result`` (a TrainResult) naming OUT/checkpoint when the loop saved none because no step
    was left to run (``--resume`` of a finished run): the model is the checkpoint already there."""
    final = Path(out_dir) / ckpt.CHECKPOINT_DIR
    if result.checkpoint is None and ctx.is_main and final.is_dir():
        return dataclasses.replace(result, checkpoint=final)
    return result


def check_same_settings(config: Any, current: dict[str, Any], state: dict[str, Any], directory: Path,
                        ctx: DistributedContext) -> None:
    """A resumed run must be the run that was saved: same recipe settings, same global batch.
    The process count may change if ``batch_size`` x processes stays the same: every rank draws
    the same global batch (batches.py), so 1 process continues what 8 started, or the reverse."""
    saved, saved_world = state.get("train_config", {}), state.get("world_size", 1)
    saved_batch, batch = saved.get("batch_size"), current.get("batch_size")
    regrouped = (saved_world != ctx.world_size and isinstance(saved_batch, int) and isinstance(batch, int)
                 and saved_batch * saved_world == batch * ctx.world_size)
    differences = config.differences(saved, {**current, "batch_size": saved_batch} if regrouped else current)
    if saved_world != ctx.world_size and not regrouped:
        total = saved_batch * saved_world if isinstance(saved_batch, int) else None
        fits = total is not None and total % ctx.world_size == 0
        differences.append(
            f"global batch (batch_size x processes): {saved_batch} x {saved_world} -> {batch} x {ctx.world_size}"
            + (f"; with {ctx.world_size} process(es) pass --batch-size {total // ctx.world_size}" if fits else ""))
    if differences:
        raise CheckpointError(
            f"cannot resume from {directory}: it was trained with different settings ({'; '.join(differences)}; "
            f"saved in {directory / ckpt.STATE_NAME}). "
            f"Resume with the original settings, or start a new run with another --out. The checkpoint is "
            f"left as it was.")
    if regrouped and ctx.is_main:
        print(f"resuming a run of {saved_world} process(es) with {ctx.world_size}: the same global batch of "
              f"{batch * ctx.world_size} sequences, so the data continues exactly; dropout draws differ from "
              f"an uninterrupted run.", flush=True)


def configure_optimizer(model: torch.nn.Module, config: Any, device: torch.device,
                        sharded: bool = False) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay only on matrices (embeddings,
    projections), never on biases or norm scales, as in nanoGPT's ``configure_optimizers``.
    The fused kernel (one pass over all parameters) exists on CPU and CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]  # .parameters() lists tied weights once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = config.fused_adamw and device.type in ("cpu", "cuda") and not (sharded and device.type == "cpu")
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.learning_rate,
                             betas=(config.beta1, config.beta2), fused=fused or None)
