"""``LoRALinear``: one frozen linear layer plus its named low-rank adapters (the per-layer half of LoRA).

    y = W x + b  +  (alpha / r) * B (A dropout(x))        A: (r, in), B: (out, r), B = 0 at start

It is an ``nn.Linear`` that keeps the base ``weight``/``bias`` under their usual names (so
loaders, hooks and ``state_dict`` names of the base are unchanged) and holds any number of
named adapters beside them; one is active at a time. ``merge`` folds the update into W (in
float32: a bf16 merge drifts), ``unmerge`` takes it out. Choosing which layers become
``LoRALinear`` and switching adapters model-wide lives in ``lora.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.errors import AdapterError


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus named low-rank adapters (``lora_A[name]``, ``lora_B[name]``)."""

    peft_method = "lora"  # trainable.attached_methods

    def __init__(self, base: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter objects: tying and names survive
        self.bias = base.bias
        self.lora_A = nn.ParameterDict()  # name -> (r, in)
        self.lora_B = nn.ParameterDict()  # name -> (out, r)
        self.scaling: dict[str, float] = {}
        self.lora_dropout: dict[str, float] = {}
        self.active_adapter: Optional[str] = None
        self.merged_adapter: Optional[str] = None  # the adapter currently folded into weight
        self.disabled = False  # True: behave exactly like the base layer

    def add_adapter(self, name: str, r: int, alpha: float, dropout: float = 0.0, init: str = "kaiming") -> None:
        if name in self.lora_A:
            raise AdapterError(f"this layer already has a LoRA adapter named {name!r}; pick another name.")
        device, dtype = self.weight.device, self.weight.dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
        A = torch.empty(r, self.in_features, device=device, dtype=dtype)
        if init == "kaiming":  # PEFT's default: the same init nn.Linear gives its weight
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))
        else:  # the LoRA paper's Gaussian (PEFT: std = 1/r)
            nn.init.normal_(A, std=1.0 / r)
        self.lora_A[name] = nn.Parameter(A)
        self.lora_B[name] = nn.Parameter(torch.zeros(self.out_features, r, device=device, dtype=dtype))
        self.scaling[name] = alpha / r
        self.lora_dropout[name] = float(dropout)
        if self.active_adapter is None:
            self.active_adapter = name

    def rank(self, name: str) -> int:
        return self.lora_A[name].shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # (..., out)
        name = self.active_adapter
        if self.disabled or name is None or self.merged_adapter is not None:
            return out
        A, B = self.lora_A[name], self.lora_B[name]
        dropped = F.dropout(x, self.lora_dropout[name], self.training) if self.lora_dropout[name] > 0 else x
        update = F.linear(F.linear(dropped.to(A.dtype), A), B)  # (..., r) -> (..., out)
        return out + (update * self.scaling[name]).to(out.dtype)

    # -- merging: fold the update into W, in float32 (a bf16 merge drifts) --
    def delta_weight(self, name: str) -> torch.Tensor:
        """scale * B @ A in float32, (out, in)."""
        return (self.lora_B[name].float() @ self.lora_A[name].float()) * self.scaling[name]

    def merge(self) -> None:
        if self.merged_adapter is not None:
            raise AdapterError(f"LoRA adapter {self.merged_adapter!r} is already merged into this layer; "
                               f"call unmerge() before merging again.")
        if self.active_adapter is None:
            raise AdapterError("this layer has no LoRA adapter to merge.")
        with torch.no_grad():
            merged = self.weight.float() + self.delta_weight(self.active_adapter)
            self.weight.copy_(merged.to(self.weight.dtype))
        self.merged_adapter = self.active_adapter

    def unmerge(self) -> None:
        if self.merged_adapter is None:
            raise AdapterError("no LoRA adapter is merged into this layer; nothing to unmerge.")
        with torch.no_grad():
            restored = self.weight.float() - self.delta_weight(self.merged_adapter)
            self.weight.copy_(restored.to(self.weight.dtype))
        self.merged_adapter = None

    def as_linear(self) -> nn.Linear:
        """A plain nn.Linear holding the (possibly merged) base weights."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        adapters = ", ".join(f"{n}(r={self.rank(n)}, scale={self.scaling[n]:g})" for n in self.lora_A)
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters=[{adapters}], "
                f"active={self.active_adapter!r}, merged={self.merged_adapter!r}")
