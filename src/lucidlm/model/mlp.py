"""Feed-forward blocks: a 2-matrix MLP (ReLU / GELU / GELU-tanh) or a 3-matrix gated one:
LLaMA's SwiGLU (silu gate) or Gemma's GeGLU (gelu_tanh gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.config import ModelConfig
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
        if self.gate_activation is not None:
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
            self.hook_pre_linear = HookPoint()  # (B, T, d_mlp): the ungated branch
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()  # (B, T, d_mlp): before the nonlinearity
        self.hook_post = HookPoint()  # (B, T, d_mlp): after it (and after gating)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_activation is not None:
            gate = self.hook_pre(self.gate_proj(x))
            hidden = self.hook_post(self.gate_activation(gate) * self.hook_pre_linear(self.up_proj(x)))
        else:
            hidden = self.hook_post(ACTIVATIONS[self.kind](self.hook_pre(self.up_proj(x))))
        return self.down_proj(hidden)
