"""RMSNorm and LayerNorm.

RMSNorm is computed in float32 whatever the activations' dtype (as LLaMA and seed 001/003
do): the mean of squares of bf16 values loses too much precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.model.hooks import HookPoint


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.hook_scale = HookPoint()  # (B, T, 1): 1 / rms(x)
        self.hook_normalized = HookPoint()  # (B, T, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64) and not (self.hook_scale.active or self.hook_normalized.active):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # fused; same numbers
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        inv_rms = self.hook_scale(torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))
        return self.hook_normalized(self.weight * (x32 * inv_rms).to(x.dtype))


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.hook_scale = HookPoint()  # (B, T, 1): 1 / std(x)
        self.hook_normalized = HookPoint()  # (B, T, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hook_scale.active:  # spell it out only when someone is looking
            x32 = x.to(torch.promote_types(x.dtype, torch.float32))
            centred = x32 - x32.mean(-1, keepdim=True)
            inv_std = self.hook_scale(torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps))
            y = (centred * inv_std).to(x.dtype) * self.weight
            y = y + self.bias if self.bias is not None else y
        else:
            y = F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return self.hook_normalized(y)


def make_norm(kind: str, dim: int, eps: float, bias: bool = True) -> nn.Module:
    if kind == "none":  # seed 002's toy model: the residual stream is never normalised
        return nn.Identity()
    return RMSNorm(dim, eps) if kind == "rms" else LayerNorm(dim, eps, bias)
