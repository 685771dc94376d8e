"""Feed-forward blocks: a 2-matrix MLP (ReLU / GELU / GELU-tanh) or a 3-matrix gated one:
LLaMA's SwiGLU (silu gate) or Gemma's GeGLU (gelu_tanh gate)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.config import ModelConfig
from lucidlm.model.fused import FusedLinear
from lucidlm.model.hooks import HookPoint

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact erf form (nanoGPT's nn.GELU())
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's gelu_new, JAX's default
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        self.gate_activation = {"swiglu": F.silu, "geglu": ACTIVATIONS["gelu_tanh"]}.get(cfg.mlp)
        self.fused_gate_up: Optional[FusedLinear] = None  # gate and up as one matmul, where it can be (fused.py)
        if self.gate_activation is not None:
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
            self.hook_pre_linear = HookPoint()  # (B, T, d_mlp): the ungated branch
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()  # (B, T, d_mlp): before the nonlinearity
        self.hook_post = HookPoint()  # (B, T, d_mlp): after it (and after gating)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_activation is not None:
            fused = self.fused_gate_up
            if fused is not None and fused.serves(self.gate_proj, self.up_proj):
                gate, up = fused(x)  # (B, T, d_mlp) each
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            hidden = self.hook_post(self.gate_activation(self.hook_pre(gate)) * self.hook_pre_linear(up))
        else:
            hidden = self.hook_post(ACTIVATIONS[self.kind](self.hook_pre(self.up_proj(x))))
        return self.down_proj(hidden)
