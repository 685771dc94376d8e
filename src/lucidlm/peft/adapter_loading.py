"""Loading a saved adapter onto a model: ``load_adapter`` reads an adapter directory (ours, or
one Hugging Face PEFT wrote) and attaches LoRA, bottleneck adapters or a prefix, checking every
tensor against the model before anything is changed, and leaving the model as it was when a
check fails.

The directory's format is described in ``files.py`` (which saves it and re-exports
``load_adapter``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.peft import adapters, prefix
from lucidlm.peft.adapter_meta import META_NAME, base_identity, is_saved_base, meta_fields, read_meta
from lucidlm.peft.gpt2_names import from_gpt2_peft, gpt2_module_name, is_gpt2, tie_fused_qkv
from lucidlm.peft.lora import _as_lora, adapter_names, freeze_base, linear_module_names, set_adapter
from lucidlm.peft.peft_format import (PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, from_peft_tensors, hf_module_name,
                                      module_rank, module_scaling, outside_blocks, qk_rows_from_hf, qk_rows_to_hf,
                                      read_peft_config)
from lucidlm.peft.trainable import check_one_method
from lucidlm.quantization.base import check_float_model
from lucidlm.suggest import keywords_checked
from lucidlm.weights.finite import check_finite

_llama_module_name = hf_module_name  # _load_lora's local hf_module_name picks GPT-2's or this


@keywords_checked(AdapterError)
def load_adapter(model: nn.Module, directory: str | Path, name: str = "default",
                 trainable: bool = False) -> nn.Module:
    """Attach the adapter saved in ``directory`` (ours or PEFT's) to ``model``, unmerged and
    active. The base stays frozen; the adapter is trainable only when ``trainable``."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist (expected {PEFT_CONFIG_NAME} or "
                           f"{META_NAME} with {PEFT_WEIGHTS_NAME} inside).")
    meta = read_meta(directory)
    method = meta["method"] if meta else "lora"
    trained_on = _trained_on(model, meta, directory) if meta is not None else model.config
    check_float_model(model, f"loading an adapter ({directory})")  # before a target check that sees no linears
    check_one_method(model, method)
    if method == "lora":
        config = read_peft_config(directory)  # first: its absence says more than a missing tensor file
        # lucidlm before format 2 wrote q/k rows in the order of the model it trained on (interleaved
        # or not); from format 2 on, and in PEFT's files, they are in Hugging Face's order
        file_rows = None if meta is None or meta["format_version"] >= 2 else trained_on
        _load_lora(model, directory, config, _read_tensors(directory / PEFT_WEIGHTS_NAME), name, file_rows)
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


def _trained_on(model: nn.Module, meta: dict[str, Any], directory: Path) -> Any:
    """The config of the base the adapter was trained on: the model's own, or for a LoRA the
    interleaved-RoPE model that the model is the Hugging Face export of (the same network with
    its q/k rows permuted, which the LoRA's rows follow). Warns, and answers the model's own,
    when it is neither."""
    saved = meta.get("base", {})
    if not saved or is_saved_base(saved.get("config_sha256"), model.config):
        return model.config
    if meta["method"] == "lora" and model.config.rope_variant == "half":
        twin = model.config.replace(rope_variant="interleaved")
        if is_saved_base(saved.get("config_sha256"), twin):
            return twin
    warnings.warn(f"{directory} was trained on a base model with config {saved} but is being loaded onto "
                  f"{base_identity(model)}; outputs may be meaningless.", stacklevel=3)
    return model.config


def _load_lora(model: nn.Module, directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
               name: str, file_rows: Any = None) -> None:
    """``file_rows``: the config of the model whose q/k row order the file's lora_B holds (a
    format-1 lucidlm file); None for Hugging Face's order."""
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
            hf_B = B if file_rows is None else qk_rows_to_hf(file_rows, module, B)
            layer.lora_B[name].copy_(qk_rows_from_hf(model.config, module, hf_B))
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
        if not found and isinstance(targets, list) and outside_blocks(entry):
            raise AdapterError(f"{path}: target_modules entry {entry!r} is {outside_blocks(entry)}; lucidlm's LoRA "
                               f"covers the linear layers inside the blocks only. Train the adapter without it, or "
                               f"merge it in PEFT (merge_and_unload) and load the merged model.")
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
    params = dict(model.named_parameters())
    for key, value in norms.items():  # all checked before the first is copied in
        if key not in params or params[key].shape != value.shape:
            raise AdapterError(f"{source}: norm tensor {key!r} {tuple(value.shape)} does not fit this model.")
    # Norms saved with the adapter stay part of it: trainable again with trainable=True, and saved again.
    adapters.add_adapters(model, meta["bottleneck"], meta["nonlinearity"],
                          train_norms=meta["train_norms"] or bool(norms))
    try:
        adapters.load_adapters_state(model, adapter_tensors, source)
        with torch.no_grad():
            for key, value in norms.items():
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


__all__ = ["load_adapter"]
