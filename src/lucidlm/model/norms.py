"""RMSNorm and LayerNorm.

RMSNorm is computed in float32 whatever the activations' dtype (as LLaMA and seed 001/003
do): the mean of squares of bf16 values loses too much precision. The weight multiplies in
float32 too and the result is rounded once, as Hugging Face's Gemma 3 norm does (its Llama
norm rounds x / rms(x) to bf16 first, a second rounding). On Gemma 3 270M in bf16 the second
rounding put lucidlm's logits 21 % further from float32 than transformers' bf16 ones (mean
|error| 0.065 against 0.054 over 26 tokens); rounded once, 0.053. For Llama-style norms one
rounding is closer to float32 than transformers' two (tests/families/test_half_precision.py).

Hook semantics follow TransformerLens exactly, so ported analysis code reads the same numbers:
``hook_scale`` holds the divisor itself, rms(x) (LayerNorm: the std of the centred x, eps
included), shape (..., 1); ``hook_normalized`` holds x / scale *before* the learned weight
and bias are applied. With no hook attached the fused kernels run instead (same numbers).
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
        # (B, T, 1) and (B, T, d) on the residual stream; per head, (B, T, heads, 1) and (B, T, heads,
        # width): as attention's q/k norm (width head_dim), or as ln1 with split q/k/v inputs (width d)
        self.hook_scale = HookPoint()  # (..., 1): rms(x) = sqrt(mean(x^2) + eps)
        self.hook_normalized = HookPoint()  # (..., d): x / rms(x), before the weight
        # Inference on the CPU through lucidlm's C loop (quantization/kernels/rms_norm_rows.c),
        # switched on by ``blocks_kernel.use_cpu_loops``: torch's rms_norm is a chain of small ops,
        # ~18 us a call at SmolLM2's decode shapes (2 threads) against ~3, 61 calls a token.
        self.row_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        looking = self.hook_scale.active or self.hook_normalized.active
        if x.dtype in (torch.float32, torch.float64) and not looking:
            if (self.row_kernel and x.dtype == self.weight.dtype == torch.float32 and x.is_cpu
                    and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
                return torch.ops.lucidlm.rms_norm_rows(x, self.weight, self.eps)  # the same sums in one pass
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # fused; same numbers
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        scale = self.hook_scale((x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return (self.hook_normalized(x32 / scale) * self.weight).to(x.dtype)  # one rounding


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.hook_scale = HookPoint()  # (B, T, 1) (with split inputs (B, T, heads, 1)): std(x) = sqrt(var(x) + eps)
        self.hook_normalized = HookPoint()  # (B, T, d) (or (B, T, heads, d)): (x - mean) / std, before weight and bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.hook_scale.active or self.hook_normalized.active):
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)  # fused
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        centred = x32 - x32.mean(-1, keepdim=True)
        scale = self.hook_scale((centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        # weight and bias in float32, rounded once: what F.layer_norm does in bf16/fp16, so a hook
        # leaves the output as it was (rounding x / std first changed ~30 % of bf16 outputs)
        y = self.hook_normalized(centred / scale) * self.weight
        return (y + self.bias if self.bias is not None else y).to(x.dtype)


def make_norm(kind: str, dim: int, eps: float, bias: bool = True) -> nn.Module:
    if kind == "none":  # seed 002's toy model: the residual stream is never normalised
        return nn.Identity()
    if kind == "rms":
        return RMSNorm(dim, eps)
    if kind == "layer":
        return LayerNorm(dim, eps, bias)
    # A kind listed in config_checks.NORM_KINDS but not built here would otherwise pass the
    # config check and quietly become some other norm.
    raise ValueError(f"norm kind {kind!r} has no module in model/norms.py make_norm: add its branch there.")
