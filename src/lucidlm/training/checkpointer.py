"""The loop's checkpointer: writes and restores ``OUT/checkpoint/`` (see ``checkpoint.py``
for the files and the atomic swap).

What a checkpoint holds besides optimizer and loop state is the *payload*:
``"model"`` (pre-training, full fine-tuning): the whole model, a directory
``lucidlm.load`` reads; ``"trainable"`` (LoRA, adapters, prefix): only the parameters that
train, ``trainable.safetensors``, plus the adapter in its user-facing format (written by
the ``export`` function the recipe passes).

Under FSDP every rank holds a shard: weights and AdamW moments are gathered into full
tensors on the CPU (``torch.distributed.checkpoint.state_dict``, a collective) and rank 0
writes the same files a single process writes, so a checkpoint trained on N GPUs loads in
one process, and a single-process checkpoint resumes under FSDP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lucidlm.errors import CheckpointError
from lucidlm.training import checkpoint as ckpt
from lucidlm.training.distributed import DistributedContext, barrier
from lucidlm.training.resume_checks import DAMAGED, check_optimizer_state
from lucidlm.weights.checkpoint import CONFIG_NAME, TOKENIZER_NAME, TRAINABLE_NAME, WEIGHTS_NAME
from lucidlm.weights.finite import check_finite
from lucidlm.weights.hf_generation_config import write_generation_config


def full_model_state(model: torch.nn.Module, ctx: DistributedContext) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full CPU tensor (on rank 0 under FSDP; {} elsewhere)."""
    if ctx.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         ctx: DistributedContext) -> dict[str, Any]:
    """The optimizer's state_dict with full tensors, indexed by parameter position as a
    single process numbers them (FSDP's full state is keyed by parameter name)."""
    if not ctx.sharded or not optimizer.state:
        # Before the first step there are no moments. (Asking FSDP's helper then would make
        # it initialise them with a zero-lr step, counting one step too many for Adam's
        # bias correction: the run would no longer equal a single process.)
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return {}
    names = [name for group in full["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]
    return {"state": {index[n]: s for n, s in full["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path,
                         ctx: DistributedContext, trainer_state: Optional[dict[str, Any]] = None) -> None:
    if not ctx.sharded:
        ckpt.load_optimizer(optimizer, path, trainer_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # Every rank reads the full file, then FSDP keeps each rank's shard of it.
    loaded, metadata = ckpt.read_optimizer(path)
    check_optimizer_state(loaded, metadata, optimizer, path, trainer_state)
    ckpt.keep_runtime_options(loaded, optimizer)  # this run's kernel (no fused one for FSDP on CPU)
    if not loaded["state"]:  # saved before the first step: nothing to load (see full_optimizer_state)
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    name_of = {i: _param_name(model, p) for i, p in enumerate(params)}
    named = {"state": {name_of[i]: s for i, s in loaded["state"].items()},
             "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in loaded["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def _param_name(model: torch.nn.Module, param: torch.Tensor) -> str:
    for name, p in model.named_parameters():
        if p is param:
            return name
    raise CheckpointError("an optimizer parameter is not a parameter of the model.")


class Checkpointer:
    def __init__(self, out_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 config: dict[str, Any], ctx: DistributedContext, payload: str = "model",
                 export: Optional[Callable[[Path, dict[str, torch.Tensor]], None]] = None, identity: Optional[dict[str, str]] = None) -> None:
        self.out_dir, self.model, self.optimizer, self.config = Path(out_dir), model, optimizer, config
        self.ctx, self.payload, self.export = ctx, payload, export
        self.identity = identity  # the run's corpus, tokenizer and settings hashes (resume_checks.run_identity)

    def save(self, trainer: Any) -> Optional[Path]:
        """Gather (collective), then rank 0 writes OUT/checkpoint atomically."""
        state = {**trainer.state_dict(), "train_config": self.config}
        if self.identity is not None:
            state["run"] = self.identity
        tensors = full_model_state(self.model, self.ctx)
        optimizer_state = full_optimizer_state(self.model, self.optimizer, self.ctx)
        path = None
        if self.ctx.is_main:
            path = ckpt.save_checkpoint(self.out_dir, lambda tmp: self._write_payload(tmp, tensors),
                                        optimizer_state, state)
        barrier(self.ctx)
        return path

    def _write_payload(self, directory: Path, tensors: dict[str, torch.Tensor]) -> None:
        model = self.model
        if self.payload == "trainable":
            names = {n for n, p in model.named_parameters() if p.requires_grad}
            save_file({k: v.contiguous() for k, v in tensors.items() if k in names}, str(directory / TRAINABLE_NAME))
            if self.export is not None:
                self.export(directory, tensors)
            return
        if getattr(model.config, "tie_embeddings", False):
            tensors = {k: v for k, v in tensors.items() if k != "unembed.weight"}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS_NAME))
        (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        if model.tokenizer is not None and hasattr(model.tokenizer, "save"):
            model.tokenizer.save(directory / TOKENIZER_NAME)
        # the sampling defaults and end tokens of the model trained (a fine-tuned base's
        # generation_config.json), as save_model keeps them: lucidlm.load(RUN) and a convert
        # of the run sample and stop as the base did. Only when the base had sampling defaults:
        # a file holding ids alone reads as greedy (transformers' do_sample=False), where the
        # base, with no such file, samples at lucidlm's fallback
        if getattr(model, "generation_defaults", None):
            write_generation_config(directory, model)

    def restore(self, trainer: Any, directory: Path, state: dict[str, Any]) -> None:
        """Weights (or the trainable ones), optimizer moments and loop state from ``directory``."""
        source = directory / (TRAINABLE_NAME if self.payload == "trainable" else WEIGHTS_NAME)
        try:
            tensors = load_file(str(source))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{source} cannot be read ({exc}); {DAMAGED}.") from None
        check_finite(tensors, source)  # a NaN weight would only train on as NaN
        self._load_weights(tensors, source)
        load_optimizer_state(self.model, self.optimizer, directory / ckpt.OPTIMIZER_NAME, self.ctx, state)
        trainer.load_state_dict(state)

    def _load_weights(self, tensors: dict[str, torch.Tensor], source: Path) -> None:
        model = self.model
        expected = dict(model.state_dict())
        if self.payload == "trainable":
            expected = {n: p for n, p in model.named_parameters() if p.requires_grad}
        elif getattr(model.config, "tie_embeddings", False):
            expected.pop("unembed.weight", None)
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise CheckpointError(f"{source} lacks {len(missing)} tensor(s), e.g. {missing[:3]}; it was written "
                                  f"for another model or method. Resume with the original settings.")
        if self.ctx.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, {k: tensors[k] for k in expected},
                                 options=StateDictOptions(full_state_dict=True, strict=False))
            return
        with torch.no_grad():
            for name, param in expected.items():
                if tuple(param.shape) != tuple(tensors[name].shape):
                    raise CheckpointError(f"{source}: {name} has shape {tuple(tensors[name].shape)}, expected "
                                          f"{tuple(param.shape)}; resume with the original settings.")
                param.copy_(tensors[name].to(param.dtype))
