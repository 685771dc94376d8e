"""``quantize(model, scheme)``: swap every ``nn.Linear`` (and the token embedding) for its
quantized counterpart, as gpt-fast does. The model's code does not change: the modules do.

Embedding and tied unembedding: both are quantized. The embedding becomes a
``QuantizedEmbedding`` (a lookup dequantizes only the rows it gathers), the unembedding a
``QuantizedLinear``. When the model ties them (SmolLM2 does; the unembedding is 21 % of its
weights, and every decoded token reads all of it), the matrix is quantized *once* and both
modules are built from the same codes and scales, so they still stand for one matrix; the
file stores it once, under ``embed.``. (int8 per channel even shares the storage; int4 keeps
a second copy of the codes in the CPU kernel's tiled layout.)

A model's quantization is described by its *layout*: module name -> {"scheme", "group_size"}.
Files store it beside the weights (``quantization.json``), and ``install_quantized`` builds
the modules back from a layout and plain tensors (a saved file, or GGUF blocks).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn

from lucidlm.devices import resolve_dtype
from lucidlm.errors import QuantizationError
from lucidlm.quantization.base import (DEFAULT_COMPUTE_DTYPE, QuantizedEmbedding, QuantizedLinear,
                                       check_finite_weight, check_group_size, check_group_size_value, first_quantized,
                                       scheme_label)
from lucidlm.quantization.int4 import Int4Linear
from lucidlm.quantization.int8 import Int8Linear
from lucidlm.suggest import keywords_checked

SCHEMES: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def scheme_class(scheme: str) -> type[QuantizedLinear]:
    """The QuantizedLinear class of a scheme name ("int8" -> Int8Linear, "int4" -> Int4Linear);
    QuantizationError for any other name."""
    if scheme not in SCHEMES:
        raise QuantizationError(
            f"unknown quantization scheme {scheme!r}; lucidlm knows {', '.join(sorted(SCHEMES))} "
            f"(e.g. quantize='int4', group_size=32)."
        )
    return SCHEMES[scheme]


def is_quantized(model: nn.Module) -> bool:
    """Whether any module of ``model`` is quantized (a QuantizedLinear or QuantizedEmbedding)."""
    return first_quantized(model) is not None


def quantization_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Module name -> {"scheme", "group_size"} for every quantized module."""
    return {name: m.describe() for name, m in model.named_modules()
            if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}


def _tied(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_embeddings", False))


@keywords_checked(QuantizationError)
def quantize(model: nn.Module, scheme: str, group_size: Optional[int] = None, *,
             embeddings: bool = True, compute_dtype: str | torch.dtype = DEFAULT_COMPUTE_DTYPE) -> nn.Module:
    """Quantize ``model`` in place (and return it): every ``nn.Linear`` becomes a
    ``QuantizedLinear`` of ``scheme`` ("int8": per output channel unless ``group_size``;
    "int4": groups of ``group_size``, default 32), and with ``embeddings`` the token
    embedding too; ``embeddings=False`` keeps both the token embedding and the unembedding
    float (a tied pair stays one float matrix). The matmuls run in ``compute_dtype``; the
    residual stream keeps the model's dtype."""
    compute_dtype = resolve_dtype(compute_dtype)  # "bfloat16" as load() takes it; a str failed in torch.finfo
    if not isinstance(model, nn.Module):
        raise QuantizationError(f"quantize() takes a model (torch.nn.Module), got {type(model).__name__}; "
                                f"e.g. quantize(lucidlm.load(...), 'int8').")
    cls = scheme_class(scheme)
    if compute_dtype not in cls.compute_dtypes:  # else every forward failed inside torch's kernel
        names = ", ".join(str(d).removeprefix("torch.") for d in cls.compute_dtypes)
        raise QuantizationError(f"compute_dtype={str(compute_dtype).removeprefix('torch.')}: {scheme}'s kernels do "
                                f"not run in it; use one of {names} (the default, bfloat16, is the fastest on a CPU).")
    group_size = check_group_size_value(group_size)  # once, by its own name, before each layer's width
    done = first_quantized(model)
    if done is not None:  # its layers would be skipped (they are no nn.Linear): say so, not keep the old scheme
        raise QuantizationError(f"this model already holds quantized weights ({scheme_label(done)}); "
                                f"quantize() takes a float model: load it again without quantize= (or with "
                                f"quantize={scheme!r}).")
    adapted = [name for name, m in model.named_modules() if getattr(m, "peft_method", None)]
    if adapted:  # its layers are no plain nn.Linear: they would stay float, and their adapter untrainable
        raise QuantizationError(f"the model carries a fine-tuning method ({adapted[0]} is a "
                                f"{type(dict(model.named_modules())[adapted[0]]).__name__}); quantize() takes a plain "
                                f"model: merge a LoRA into the weights first (merge_and_unload(model)), or save the "
                                f"adapter (save_adapter) and quantize a fresh base.")
    group_size = cls.default_group_size if group_size is None else group_size
    linears = {name: m for name, m in model.named_modules()
               if type(m) is nn.Linear and (embeddings or name != "unembed")}
    embed = getattr(model, "embed", None)
    tie = _tied(model) and isinstance(embed, nn.Embedding)
    for name, linear in linears.items():  # validate everything before changing anything
        check_group_size(name, linear.in_features, group_size, cls)
        check_finite_weight(name, linear.weight, compute_dtype)
    if embeddings and isinstance(embed, nn.Embedding):
        check_group_size("embed", embed.embedding_dim, group_size, cls)
        check_finite_weight("embed", embed.weight, compute_dtype)

    with torch.no_grad():
        if embeddings and isinstance(embed, nn.Embedding):
            plain = cls.quantize_weight(embed.weight.detach().float(), group_size, compute_dtype)
            set_module(model, "embed", QuantizedEmbedding(cls, plain, embed.embedding_dim, group_size, embed.weight.dtype))
            if tie and "unembed" in linears:
                bias = linears.pop("unembed").bias
                set_module(model, "unembed", cls.from_plain(plain, embed.embedding_dim, group_size, bias, compute_dtype))
        for name, linear in linears.items():
            set_module(model, name, cls.from_float(linear, group_size, name, compute_dtype))
    return model.eval()


def install_quantized(model: nn.Module, layout: Mapping[str, Mapping[str, Any]],
                      tensors: Mapping[str, torch.Tensor], source: str,
                      compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> dict[str, torch.Tensor]:
    """Replace the modules ``layout`` names with quantized ones built from ``tensors``
    (plain layout, ``<module>.<plain name>``). Returns the tensors it did not use (the
    float ones, for the caller to load). A tied unembedding with no tensors of its own is
    built from the embedding's."""
    from lucidlm.errors import MissingTensorError

    used: set[str] = set()
    modules = dict(model.named_modules())
    plain_of: dict[str, dict[str, torch.Tensor]] = {}
    for name, spec in layout.items():
        cls = scheme_class(str(spec.get("scheme")))
        group_size = spec.get("group_size")
        old = modules.get(name)
        if not isinstance(old, (nn.Linear, nn.Embedding, QuantizedLinear, QuantizedEmbedding)):
            raise QuantizationError(f"{source}: quantized tensor for {name!r}, which is not a linear layer or "
                                    f"embedding of this model; the file is for a different architecture.")
        keys = {p: f"{name}.{p}" for p in cls.plain_names}
        if name == "unembed" and _tied(model) and not all(k in tensors for k in keys.values()):
            continue  # built from the embedding below
        missing = [k for k in keys.values() if k not in tensors]
        if missing:
            raise MissingTensorError(f"{source}: tensor {missing[0]!r} is missing; the file is incomplete.")
        plain = {p: tensors[k] for p, k in keys.items()}
        used.update(keys.values())
        plain_of[name] = plain
        if isinstance(old, (nn.Embedding, QuantizedEmbedding)):
            width = old.embedding_dim
            check_group_size(name, width, group_size, cls)
            set_module(model, name, QuantizedEmbedding(cls, plain, width, group_size, torch.float32))
        else:
            bias = tensors.get(f"{name}.bias")
            if bias is not None:
                used.add(f"{name}.bias")
            check_group_size(name, old.in_features, group_size, cls)
            set_module(model, name, cls.from_plain(plain, old.in_features, group_size, bias, compute_dtype))
    if "unembed" in layout and "unembed" not in plain_of:
        spec, plain = layout["unembed"], plain_of.get("embed")
        if plain is None or layout.get("embed") != spec:
            raise QuantizationError(f"{source}: the tied unembedding has no tensors and no matching quantized "
                                    f"embedding to share; the file is incomplete.")
        old = modules["unembed"]
        bias = tensors.get("unembed.bias")
        used.add("unembed.bias")
        set_module(model, "unembed", scheme_class(spec["scheme"]).from_plain(plain, old.in_features, spec["group_size"],
                                                                      bias, compute_dtype))
    return {k: v for k, v in tensors.items() if k not in used}


def dequantize(model: nn.Module, dtype: str | torch.dtype = torch.float32) -> nn.Module:
    """The inverse swap (in place; returns ``model``): every quantized module becomes a float
    ``nn.Linear`` / ``nn.Embedding`` in ``dtype`` holding the matrix its codes stand for, and a
    tied pair one shared matrix again. The float model computes what the quantized one does, up
    to the rounding of its kernels' ``compute_dtype``."""
    dtype = resolve_dtype(dtype)  # "float32" as load() takes it; .to("float32") read it as a device name
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if isinstance(module, QuantizedEmbedding):
                table = module.dequantize(dtype)
                embedding = nn.Embedding(*table.shape, device=table.device, dtype=dtype)
                embedding.weight.copy_(table)
                set_module(model, name, embedding)
            elif isinstance(module, QuantizedLinear):
                weight = module.dequantize(dtype)
                linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                   device=weight.device, dtype=dtype)
                linear.weight.copy_(weight)
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
                set_module(model, name, linear)
    embed, unembed = getattr(model, "embed", None), getattr(model, "unembed", None)
    if _tied(model) and isinstance(embed, nn.Embedding) and isinstance(unembed, nn.Linear):
        unembed.weight = embed.weight  # both stood for one set of codes: one matrix again
    return model


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
