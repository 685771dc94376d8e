"""The learning-rate schedule: linear warmup, then cosine decay to ``min_lr`` (nanoGPT's ``get_lr``)."""

from __future__ import annotations

import math
from typing import Any, Optional


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


def schedule_warning(config: Any) -> Optional[str]:
    """One line when ``max_iters`` stops the schedule early (inside the warm-up, or before the
    cosine decay reaches ``min_lr``) or the warm-up outlasts the decay, or None. The schedule
    is left as set rather than rescaled to ``max_iters``: ``--resume --max-iters N`` may
    lengthen a run, and a schedule tied to ``max_iters`` would then change the rates of steps
    already planned; the line names the flags that fit the schedule to the run instead."""
    if not config.decay_lr or config.max_iters <= 0:
        return None
    if config.warmup_iters > config.lr_decay_iters and config.max_iters > config.warmup_iters:
        # get_lr (as nanoGPT's): past lr_decay_iters the rate is min_lr, so the warm-up's end drops to it at once
        return (f"warning: --warmup-iters {config.warmup_iters} is longer than --lr-decay-iters "
                f"{config.lr_decay_iters}: the learning rate warms up towards {config.learning_rate:g}, then drops "
                f"straight to --min-lr {config.min_lr:g} at step {config.warmup_iters}, with no cosine decay. "
                f"Pass --warmup-iters <= --lr-decay-iters.")
    last = config.max_iters - 1  # the last step's 0-based index
    lr = get_lr(last, config.learning_rate, config.warmup_iters, config.lr_decay_iters, config.min_lr)
    if config.max_iters <= config.warmup_iters:  # step warmup_iters - 1 is still below the peak
        where = f"inside the {config.warmup_iters}-step warm-up"
    elif config.max_iters < config.lr_decay_iters:
        where = f"before the cosine decay reaches --min-lr {config.min_lr:g} at step {config.lr_decay_iters}"
    else:
        return None
    return (f"warning: --max-iters {config.max_iters} ends {where}; the last step's learning rate is {lr:.3g} "
            f"(peak --learning-rate {config.learning_rate:g}). Pass --warmup-iters and --lr-decay-iters "
            f"<= {config.max_iters} to fit the schedule to the run.")
