"""Next-token cross-entropy that ignores padded positions.

Seed 004's ``sequence_loss_fn`` masks every target equal to 0 (its padding id) and
averages over the rest; here the ignored id is a parameter, and an explicit mask can
drop more positions (a prompt in instruction tuning, say).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # PyTorch's and Hugging Face's convention


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                         mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean of -log p(target) over positions whose target is not ``ignore_index`` and,
    if given, whose ``mask`` is true.

    logits: (B, T, V); targets: (B, T) ids; mask: (B, T) bool/0-1. Computed in float32
    (a bf16 log-softmax over a big vocabulary loses digits). If no position counts, the
    loss is 0 rather than NaN, so an all-padding micro-batch does not poison a step.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab).float()  # (B*T, V)
    flat_targets = targets.reshape(-1)  # (B*T,)
    if mask is not None:
        flat_targets = torch.where(mask.reshape(-1).bool(), flat_targets, ignore_index)
    # Sum over counted positions / their number: no branch on a device value, so no host
    # sync (a `if counted.all()` would stall the GPU queue every step).
    total = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum")
    count = (flat_targets != ignore_index).sum().clamp(min=1)
    return total / count
