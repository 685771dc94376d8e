"""Gradient (activation) checkpointing: trade compute for memory in training.

Backpropagation needs the activations each block computed in the forward pass; a block of a
LLaMA-sized model keeps ~20 tensors of (B, T, d) and wider (norms, q/k/v, the MLP's gate and
up projections, attention's output). With ``Transformer.gradient_checkpointing`` on, a
training forward keeps only each block's input, and the backward pass runs the block again
to get the rest: memory for activations goes from n_layers blocks' worth to one block's
(plus each block's input), for about one more forward pass of time (transformers'
``gradient_checkpointing_enable``).

torch's non-reentrant checkpoint does it (the one torch recommends: it takes inputs that need
no grad and non-tensor ones, such as the rotation's (cos, sin) pair, and reaches the LoRA and
prefix parameters a block uses without their being passed in). Its
``preserve_rng_state`` (on by default) replays the forward's random state in the recompute,
so dropout draws the same masks and the gradients are exactly those without checkpointing.

A block something listens to runs as it is, uncheckpointed: a forward or backward hook
function on one of its hook points, a torch hook on one of its modules, or a global torch hook
on every module (``register_module_forward_hook``). Recomputed, a forward hook would run twice
per step (a hook that records activations sees each one twice), and a hook removed before the
backward (``run_with_hooks`` removes its hooks when the forward returns) would be missing from
the recompute, whose saved tensors would then not be those the forward used: silently wrong
gradients. A backward hook function runs once, on the forward's graph, but an attached one
changes the forward too (a norm with its ``hook_scale`` active, attention with its
``hook_pattern``, take their explicit paths): removed before the backward, the recompute took
the fused ones, and the gradients were off by ~1e-3. The other blocks are still checkpointed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lucidlm.model.decode_block import global_module_hooks
from lucidlm.model.hooks import HookPoint


def checkpointed_block(block: nn.Module, *args: Any) -> torch.Tensor:
    """``block(*args)``, keeping only its inputs for the backward pass, which runs it again;
    a block that something listens to runs as it is (see above)."""
    if listened_to(block):
        return block(*args)
    return checkpoint(block, *args, use_reentrant=False)


def listened_to(block: nn.Module) -> bool:
    """Whether a hook function (forward or backward) or a torch hook is attached anywhere in
    ``block``, or a global torch forward hook to every module."""
    return global_module_hooks() or any((isinstance(m, HookPoint) and m.active) or m._forward_hooks or m._forward_pre_hooks
               or m._backward_hooks or m._backward_pre_hooks for m in block.modules())
