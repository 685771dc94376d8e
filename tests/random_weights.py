"""Random weights for parity tests, one helper for every test that builds a tiny HF model."""

from __future__ import annotations

import torch


def randomize_(model: torch.nn.Module, seed: int, norm_spread: float = 0.1) -> torch.nn.Module:
    """Weights large enough that logits are O(1): with the default 0.02 init every model's
    logits are near zero and a wrong mapping could still pass an absolute tolerance. Norm
    scales spread around 1 so that a layout slip in them cannot hide either."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # norm scales
                p.copy_(1.0 + norm_spread * torch.randn(p.shape, generator=g))
    return model.eval()
