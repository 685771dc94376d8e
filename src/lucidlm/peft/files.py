"""Saving and loading adapters.

LoRA is saved in Hugging Face PEFT's own format (peft_format.py), so ``PeftModel.from_pretrained``
reads our adapters and we read theirs. Bottleneck adapters and prefixes have no PEFT
equivalent for our modules and use a small format of our own. Every adapter directory also
holds ``lucidlm_adapter.json``: the method, its settings, and who the base model was, so a
mismatch can be named in the error message.

    DIR/adapter_config.json + DIR/adapter_model.safetensors   (LoRA, PEFT format)
    DIR/adapter_model.safetensors                             (adapter / prefix, our tensor names)
    DIR/lucidlm_adapter.json                                  {"method": "lora" | "adapter" | "prefix", ...}
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.peft import adapters, prefix
from lucidlm.peft.lora import (_as_lora, adapter_names, freeze_base, linear_module_names, lora_layers,
                               set_adapter)
from lucidlm.peft.gpt2_names import from_gpt2_peft, gpt2_module_name, is_gpt2, tie_fused_qkv, to_gpt2_peft
from lucidlm.peft.peft_format import (PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, from_peft_tensors, hf_module_name,
                                      module_rank, module_scaling, peft_config, read_peft_config, to_peft_tensors)
from lucidlm.validation import MAX_CONTEXT, MAX_WIDTH, Fields, read_json_object
from lucidlm.weights.finite import check_finite

_llama_module_name = hf_module_name
from lucidlm.weights.checkpoint import atomic_save_safetensors, atomic_write_text

META_NAME = "lucidlm_adapter.json"
METHODS = ("lora", "adapter", "prefix")


def base_identity(model: nn.Module) -> dict[str, Any]:
    """Enough about the base model to tell a user which one an adapter belongs to."""
    cfg = model.config.to_dict()
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
    keys = ("name", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp")
    return {"config_sha256": digest, **{k: cfg[k] for k in keys}}


def method_of(model: nn.Module) -> Optional[str]:
    if any(True for _ in lora_layers(model)):
        return "lora"
    if any(True for _ in adapters.adapted_layers(model)):
        return "adapter"
    if prefix.prefix_encoder(model) is not None:
        return "prefix"
    return None


# ---------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------

def save_adapter(model: nn.Module, directory: str | Path, name: Optional[str] = None,
                 base_model_name_or_path: Optional[str] = None) -> Path:
    """Write the model's adapter (LoRA: the adapter ``name``, default the active one)."""
    directory = Path(directory)
    method = method_of(model)
    if method is None:
        raise AdapterError("the model has no LoRA, adapter or prefix to save; add one first.")
    meta: dict[str, Any] = {"method": method, "format_version": 1, "base": base_identity(model)}
    if method == "lora":
        name = name or _active_lora(model)
        tensors, config = _lora_files(model, name, base_model_name_or_path)
        atomic_write_text(directory / PEFT_CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        meta["adapter_name"] = name
    elif method == "adapter":
        layer = next(adapters.adapted_layers(model))[1].adapter
        tensors = adapters.adapters_state_dict(model)
        norms = _trained_norms(model)
        tensors.update({f"norms.{k}": v for k, v in norms.items()})
        meta.update(bottleneck=layer.down.out_features, nonlinearity=layer.nonlinearity, train_norms=bool(norms))
    else:
        encoder = prefix.prefix_encoder(model)
        tensors = {k: v.detach() for k, v in encoder.state_dict().items()}
        meta.update(length=encoder.length, frozen=encoder.frozen,
                    hidden=None if encoder.frozen else encoder.hidden.out_features)
    atomic_save_safetensors(tensors, directory / PEFT_WEIGHTS_NAME)
    atomic_write_text(directory / META_NAME, json.dumps(meta, indent=2) + "\n")
    return directory


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
        tensors[f"{n}.lora_B"] = layer.lora_B[name].detach()
    config = peft_config(r, alpha, dropout, targets, base, rank_pattern, alpha_pattern)
    if gpt2:  # transformers' GPT-2 uses Conv1D, whose weight is (in, out): PEFT records that
        config["fan_in_fan_out"] = True
        return to_gpt2_peft(model, name, tensors), config
    return to_peft_tensors(tensors), config


def _trained_norms(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()
            if p.requires_grad and n.rsplit(".", 2)[-2] in ("ln1", "ln2", "ln_final")}


# ---------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------

def read_meta(directory: Path) -> Optional[dict[str, Any]]:
    """lucidlm_adapter.json (None when absent), its method and settings checked for type and
    range; the sizes that depend on the base model are checked again when it is applied."""
    fields = meta_fields(directory)
    if fields is None:
        return None
    meta = dict(fields.data)
    meta["method"] = fields.str("method", choices=METHODS)
    meta["base"] = dict(fields.object("base", default={}).data)
    if meta["method"] == "adapter":
        meta.update(bottleneck=fields.int("bottleneck", low=1, high=MAX_WIDTH),
                    nonlinearity=fields.str("nonlinearity", default="gelu", choices=tuple(adapters.NONLINEARITIES)),
                    train_norms=fields.bool("train_norms", default=False))
    elif meta["method"] == "prefix":
        meta.update(length=fields.int("length", low=1, high=MAX_CONTEXT),
                    hidden=fields.int("hidden", default=None, low=1, high=MAX_WIDTH),
                    frozen=fields.bool("frozen", default=False))
    elif meta.get("adapter_name") is not None:
        fields.str("adapter_name")
    return meta


def meta_fields(directory: Path) -> Optional[Fields]:
    path = directory / META_NAME
    if not path.exists():
        return None
    return read_json_object(path, AdapterError, "lucidlm adapter file", fix=_FIX)


_FIX = "fix it or save the adapter again (lucidlm finetune)"


def load_adapter(model: nn.Module, directory: str | Path, name: str = "default",
                 trainable: bool = False) -> nn.Module:
    """Attach the adapter saved in ``directory`` (ours or PEFT's) to ``model``, unmerged and
    active. The base stays frozen; the adapter is trainable only when ``trainable``."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist (expected {PEFT_CONFIG_NAME} or "
                           f"{META_NAME} with {PEFT_WEIGHTS_NAME} inside).")
    meta = read_meta(directory)
    if meta is not None:
        _warn_if_other_base(model, meta, directory)
    method = meta["method"] if meta else "lora"
    if method == "lora":
        config = read_peft_config(directory)  # first: its absence says more than a missing tensor file
        _load_lora(model, directory, config, _read_tensors(directory / PEFT_WEIGHTS_NAME), name)
    elif method == "adapter":
        _load_bottleneck(model, directory, _read_tensors(directory / PEFT_WEIGHTS_NAME), meta)
    else:
        _load_prefix(model, directory, _read_tensors(directory / PEFT_WEIGHTS_NAME), meta)
    if not trainable:
        freeze_base(model)
    return model.eval()


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise AdapterError(f"{path} is missing; the adapter directory is incomplete.")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{path} cannot be read ({exc}); the file is truncated or corrupted.") from None
    # A NaN in an adapter never fails later: it silently turns every output (or a merge) into NaN.
    check_finite(tensors, path, AdapterError, "The adapter is damaged or comes from a diverged training run; "
                                              "train it again or use an earlier checkpoint.")
    return tensors


def _warn_if_other_base(model: nn.Module, meta: dict[str, Any], directory: Path) -> None:
    saved, ours = meta.get("base", {}), base_identity(model)
    if saved and saved.get("config_sha256") != ours["config_sha256"]:
        warnings.warn(f"{directory} was trained on a base model with config {saved} but is being loaded onto "
                      f"{ours}; outputs may be meaningless.", stacklevel=3)


def _load_lora(model: nn.Module, directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
               name: str) -> None:
    source = str(directory / PEFT_WEIGHTS_NAME)
    modules = from_peft_tensors(tensors, source)
    gpt2 = is_gpt2(model)
    hf_module_name = gpt2_module_name if gpt2 else _llama_module_name
    if gpt2:
        modules = from_gpt2_peft(model, modules, source)
    known = set(linear_module_names(model))
    _check_targets(config, {hf_module_name(n) for n in known}, directory / PEFT_CONFIG_NAME, model)
    for module, parts in modules.items():  # check everything before changing the model
        peft_key = f"base_model.model.{hf_module_name(module)}.lora_A.weight"
        if module not in known:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in known})
            raise AdapterError(f"{source}: tensor {peft_key!r} is for module {module!r}, which this model does not "
                               f"have (its linear layers: {', '.join(suffixes)}, in {model.config.n_layers} blocks); "
                               f"the adapter belongs to a different base model.")
        linear = model.get_submodule(module)
        A, B = parts["lora_A"], parts["lora_B"]
        r = module_rank(config, hf_module_name(module))  # adapter_config.json's r (or rank_pattern)
        for part, found, needed in (("lora_A", A, (r, linear.in_features)), ("lora_B", B, (linear.out_features, r))):
            if tuple(found.shape) != needed:
                key = f"base_model.model.{hf_module_name(module)}.{part}.weight"
                feature_dim = 1 if part == "lora_A" else 0  # A is (r, in), B is (out, r)
                fits_layer = found.ndim == 2 and found.shape[feature_dim] == needed[feature_dim]
                why = (f"its rank differs from r={r} in adapter_config.json" if fits_layer
                       else "the adapter belongs to a different base model")
                raise AdapterError(f"{source}: tensor {key!r} has shape {tuple(found.shape)} but {module} of this "
                                   f"model needs {needed}; {why}.")
    if name in adapter_names(model):
        raise AdapterError(f"the model already has a LoRA adapter named {name!r}; load this one under another name.")
    dropout = config["lora_dropout"]
    for module, parts in modules.items():
        A, B = parts["lora_A"], parts["lora_B"]
        layer = _as_lora(model, module)
        layer.add_adapter(name, A.shape[0], alpha=1.0, dropout=dropout)
        layer.scaling[name] = module_scaling(config, hf_module_name(module), A.shape[0])
        with torch.no_grad():
            layer.lora_A[name].copy_(A)
            layer.lora_B[name].copy_(B)
    if gpt2:
        tie_fused_qkv(model, name)  # c_attn's q, k and v parts share one A
    freeze_base(model)
    set_adapter(model, name)


def _check_targets(config: dict[str, Any], modules: set[str], path: Path, model: nn.Module) -> None:
    """Each of target_modules must name a linear layer of this model (PEFT's rule: a list entry
    is a full name or a name suffix, a string is a regex over full names), as PEFT requires."""
    targets = config.get("target_modules")
    if targets is None or targets == "all-linear":
        return
    entries = [targets] if isinstance(targets, str) else targets
    for entry in entries:
        if isinstance(targets, str):
            found = any(re.fullmatch(entry, name) for name in modules)
        else:
            found = any(name == entry or name.endswith("." + entry) for name in modules)
        if not found:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in modules})
            raise AdapterError(f"{path}: target_modules entry {entry!r} matches no linear layer of this model (its "
                               f"layers: {', '.join(suffixes)}, in {model.config.n_layers} blocks); the adapter "
                               f"belongs to a different base model or its config is wrong.")


def _load_bottleneck(model: nn.Module, directory: Path, tensors: dict[str, torch.Tensor],
                     meta: dict[str, Any]) -> None:
    source = str(directory / PEFT_WEIGHTS_NAME)
    norms = {k[len("norms."):]: v for k, v in tensors.items() if k.startswith("norms.")}
    adapter_tensors = {k: v for k, v in tensors.items() if not k.startswith("norms.")}
    meta_fields(directory).int("bottleneck", low=1, high=model.config.d_model)  # names the file and the field
    adapters.add_adapters(model, meta["bottleneck"], meta["nonlinearity"])
    try:
        adapters.load_adapters_state(model, adapter_tensors, source)
        params = dict(model.named_parameters())
        for key, value in norms.items():
            if key not in params or params[key].shape != value.shape:
                raise AdapterError(f"{source}: norm tensor {key!r} {tuple(value.shape)} does not fit this model.")
            with torch.no_grad():
                params[key].copy_(value)
    except AdapterError:
        adapters.remove_adapters(model)  # leave the model as it was
        raise


def _load_prefix(model: nn.Module, directory: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    source = str(directory / PEFT_WEIGHTS_NAME)
    encoder = prefix.add_prefix(model, meta["length"], hidden=meta["hidden"], source=str(directory / META_NAME))
    if meta.get("frozen"):
        encoder.freeze()
    try:
        expected = encoder.state_dict()
        for key, param in expected.items():
            if key not in tensors:
                raise AdapterError(f"{source}: prefix tensor {key!r} is missing; the file is incomplete.")
            if tuple(tensors[key].shape) != tuple(param.shape):
                raise AdapterError(f"{source}: tensor {key!r} has shape {tuple(tensors[key].shape)} but this model "
                                   f"needs {tuple(param.shape)}; the prefix belongs to a different base model.")
        with torch.no_grad():
            for key, param in expected.items():
                param.copy_(tensors[key])
    except AdapterError:
        prefix.remove_prefix(model)
        raise
