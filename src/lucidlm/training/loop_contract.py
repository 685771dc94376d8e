"""What the training loop promises the code around it: the ``TrainResult`` it returns and the
``BatchSource`` it reads batches from (the ``Callback`` hooks, which take the ``Trainer``
itself, are defined beside it in ``loop.py``).

They live apart from ``loop.py`` so that recipes (``pretrain.py``, ``finetune.py``) can name
the contract without reading the loop itself; ``loop.py`` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

import torch

@dataclass
class TrainResult:
    """What ``Trainer.fit`` (and so ``pretrain`` / ``finetune``) returns: the step reached, every
    step's training loss, the last evaluation's losses, the best validation loss, the path of
    the last checkpoint (None without one), whether Ctrl-C stopped it, the seconds it took and
    every evaluation record (``metrics``, as in metrics.jsonl)."""

    step: int
    train_losses: list[float]  # one per optimizer step, since step 0 of the run (resumes included)
    train_loss: Optional[float]  # of the last evaluation
    val_loss: Optional[float]
    best_val_loss: float
    checkpoint: Optional[Path]
    interrupted: bool = False
    elapsed: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)


class BatchSource(Protocol):
    """What ``Trainer`` reads its batches from (``batches.WindowBatches``, ``batches.ExampleBatches``,
    or any object with these members): ``next()`` is (x, y, *extra) with x and y (B, T) on the
    device, ``prefetch()`` draws the next one early, ``eval_batches`` gives the same (x, y)
    batches at every evaluation, and the state round-trips through a checkpoint."""

    tokens_per_batch: int

    def next(self) -> tuple[Any, ...]: ...
    def prefetch(self) -> None: ...
    def eval_batches(self, split: str, iters: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


__all__ = ["BatchSource", "TrainResult"]
