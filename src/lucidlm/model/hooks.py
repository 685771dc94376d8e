"""Hook points: named places where an activation can be read or replaced.

Every intermediate tensor of the model passes through a ``HookPoint``; its module path is
the hook's name (``blocks.0.attn.hook_pattern``), as in TransformerLens. A hook function
is ``fn(activation, hook) -> new_activation | None``. With no function attached a hook
point is one attribute check: ``__call__`` is overridden so it skips nn.Module's call
machinery, which is what makes hook points free when unused.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

HookFn = Callable[[torch.Tensor, "HookPoint"], Optional[torch.Tensor]]


class HookPoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fns: list[HookFn] = []
        self.name: str = ""  # filled in by Transformer once the module tree is built

    def add_hook(self, fn: HookFn) -> None:
        self.fns.append(fn)

    def remove_hooks(self) -> None:
        self.fns.clear()

    @property
    def active(self) -> bool:
        return bool(self.fns)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not self.fns:
            return x
        for fn in self.fns:
            out = fn(x, self)
            if out is not None:
                x = out
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def extra_repr(self) -> str:
        return self.name
