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
  weights: no second copy). Float ``nn.Linear`` layers are fused only when asked
  (``float_layers=True``, which ``compile()`` asks for on CUDA: there a 2048x512 matmul
  costs a launch-bound ~5 us like one three times its size; measured on an H200,
  2026-11-26). Their weights then move into one matrix too: each part keeps its
  ``Parameter``, whose data becomes its rows of the fused matrix, so an in-place edit of a
  part is an edit of the kernel. The fused path is skipped while autograd records (the
  parts' parameters must get their gradients);
- the fused path runs only while it still ``serves`` the parts: the same modules, the same
  weights (each part's ``installs`` count, bumped whenever its weights are replaced; for a
  float part, its weight still being its rows of the fused matrix), and no torch hook on a
  part. A LoRA wrapper, a reloaded state dict or a device move makes the model fall back to
  the parts, exactly;
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
        self.installs = tuple(getattr(p, "installs", None) for p in parts)
        self.float_rows = isinstance(kernel, nn.Linear)  # the parts' weights are views of the kernel's
        self.sharing = self.float_rows and self.parts_share_the_kernel()

    def parts_share_the_kernel(self) -> bool:
        """Float kernels: whether every part's weight (and bias) is still its rows of the
        kernel's, i.e. nothing replaced or moved them since fusing. Reads data pointers, so it
        runs outside a trace: ``refresh`` stores the answer for the traced ``serves``."""
        if self.kernel is None:
            return False
        row, offset = self.kernel.weight.stride(0) * self.kernel.weight.element_size(), 0
        for part, width in zip(self.parts, self.widths):
            for mine, whole in ((part.weight, self.kernel.weight), (part.bias, self.kernel.bias)):
                if (mine is None) != (whole is None):
                    return False
                if mine is not None:
                    size = row if whole.dim() == 2 else whole.element_size()
                    if mine.dtype != whole.dtype or mine.data_ptr() != whole.data_ptr() + offset * size:
                        return False
            offset += width
        return True

    def refresh(self) -> None:
        """Re-check float parts (before a compiled step is used: ``generation/compiled.py``)."""
        if self.float_rows:
            self.sharing = self.parts_share_the_kernel()

    def serves(self, *parts: nn.Module) -> bool:
        """Whether one matmul still equals running ``parts``: plain Python, decided when a
        step is traced (``generation/compiled.py`` re-traces when ``installs`` or ``sharing`` change)."""
        if self.kernel is None or len(parts) != len(self.parts):
            return False
        if self.float_rows:
            if torch.is_grad_enabled() and any(p.weight.requires_grad for p in parts):
                return False  # the parts' parameters are the leaves autograd must reach
            if not torch.compiler.is_compiling():
                self.refresh()  # eager: check the pointers now
            if not self.sharing:
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
        if self.float_rows:
            # Any conversion gives the parts new tensors of their own: the kernel's matrix
            # would only hold on to memory. Fuse again after the move.
            self.__dict__["kernel"], self.sharing = None, False
        elif self.kernel is not None:
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


# Which layers fuse: (the attribute holding the fused layer, the parts it computes, in order).
FUSED = (("fused_qkv", ("q_proj", "k_proj", "v_proj")), ("fused_gate_up", ("gate_proj", "up_proj")))


def fused_kernel(parts: tuple[nn.Module, ...]) -> Optional[nn.Module]:
    """One module computing every part's output side by side, or None where the parts'
    class cannot concatenate itself (float layers, mixed schemes, shapes its kernel cannot tile)."""
    concatenated = getattr(type(parts[0]), "concatenated", None)
    if concatenated is None or any(type(p) is not type(parts[0]) for p in parts):
        return None
    return concatenated(parts)


def fused_float_kernel(parts: tuple[nn.Module, ...]) -> Optional[nn.Linear]:
    """One ``nn.Linear`` over the rows of float ``parts`` (same input width, dtype, device and
    bias or not), whose matrix then holds the parts' weights: each part's ``Parameter`` stays
    the same object and its data becomes a view of its rows, so nothing is stored twice."""
    first = parts[0]
    if any(type(p) is not nn.Linear for p in parts) or len({(p.in_features, p.weight.dtype, p.weight.device,
                                                              p.bias is None) for p in parts}) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([p.weight for p in parts])  # (sum of out_features, in_features)
        bias = torch.cat([p.bias for p in parts]) if first.bias is not None else None
    kernel = nn.Linear(first.in_features, weight.shape[0], bias=bias is not None, device="meta")
    kernel.weight = nn.Parameter(weight, requires_grad=False)
    kernel.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
    widths = [p.out_features for p in parts]
    for part, rows in zip(parts, weight.split(widths)):
        part.weight.data = rows
    if bias is not None:
        for part, rows in zip(parts, bias.split(widths)):
            part.bias.data = rows
    return kernel


def fuse_projections(model: nn.Module, float_layers: bool = False) -> int:
    """Give every attention layer a fused q/k/v kernel (``fused_qkv``) and every gated MLP a
    fused gate/up kernel (``fused_gate_up``) where its layers can be fused, replacing stale
    ones. ``float_layers``: fuse float ``nn.Linear`` parts too (see the module docstring).
    Returns how many were built. Idempotent: fused kernels that still serve are kept."""
    built = 0
    for module in model.modules():
        for attr, names in FUSED:
            if not hasattr(module, attr) or not all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                continue
            parts = tuple(getattr(module, n) for n in names)
            current = getattr(module, attr)
            with torch.no_grad():  # (a float kernel does not serve while autograd records)
                if current is not None and current.serves(*parts):
                    continue
            kernel = fused_kernel(parts)
            if kernel is None and float_layers:
                kernel = fused_float_kernel(parts)
            setattr(module, attr, FusedLinear(kernel, parts) if kernel is not None else None)
            built += kernel is not None
    return built
