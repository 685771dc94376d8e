"""The module one training micro-step calls: ids and targets in, the loss out.

Wrapping the loss together with the model lets ``torch.compile`` take forward, loss and
backward as one graph, and DDP see one module. It calls the model's unchecked ``step``
when the model has one: the token ids of a prepared dataset are in range by
construction (the tokenizer made them), so the per-call range check of ``forward``
(a read-back of the ids, which stalls the GPU queue and breaks the compiled graph) is
not repeated on every batch. Under FSDP the model's own ``__call__`` runs (its hooks
gather the sharded weights), so the checked ``forward`` runs there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from lucidlm.training.distributed import DistributedContext
from lucidlm.training.loss import masked_cross_entropy


class TrainStep(nn.Module):
    def __init__(self, model: nn.Module, unchecked: bool = True) -> None:
        super().__init__()
        self.model = model
        self.unchecked = unchecked and callable(getattr(model, "step", None))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model.step(ids) if self.unchecked else self.model(ids)  # (B, T, V)
        return masked_cross_entropy(logits, targets)


def wrap_model(model: nn.Module, ctx: DistributedContext, compile: bool = False,
               compile_mode: Optional[str] = None, gradient_checkpointing: bool = False) -> nn.Module:
    """The module the training step calls: ``TrainStep`` compiled and/or DDP-wrapped. FSDP2
    shards ``model`` in place (every block, then the root: each block's weights are
    gathered just before it runs and freed after). ``gradient_checkpointing`` switches the
    model's own on (model/checkpointing.py); off, a model passed in keeps the switch it has."""
    if gradient_checkpointing:
        model.gradient_checkpointing = True
    if ctx.sharded:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    step: nn.Module = TrainStep(model, unchecked=not ctx.sharded)
    if compile:
        step = torch.compile(step, mode=None if compile_mode in (None, "default") else compile_mode)
    if ctx.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.device(ctx.device).index] if ctx.device.startswith("cuda") else None
        step = DistributedDataParallel(step, device_ids=device_ids)
    return step


@contextlib.contextmanager
def unsharded(model: nn.Module, ctx: DistributedContext) -> Iterator[None]:
    """Under FSDP, every rank holds the whole model while inside (for decoding, whose
    ``step`` calls bypass the root module's gathering hooks); a collective: every rank must
    enter together. Elsewhere it does nothing."""
    if not ctx.sharded:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
