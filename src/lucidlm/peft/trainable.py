"""Freezing and counting parameters: shared by every fine-tuning method (LoRA, adapters, prefix).

Each method first freezes the whole base model with ``freeze_base`` and then switches its own
new parameters back on; ``count_parameters`` / ``trainable_parameters_report`` say how many are
trained (the line PEFT's ``print_trainable_parameters`` prints).
"""

from __future__ import annotations

from torch import nn


def freeze_base(model: nn.Module) -> None:
    """Stop gradients for every parameter; each method then switches its own ones back on."""
    for param in model.parameters():
        param.requires_grad_(False)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all), each shared parameter (a tied embedding) counted once."""
    params = list(model.parameters())  # parameters() already yields a shared tensor once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def trainable_parameters_report(model: nn.Module) -> str:
    """The line PEFT's ``print_trainable_parameters`` prints."""
    trainable, total = count_parameters(model)
    return (f"trainable params: {trainable:,d} || all params: {total:,d} || "
            f"trainable%: {100 * trainable / max(total, 1):.4f}")
