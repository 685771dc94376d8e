"""Saving and loading adapters.

LoRA is saved in Hugging Face PEFT's own format (peft_format.py), so ``PeftModel.from_pretrained``
reads our adapters and we read theirs. Bottleneck adapters and prefixes have no PEFT
equivalent for our modules and use a small format of our own. Every adapter directory also
holds ``lucidlm_adapter.json``: the method, its settings, and who the base model was, so a
mismatch can be named in the error message.

    DIR/adapter_config.json + DIR/adapter_model.safetensors   (LoRA, PEFT format)
    DIR/adapter_model.safetensors                             (adapter / prefix, our tensor names)
    DIR/lucidlm_adapter.json                                  {"method": "lora" | "adapter" | "prefix", ...}

This module saves; ``adapter_loading.py`` loads and ``adapter_meta.py`` reads and checks
``lucidlm_adapter.json`` (both re-exported here).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.peft import adapters, prefix
from lucidlm.peft.adapter_loading import load_adapter  # noqa: F401  (re-exported: this module was its home)
from lucidlm.peft.adapter_meta import (  # noqa: F401  (re-exported: this module was their home)
    FORMAT_VERSION, META_NAME, METHODS, base_identity, meta_fields, read_meta)
from lucidlm.peft.gpt2_names import gpt2_module_name, is_gpt2, to_gpt2_peft
from lucidlm.peft.lora import adapter_names, linear_module_names, lora_layers
from lucidlm.peft.peft_format import (PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, hf_module_name, peft_config, qk_rows_to_hf,
                                      to_peft_tensors)
from lucidlm.outputs import user_path
from lucidlm.peft.trainable import attached_methods
from lucidlm.staging import atomic_write_text, replacing_files
from lucidlm.suggest import keywords_checked
from lucidlm.weights.checkpoint import atomic_save_safetensors


def method_of(model: nn.Module) -> Optional[str]:
    """Which kind of adapter ``model`` carries: "lora", "adapter" (bottleneck), "prefix", or
    None for none (add_lora / add_adapters / add_prefix refuse a second method beside one)."""
    methods = attached_methods(model)
    return methods[0] if methods else None


@keywords_checked(AdapterError)
def save_adapter(model: nn.Module, directory: str | Path, name: Optional[str] = None,
                 base_model_name_or_path: Optional[str] = None) -> Path:
    """Write the model's adapter (LoRA: the adapter ``name``, default the active one)."""
    directory = user_path(directory)  # "~/a" is where load_adapter("~/a") looks, not ./~/a
    methods = attached_methods(model)
    if not methods:
        raise AdapterError("the model has no LoRA, adapter or prefix to save; add one first.")
    if len(methods) > 1:  # only module surgery gets here: add_lora & co. refuse a second method
        raise AdapterError(f"the model carries several fine-tuning methods ({', '.join(methods)}); an adapter "
                           f"directory holds one. Remove all but one before saving.")
    # Over an earlier adapter, the files of it this save does not rewrite go once it has succeeded:
    # a LoRA's adapter_config.json left beside a prefix made PEFT load the prefix as a LoRA
    with replacing_files(directory, (PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, META_NAME)):
        _save_adapter(model, directory, methods[0], name, base_model_name_or_path)
    return directory


def _save_adapter(model: nn.Module, directory: Path, method: str, name: Optional[str],
                  base_model_name_or_path: Optional[str]) -> None:
    meta: dict[str, Any] = {"method": method, "format_version": FORMAT_VERSION, "base": base_identity(model)}
    if method == "lora":
        name = name or _active_lora(model)
        tensors, config = _lora_files(model, name, base_model_name_or_path)
        atomic_write_text(directory / PEFT_CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        meta["adapter_name"] = name
    elif method == "adapter":
        layer = next(adapters.adapted_layers(model))[1]
        tensors = adapters.adapters_state_dict(model)
        norms = _adapter_norms(model) if layer.train_norms else {}
        tensors.update({f"norms.{k}": v for k, v in norms.items()})
        meta.update(bottleneck=layer.adapter.down.out_features, nonlinearity=layer.adapter.nonlinearity,
                    train_norms=layer.train_norms)
    else:
        encoder = prefix.prefix_encoder(model)
        tensors = {k: v.detach() for k, v in encoder.state_dict().items()}
        meta.update(length=encoder.length, frozen=encoder.frozen,
                    hidden=None if encoder.frozen else encoder.hidden.out_features)
    atomic_save_safetensors(tensors, directory / PEFT_WEIGHTS_NAME)
    atomic_write_text(directory / META_NAME, json.dumps(meta, indent=2) + "\n")


def _active_lora(model: nn.Module) -> str:
    for _, layer in lora_layers(model):
        if layer.active_adapter is not None:
            return layer.active_adapter
    return adapter_names(model)[0]


def _lora_files(model: nn.Module, name: str, base: Optional[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    layers = [(n, layer) for n, layer in lora_layers(model) if name in layer.lora_A]
    if not layers:
        raise AdapterError(f"no LoRA adapter named {name!r}; the model has: {', '.join(adapter_names(model))}.")
    ranks = {n: layer.rank(name) for n, layer in layers}
    alphas = {n: layer.scaling[name] * layer.rank(name) for n, layer in layers}
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    # Modules that differ from the common rank/alpha go into PEFT's per-module patterns.
    gpt2 = is_gpt2(model)
    hf_name = gpt2_module_name if gpt2 else hf_module_name
    rank_pattern = {hf_name(n): v for n, v in ranks.items() if v != r}
    alpha_pattern = {hf_name(n): v for n, v in alphas.items() if v != alpha}
    adapted = sorted({hf_name(n) for n, _ in layers})
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    every_layer = {hf_name(n) for n in linear_module_names(model)}
    every_layer = sorted(n for n in every_layer if n.rsplit(".", 1)[-1] in suffixes)
    # PEFT matches a bare suffix in every layer; if only some layers are adapted, name them all.
    targets = suffixes if every_layer == adapted else adapted
    dropout = layers[0][1].lora_dropout[name]
    tensors = {}
    for n, layer in layers:
        tensors[f"{n}.lora_A"] = layer.lora_A[name].detach()
        tensors[f"{n}.lora_B"] = qk_rows_to_hf(model.config, n, layer.lora_B[name].detach())
    config = peft_config(r, alpha, dropout, targets, base, rank_pattern, alpha_pattern)
    if gpt2:  # transformers' GPT-2 uses Conv1D, whose weight is (in, out): PEFT records that
        config["fan_in_fan_out"] = True
        return to_gpt2_peft(model, name, tensors), config
    return to_peft_tensors(tensors), config


def _adapter_norms(model: nn.Module) -> dict[str, torch.Tensor]:
    """The norms of adapters added with train_norms=True (or loaded from a file that has them):
    part of the adapter whether they are trainable right now or not (a load freezes them)."""
    return {n: p.detach() for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] in adapters.NORMS}
