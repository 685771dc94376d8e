"""A diverged run is stopped before it checkpoints: its last good checkpoint is kept.

A too-high learning rate or an fp16 overflow turns the loss and then every weight into NaN
or inf. Saving then would replace the last finite checkpoint with a model nothing can load
(the loaders refuse NaN weights, weights/finite.py), so the loop asks ``divergence`` before
each save and raises ``TrainingDiverged`` instead (nanoGPT keeps its last checkpoint the same
way: it saves only when the val loss improves, which a NaN never does).

A NaN *evaluation* loss is divergence only when its batches counted a token: over no token
``estimate_loss`` gives NaN too (a mean over nothing), which is not the model's fault.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from lucidlm.errors import LucidLMError


class TrainingDiverged(LucidLMError, FloatingPointError):
    """The loss or the weights of a training run became NaN or infinite."""


def first_nonfinite(losses: Sequence[float], first_step: int) -> Optional[tuple[int, float]]:
    """(step, loss) of the first NaN/inf among ``losses``, the losses of the optimizer steps
    ``first_step``, ``first_step + 1``, ... (numbered from 0, as nanoGPT's "iter N"); None when
    all are finite."""
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return first_step + i, loss
    return None


def parameters_finite(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether every floating parameter is finite: one reduction each, one read-back."""
    flags = []
    for p in parameters:
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor shard (FSDP2)
        if local.is_floating_point() and local.numel():
            # min and max in one reduction: NaN propagates into both, an infinity is one of them.
            flags.append(torch.isfinite(torch.stack(torch.aminmax(local.detach()))).all())
    return bool(torch.stack(flags).all()) if flags else True


def diverged_message(step: int, what: str, saved_step: Optional[int], saved_path: Optional[Path]) -> str:
    """The refusal: where it diverged, what is kept, what to change."""
    if saved_step is None:
        kept = "no checkpoint was written"
    else:
        where = f" in {saved_path}" if saved_path is not None else ""
        kept = f"nothing was saved: the checkpoint of step {saved_step}{where} is kept"
    return (f"training diverged at step {step}: {what}; {kept}. Train again with a lower learning rate "
            f"(--learning-rate), and with gradient clipping on (--grad-clip, e.g. 1.0) if it was off.")


__all__ = ["TrainingDiverged", "diverged_message", "first_nonfinite", "parameters_finite"]
