"""LoRA: low-rank updates to frozen linear layers (Hu et al., 2021; seed 004 section 3.2).

    y = W x + b  +  (alpha / r) * B (A dropout(x))        A: (r, in), B: (out, r), B = 0 at start

Because B starts at zero the adapted model starts out *equal* to the base model, and only
A and B (r * (in + out) numbers per layer) are trained. After training, ``merge`` folds the
update into W (W + scale * B @ A) so inference costs nothing extra; ``unmerge`` takes it out.

This file is the model-level half: attach adapters to the layers ``targets`` names, switch,
merge, unload, and take an adapter's state dict. The per-layer module is ``LoRALinear``
(``lora_linear.py``), target matching is ``lora_targets.py``, and freezing/counting shared by
every method is ``trainable.py``; their names are re-exported here so older imports keep working.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.quantization.base import check_float_model
from lucidlm.suggest import keywords_checked
from lucidlm.peft.gpt2_names import FUSED_QKV, is_gpt2, tie_fused_qkv
from lucidlm.peft.lora_linear import LoRALinear
from lucidlm.peft.lora_targets import (  # noqa: F401  (some re-exported: this module was their home)
    DEFAULT_TARGETS, SHORT_TARGETS, expand_targets, linear_module_names, match_targets)
from lucidlm.peft.trainable import (  # noqa: F401  (some re-exported: this module was their home)
    check_one_method, count_parameters, freeze_base, trainable_parameters_report, unmergeable_note)

LORA_INITS = ("kaiming", "gaussian")


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """Yield ``(module name, LoRALinear)`` for every LoRA-wrapped linear layer of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def adapter_names(model: nn.Module) -> list[str]:
    """The names of the LoRA adapters attached to ``model`` (``add_lora(name=...)``), in the order
    they were added; ``[]`` when it has none."""
    names: dict[str, None] = {}
    for _, layer in lora_layers(model):
        names.update(dict.fromkeys(layer.lora_A))
    return list(names)


@keywords_checked(AdapterError)
def add_lora(model: nn.Module, name: str = "default", r: int = 8, alpha: float = 16, dropout: float = 0.0,
             targets: str | Sequence[str] = DEFAULT_TARGETS, init: str = "kaiming") -> list[str]:
    """Attach a LoRA adapter called ``name`` to every linear layer matched by ``targets``,
    make it the active one, and freeze everything else. Returns the adapted module names.

    ``targets``: module names (``"q_proj,v_proj"``, short forms ``q,k,v,o,gate,up,down``),
    ``"all-linear"``, a regular expression over full names, or ``"default"``: PEFT's choice for
    the architecture (q_proj and v_proj; on GPT-2 its fused c_attn). On GPT-2, q, k and v are
    one layer (c_attn) in its files: a LoRA on all three of a block shares one A, as PEFT's on
    c_attn does. One on only some of them works in memory but cannot be saved as a PEFT file
    (``save_adapter`` says so; ``finetune``, which saves, refuses it before training:
    ``check_whole_c_attn``)."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"LoRA rank r={r!r} must be a positive integer (typical: 4, 8, 16).")
    if init not in LORA_INITS:
        raise AdapterError(f"unknown LoRA init {init!r}; choose one of {', '.join(LORA_INITS)}.")
    if not _finite(dropout) or not 0.0 <= dropout < 1.0:
        raise AdapterError(f"LoRA dropout={dropout!r} must be in [0, 1).")
    if not _finite(alpha):
        raise AdapterError(f"LoRA alpha={alpha!r} must be a finite number (updates are scaled by alpha / r; "
                           f"typical: 2 * r).")
    if name in adapter_names(model):
        raise AdapterError(f"the model already has a LoRA adapter named {name!r}; pick another name.")
    if any(layer.merged_adapter for _, layer in lora_layers(model)):
        raise AdapterError("a LoRA adapter is merged into the model; unmerge it before adding another.")
    check_float_model(model, "adding LoRA")
    check_one_method(model, "lora")
    chosen = match_targets(model, targets)
    for module_name in chosen:
        linear = model.get_submodule(module_name)
        limit = min(linear.in_features, linear.out_features)
        if r > limit:
            raise AdapterError(
                f"LoRA rank r={r} is larger than {module_name} allows: its weight is "
                f"({linear.out_features}, {linear.in_features}), so r must be <= {limit}."
            )
    freeze_base(model)
    for module_name in chosen:
        layer = _as_lora(model, module_name)
        layer.add_adapter(name, r, alpha, dropout, init)
    if is_gpt2(model):
        tie_fused_qkv(model, name)  # one LoRA on each whole fused q/k/v: the three share A (gpt2_names.py)
    set_adapter(model, name)
    return chosen


def check_whole_c_attn(model: nn.Module, chosen: Sequence[str]) -> None:
    """On GPT-2, refuse LoRA targets that take some but not all of a block's q, k and v: its
    PEFT file could not hold them (they are one layer, c_attn, in transformers)."""
    if not is_gpt2(model):
        return
    for name in chosen:
        block, _, layer = name.rpartition(".")
        if layer in FUSED_QKV and not all(f"{block}.{part}" in chosen for part in FUSED_QKV):
            raise AdapterError(
                f"LoRA targets take {name} but not all of {block}.{{{','.join(FUSED_QKV)}}}: GPT-2's q, k and v are "
                f"one fused layer (c_attn) in transformers and PEFT files, so a LoRA there covers all three with one "
                f"shared A. Target c_attn (PEFT's default for GPT-2), all-linear, or leave q/k/v out.")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _as_lora(model: nn.Module, module_name: str) -> LoRALinear:
    module = model.get_submodule(module_name)
    if isinstance(module, LoRALinear):
        return module
    layer = LoRALinear(module)
    layer.train(module.training)  # a new module starts in training mode: its dropout must follow the model's
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return layer


def _check_known(model: nn.Module, name: str) -> None:
    names = adapter_names(model)
    if name not in names:
        raise AdapterError(f"no LoRA adapter named {name!r}; the model has: {', '.join(names) or 'none'}.")


def set_adapter(model: nn.Module, name: str) -> None:
    """Make ``name`` the active LoRA adapter (and the only trainable one)."""
    _check_known(model, name)
    layers = list(lora_layers(model))
    if any(layer.merged_adapter not in (None, name) for _, layer in layers):
        raise AdapterError(f"another LoRA adapter is merged into the weights; unmerge it before switching to {name!r}.")
    for _, layer in layers:
        layer.active_adapter = name if name in layer.lora_A else None
        for adapter, param in layer.lora_A.items():
            param.requires_grad_(adapter == name)
            layer.lora_B[adapter].requires_grad_(adapter == name)


def merge_adapter(model: nn.Module) -> None:
    """Fold the active adapter into the base weights (W += scale * B @ A, in float32)."""
    layers = [layer for _, layer in lora_layers(model) if layer.active_adapter is not None]
    if not layers:
        raise AdapterError(f"the model has no active LoRA adapter to merge.{unmergeable_note(model)}")
    merged = [layer.merged_adapter for layer in layers if layer.merged_adapter is not None]
    if merged:
        raise AdapterError(f"LoRA adapter {merged[0]!r} is already merged; call unmerge_adapter() first.")
    for layer in layers:
        layer.merge()


def unmerge_adapter(model: nn.Module) -> None:
    """Take the merged adapter back out of the base weights."""
    layers = [layer for _, layer in lora_layers(model) if layer.merged_adapter is not None]
    if not layers:
        raise AdapterError("no LoRA adapter is merged into the model; nothing to unmerge.")
    for layer in layers:
        layer.unmerge()


def unload_lora(model: nn.Module, merge: bool = False) -> nn.Module:
    """Replace every LoRALinear by a plain nn.Linear (merging the active adapter first when
    ``merge``): the model is then an ordinary model that saves and loads like any other."""
    if merge and not any(layer.merged_adapter for _, layer in lora_layers(model)):
        merge_adapter(model)
    for module_name, layer in list(lora_layers(model)):
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer.as_linear())
    return model


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge the active LoRA adapter into the base weights (W += alpha/r * B @ A) and replace
    every LoRALinear by a plain nn.Linear, as PEFT's ``merge_and_unload``; returns ``model``,
    which then saves, loads and runs like a model that never had LoRA."""
    return unload_lora(model, merge=True)


def lora_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """``{module_name: (A, B)}`` flattened to ``module.lora_A`` / ``module.lora_B`` keys."""
    _check_known(model, name)
    state: dict[str, torch.Tensor] = {}
    for module_name, layer in lora_layers(model):
        if name in layer.lora_A:
            state[f"{module_name}.lora_A"] = layer.lora_A[name].detach()
            state[f"{module_name}.lora_B"] = layer.lora_B[name].detach()
    return state
