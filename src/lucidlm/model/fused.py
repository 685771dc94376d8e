"""Several linear layers that read the same input, run as one matmul.

Attention's q/k/v projections all read the normed residual, and so do a gated MLP's gate and
up projections. gpt-fast stores them as one ``wqkv`` matrix; lucidlm keeps the separate
modules (their names are the checkpoint keys, the LoRA targets and the hook sites) and adds
a ``FusedLinear`` beside them: the same weights, concatenated into one kernel, whose output is
split back into the parts. On SmolLM2 in int4 that is 4 matmuls per layer instead of 7 and
300 fewer tensors handed to a compiled step, 6-9 % of a batch-1 decode step (2 CPU threads,
2026-11-23).

The parts stay the truth:
- ``fuse_projections`` builds a fused kernel only where the parts' class can concatenate
  itself (``concatenated``, e.g. ``Int4Linear``, whose parts then read views of the fused
  weights: no second copy); float ``nn.Linear`` layers are left alone;
- the fused path runs only while it still ``serves`` the parts: the same modules, the same
  weights (each part's ``installs`` count, bumped whenever its weights are replaced), and no
  torch hook on a part. A LoRA wrapper, a reloaded state dict or a device move makes the
  model fall back to the parts, exactly;
- a ``FusedLinear`` saves and loads nothing: checkpoints hold the parts only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


class FusedLinear(nn.Module):
    """``forward(x)`` -> the parts' outputs, (..., out_i) each, from one matmul."""

    def __init__(self, kernel: nn.Module, parts: tuple[nn.Module, ...]) -> None:
        super().__init__()
        # Neither is a registered submodule: the kernel's weights are the parts' (views), and
        # the parts belong to their parent. Registering them would list them twice in
        # ``named_modules`` and the state dict.
        self.__dict__["kernel"] = kernel
        self.__dict__["parts"] = parts
        self.widths = [int(p.out_features) for p in parts]
        self.installs = tuple(p.installs for p in parts)

    def serves(self, *parts: nn.Module) -> bool:
        """Whether one matmul still equals running ``parts``: plain Python, decided when a
        step is traced (``generation/compiled.py`` re-traces when ``installs`` change)."""
        if self.kernel is None or len(parts) != len(self.parts):
            return False
        return all(mine is part and getattr(part, "installs", None) == stamp
                   and not part._forward_hooks and not part._forward_pre_hooks
                   for mine, part, stamp in zip(self.parts, parts, self.installs))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(self.kernel(x), self.widths, dim=-1)  # views: no copy

    def _apply(self, fn: Any, recurse: bool = True) -> "FusedLinear":
        # A device move re-installs each part's weights on the new device (their own copy),
        # so the fused weights would be stale there: drop them; ``fuse_projections`` again to
        # fuse on the new device. A dtype change leaves quantized weights as they are.
        if self.kernel is not None:
            device = next(self.kernel.buffers()).device
            if fn(torch.zeros((), device=device)).device != device:
                self.__dict__["kernel"] = None
        return self

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        pass  # derived from the parts, which are saved

    def _load_from_state_dict(self, *args: Any) -> None:
        pass

    def extra_repr(self) -> str:
        state = "stale" if self.kernel is None else type(self.kernel).__name__
        return f"outputs={self.widths}, {state}"


def fused_kernel(parts: tuple[nn.Module, ...]) -> Optional[nn.Module]:
    """One module computing every part's output side by side, or None where the parts'
    class cannot concatenate itself (float layers, mixed schemes, shapes its kernel cannot tile)."""
    concatenated = getattr(type(parts[0]), "concatenated", None)
    if concatenated is None or any(type(p) is not type(parts[0]) for p in parts):
        return None
    return concatenated(parts)


def fuse_projections(model: nn.Module) -> int:
    """Give every attention layer a fused q/k/v kernel (``fused_qkv``) and every gated MLP a
    fused gate/up kernel (``fused_gate_up``) where its layers can be fused, replacing stale
    ones. Returns how many were built. Idempotent: fused kernels that still serve are kept."""
    built = 0
    for module in model.modules():
        for attr, names in (("fused_qkv", ("q_proj", "k_proj", "v_proj")), ("fused_gate_up", ("gate_proj", "up_proj"))):
            if not hasattr(module, attr) or not all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                continue
            parts = tuple(getattr(module, n) for n in names)
            current = getattr(module, attr)
            if current is not None and current.serves(*parts):
                continue
            kernel = fused_kernel(parts)
            setattr(module, attr, FusedLinear(kernel, parts) if kernel is not None else None)
            built += kernel is not None
    return built
