"""Opt-in hook points, as TransformerLens's ``use_attn_result`` / ``use_split_qkv_input`` /
``use_attn_in`` / ``use_hook_mlp_in`` offer them. Each costs memory and time, so each is off
until asked for; when off its hook point does not exist (the pinned hook list is unchanged)
and the forward pass takes the plain path.

- ``blocks.{i}.attn.hook_result``  (B, T, nh, d): each head's output, o_proj applied to that
  head's z alone, without the output bias. Summed over heads plus the bias = ``hook_attn_out``
  (with bottleneck adapters: the writes before the adapter, which then runs on that sum).
- ``blocks.{i}.hook_q_input`` (B, T, nh, d), ``hook_k_input`` / ``hook_v_input`` (B, T, n_kv, d):
  one copy of the residual stream per head, each normalised by ln1 and projected by its own
  head only, so a patch to one head's input reaches that head alone.
- ``blocks.{i}.hook_attn_in`` (B, T, nh, d): one copy per head feeding q, k and v together
  (multi-head attention only; with grouped heads use the split inputs).
- ``blocks.{i}.hook_mlp_in`` (B, T, d): the MLP's input before ln2 (= resid_mid).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.errors import ConfigError
from lucidlm.model.hooks import HookPoint

BLOCK_OPTIONS = {"split_qkv_input": ("hook_q_input", "hook_k_input", "hook_v_input"),
                 "attn_in": ("hook_attn_in",), "mlp_in": ("hook_mlp_in",)}


def set_hook_options(model: nn.Module, attn_result: Optional[bool] = None, split_qkv_input: Optional[bool] = None,
                     attn_in: Optional[bool] = None, mlp_in: Optional[bool] = None) -> None:
    """Turn opt-in hook points on or off in every block (None leaves an option as it is)."""
    for option, on in (("attn_result", attn_result), ("split_qkv_input", split_qkv_input), ("attn_in", attn_in),
                       ("mlp_in", mlp_in)):
        if on is not None and not isinstance(on, bool):  # "no" is truthy: it would turn the hooks on
            raise ConfigError(f"{option}={on!r}: pass True or False.")
    cfg = model.config
    if attn_in and cfg.n_kv_heads != cfg.n_heads:
        # named by the model's own switches: set_hook_options is not what users call
        raise ConfigError(f"model.set_use_attn_in(True) needs one key/value head per query head, but this "
                          f"model has n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}; use "
                          f"model.set_use_split_qkv_input(True) instead (one input per query head and per "
                          f"key/value head).")
    wanted = {"split_qkv_input": split_qkv_input, "attn_in": attn_in, "mlp_in": mlp_in}
    for i, block in enumerate(model.blocks):
        for option, on in wanted.items():
            if on is not None:
                setattr(block, f"use_{option}", on)
                for name in BLOCK_OPTIONS[option]:
                    _toggle(block, name, on, f"blocks.{i}.{name}")
        if attn_result is not None:
            block.attn.use_attn_result = attn_result
            _toggle(block.attn, "hook_result", attn_result, f"blocks.{i}.attn.hook_result")


def _toggle(module: nn.Module, name: str, on: bool, full_name: str) -> None:
    if on and not isinstance(getattr(module, name, None), HookPoint):
        point = HookPoint()
        point.name = full_name
        module.add_module(name, point)
    elif not on and name in module._modules:
        del module._modules[name]


def per_head(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, d) -> (B, T, n, d): one copy of the stream per head (a copy, so a hook may edit it)."""
    return x.unsqueeze(-2).repeat(*([1] * (x.ndim - 1)), n, 1)


def per_head_linear(linear: nn.Module, x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Project per-head inputs (B, T, n, d) with each head's own slice of ``linear``: (B, T, n, hd).
    Runs the whole layer on each copy and keeps the diagonal, so it works for any linear
    module (LoRA-wrapped or quantized alike); opt-in analysis only, the cost is n times."""
    out = linear(x).unflatten(-1, (n_heads, head_dim))  # (B, T, n, n, hd): input copy x output head
    return out.diagonal(dim1=-3, dim2=-2).movedim(-1, -2)  # (B, T, n, hd)


def head_results(o_proj: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """Each head's write into the stream, (B, T, nh, hd) -> (B, T, nh, d), output bias left out:
    o_proj's linear map applied to a copy of z where every other head is zeroed. A layer with a
    bottleneck adapter after it (peft/adapters.py, found by its ``adapter``) contributes its
    base map only: the adapter is not linear, so it runs once on the sum (``sum_head_results``)
    and never on a single head."""
    nh = z.shape[-2]
    eye = torch.eye(nh, dtype=z.dtype, device=z.device)  # (nh, nh)
    alone = (eye[:, :, None] * z.unsqueeze(-3)).flatten(-2)  # (B, T, nh, nh * hd): head h only in row h
    if getattr(o_proj, "adapter", None) is not None:
        return F.linear(alone, o_proj.weight)  # (B, T, nh, d)
    result = o_proj(alone)  # (B, T, nh, d)
    bias = getattr(o_proj, "bias", None)
    return result - bias if bias is not None else result


def sum_head_results(o_proj: nn.Module, result: torch.Tensor) -> torch.Tensor:
    """What o_proj would have returned, from the (possibly hooked) per-head writes (B, T, nh, d):
    their sum plus the output bias, passed through the layer's bottleneck adapter if it has an
    active one, as the layer itself does. (B, T, d)."""
    out = result.sum(-2)
    bias = getattr(o_proj, "bias", None)
    out = out + bias if bias is not None else out
    adapter = getattr(o_proj, "adapter", None)
    return adapter(out) if adapter is not None and not getattr(o_proj, "disabled", False) else out
