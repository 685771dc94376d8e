"""LoRA on GPT-2 under GPT-2's own module names, and PEFT files for ``GPT2LMHeadModel``.

GPT-2 computes q, k and v with one fused layer, ``c_attn`` (d -> 3d); lucidlm keeps three
(``q_proj``, ``k_proj``, ``v_proj``). A LoRA on ``c_attn`` is A (r, d) and B (3d, r); its
update B @ A splits row-wise into q, k and v parts that share A:

    delta_q = B[:d] @ A,   delta_k = B[d:2d] @ A,   delta_v = B[2d:] @ A

so targeting ``c_attn`` gives q, k and v LoRA layers holding *the same* A parameter (trained
once, from all three) and their slices of B: exactly PEFT's fused adapter, and it saves back
to one ``c_attn`` entry. ``c_proj`` is GPT-2's name for both attention's output (o_proj) and
the MLP's second layer (down_proj), as PEFT matches it; ``c_fc`` is the MLP's first (up_proj).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lucidlm.errors import AdapterError

GPT2_TARGETS = {"c_attn": ["q_proj", "k_proj", "v_proj"], "c_proj": ["o_proj", "down_proj"], "c_fc": ["up_proj"]}
FUSED_QKV = ("q_proj", "k_proj", "v_proj")
_OURS = re.compile(r"^blocks\.(\d+)\.(attn|mlp)\.(\w+)$")
_HF = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(attn|mlp)\.(c_attn|c_proj|c_fc)$")
_TO_HF = {("attn", "q_proj"): "c_attn", ("attn", "k_proj"): "c_attn", ("attn", "v_proj"): "c_attn",
          ("attn", "o_proj"): "c_proj", ("mlp", "up_proj"): "c_fc", ("mlp", "down_proj"): "c_proj"}


def is_gpt2(model: nn.Module) -> bool:
    """Whether the model's Hugging Face form is GPT2LMHeadModel (what its adapters load into)."""
    from lucidlm.errors import ConfigError
    from lucidlm.weights.hf_names import export_family

    try:
        return export_family(model.config) == "gpt2"
    except ConfigError:
        return False


def gpt2_module_name(ours: str) -> str:
    """``blocks.0.attn.k_proj`` -> ``transformer.h.0.attn.c_attn`` (other names unchanged)."""
    found = _OURS.match(ours)
    if found is None or (found.group(2), found.group(3)) not in _TO_HF:
        return ours
    return f"transformer.h.{found.group(1)}.{found.group(2)}.{_TO_HF[found.group(2), found.group(3)]}"


def tie_fused_qkv(model: nn.Module, name: str) -> None:
    """Make each block's q, k and v adapters ``name`` share q's A (a LoRA on c_attn)."""
    for block in model.blocks:
        layers = [getattr(block.attn, p) for p in FUSED_QKV]
        if all(hasattr(layer, "lora_A") and name in layer.lora_A for layer in layers):
            for layer in layers[1:]:
                layer.lora_A[name] = layers[0].lora_A[name]


def to_gpt2_peft(model: nn.Module, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our ``{module.lora_A/B: tensor}`` -> PEFT keys for GPT2LMHeadModel (q, k, v fused)."""
    out: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        fused = [getattr(block.attn, p) for p in FUSED_QKV]
        has = [hasattr(layer, "lora_A") and name in layer.lora_A for layer in fused]
        if any(has):
            if not (all(has) and fused[1].lora_A[name] is fused[0].lora_A[name] is fused[2].lora_A[name]):
                raise AdapterError("GPT-2's q, k and v are one fused layer (c_attn) in transformers, so a PEFT file "
                                   "can only hold a LoRA on all three with one shared A: target c_attn, not q/k/v.")
            key = f"base_model.model.transformer.h.{i}.attn.c_attn"
            out[f"{key}.lora_A.weight"] = fused[0].lora_A[name].detach().contiguous()
            out[f"{key}.lora_B.weight"] = torch.cat([layer.lora_B[name].detach() for layer in fused]).contiguous()
    for key, tensor in tensors.items():
        module, part = key.rsplit(".", 1)
        if module.rsplit(".", 1)[-1] not in FUSED_QKV:
            out[f"base_model.model.{gpt2_module_name(module)}.{part}.weight"] = tensor.contiguous()
    return out


def from_gpt2_peft(model: nn.Module, modules: dict[str, dict[str, Any]], source: str) -> dict[str, dict[str, Any]]:
    """PEFT modules under GPT-2 names (``transformer.h.0.attn.c_attn``) -> ours, c_attn split
    into q, k and v with one A (the caller ties it with ``tie_fused_qkv``)."""
    out: dict[str, dict[str, Any]] = {}
    for hf_name, parts in modules.items():
        found = _HF.match(hf_name)
        if found is None:
            out[hf_name] = parts
            continue
        i, kind, layer = found.groups()
        if layer == "c_attn":
            cfg = model.config
            sizes = [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]
            if parts["lora_B"].ndim != 2 or parts["lora_B"].shape[0] != sum(sizes):
                raise AdapterError(f"{source}: c_attn of block {i} has lora_B of shape {tuple(parts['lora_B'].shape)}, "
                                   f"but this model's fused q, k, v need ({sum(sizes)}, r); it is for another base.")
            for proj, B in zip(FUSED_QKV, parts["lora_B"].split(sizes)):
                out[f"blocks.{i}.attn.{proj}"] = {"lora_A": parts["lora_A"], "lora_B": B}
        else:
            ours = {"c_fc": "up_proj", "c_proj": "o_proj" if kind == "attn" else "down_proj"}[layer]
            out[f"blocks.{i}.{kind}.{ours}"] = parts
    return out
