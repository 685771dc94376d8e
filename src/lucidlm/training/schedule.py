"""The learning-rate schedule: linear warmup, then cosine decay to ``min_lr`` (nanoGPT's ``get_lr``)."""

from __future__ import annotations

import math


def get_lr(step: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Warmup ramps from lr/(warmup+1) so the very first step already moves; after
    ``lr_decay_iters`` the rate stays at ``min_lr``.
    """
    if step < warmup_iters:
        return learning_rate * (step + 1) / (warmup_iters + 1)
    if step > lr_decay_iters:
        return min_lr
    decay_ratio = (step - warmup_iters) / max(1, lr_decay_iters - warmup_iters)  # 0 -> 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return min_lr + coeff * (learning_rate - min_lr)
