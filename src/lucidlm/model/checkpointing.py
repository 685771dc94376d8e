"""Gradient (activation) checkpointing: trade compute for memory in training.

Backpropagation needs the activations each block computed in the forward pass; a block of a
LLaMA-sized model keeps ~20 tensors of (B, T, d) and wider (norms, q/k/v, the MLP's gate and
up projections, attention's output). With ``Transformer.gradient_checkpointing`` on, a
training forward keeps only each block's input, and the backward pass runs the block again
to get the rest: memory for activations goes from n_layers blocks' worth to one block's
(plus each block's input), for about one more forward pass of time (transformers'
``gradient_checkpointing_enable``).

torch's non-reentrant checkpoint does it (the one torch recommends; it also takes inputs that
need no grad, keyword-free tuples such as the rotation, and LoRA/prefix parameters). Its
``preserve_rng_state`` (on by default) replays the forward's random state in the recompute,
so dropout draws the same masks and the gradients are exactly those without checkpointing.

Hook functions on a block's hook points (and torch hooks on its modules) run in the
recompute too: twice per training step. Backward hooks run once (the recompute's graph is
only read for its saved tensors). ``warn_if_hooks_run_twice`` says so when it happens.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lucidlm.model.hooks import HookPoint


def checkpointed_block(block: nn.Module, *args: Any) -> torch.Tensor:
    """``block(*args)``, keeping only its inputs for the backward pass, which runs it again."""
    return checkpoint(block, *args, use_reentrant=False)


def warn_if_hooks_run_twice(blocks: nn.Module) -> None:
    """Warn when a forward hook inside ``blocks`` will also run in the backward's recompute:
    a hook that records or counts activations would see each one twice per step."""
    if torch.compiler.is_compiling():  # a compiled step traces its hooks once; nothing to read here
        return
    listening = [m.name if isinstance(m, HookPoint) else type(m).__name__ for m in blocks.modules()
                 if (m.fns if isinstance(m, HookPoint) else False) or m._forward_hooks or m._forward_pre_hooks]
    if listening:
        shown = ", ".join(listening[:3]) + (f" and {len(listening) - 3} more" if len(listening) > 3 else "")
        warnings.warn(f"gradient checkpointing is on, so forward hooks inside the blocks ({shown}) run twice per "
                      f"training step: in the forward pass and again when the backward pass recomputes the block. "
                      f"A hook that records activations sees each one twice; set model.gradient_checkpointing = "
                      f"False while hooks are attached, or run hooks under torch.no_grad() (run_with_cache does).",
                      stacklevel=3)
