"""Putting a dict of named tensors into a model, with errors that say exactly what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch

from lucidlm.errors import MissingTensorError, ShapeMismatchError, WeightsError
from lucidlm.model.transformer import Transformer


def own_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by name, without the tied unembedding
    (it *is* the embedding; safetensors refuses to store one tensor under two names)."""
    state = dict(model.state_dict())
    if model.config.tie_embeddings:
        state.pop("unembed.weight", None)
        for name in getattr(model.unembed, "plain_names", ()):  # quantized: stored once, under embed.
            state.pop(f"unembed.{name}", None)
    return state


def float_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers outside quantized modules, by name: what a loader
    fills in by copying (quantized modules are rebuilt from their codes instead)."""
    from lucidlm.quantization import QuantizedEmbedding, QuantizedLinear

    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            continue
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            out[prefix + name] = param
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = buf
    if model.config.tie_embeddings:
        out.pop("unembed.weight", None)
    return out


def load_into(model: Transformer, tensors: Mapping[str, torch.Tensor], source: str | Path,
              strict_unexpected: bool = True) -> None:
    """Copy ``tensors`` (our names) into ``model``; every expected tensor must be there with
    the right shape. ``source`` names the file in error messages. Quantized modules are not
    touched (``quantization.install_quantized`` builds them first and hands over the rest)."""
    expected = check_shapes(model, {name: tuple(t.shape) for name, t in tensors.items()}, source, strict_unexpected)
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name].to(param.dtype))


def check_shapes(model: Transformer, shapes: Mapping[str, Sequence[int]], source: str | Path,
                 strict_unexpected: bool = True) -> dict[str, torch.Tensor]:
    """Refuse ``shapes`` (our names -> shape of what a file holds) unless they are exactly the
    tensors ``model`` expects; returns those expected tensors by name. It needs shapes only, so
    a streaming loader checks the whole file before converting anything (on a meta model)."""
    expected = float_tensors(model)
    for name, param in expected.items():
        if name not in shapes:
            raise MissingTensorError(
                f"{source}: tensor {name!r} is missing (expected shape {tuple(param.shape)}). "
                f"The file is incomplete or for a different architecture."
            )
        found = tuple(shapes[name])
        if found != tuple(param.shape):
            raise ShapeMismatchError(
                f"{source}: tensor {name!r} has shape {found}, expected {tuple(param.shape)} "
                f"for this config; the weights do not belong to this model configuration."
            )
    unexpected = sorted(set(shapes) - set(expected) - {"unembed.weight"})
    if unexpected and strict_unexpected:
        raise WeightsError(
            f"{source}: {len(unexpected)} tensor(s) the model has no place for, e.g. {unexpected[:5]}; "
            f"the weights are for a different architecture or config."
        )
    return expected
