"""Putting a dict of named tensors into a model, with errors that say exactly what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from lucidlm.errors import MissingTensorError, ShapeMismatchError, WeightsError
from lucidlm.model.transformer import Transformer


def own_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by name, without the tied unembedding
    (it *is* the embedding; safetensors refuses to store one tensor under two names)."""
    state = dict(model.state_dict())
    if model.config.tie_embeddings:
        state.pop("unembed.weight", None)
    return state


def load_into(model: Transformer, tensors: Mapping[str, torch.Tensor], source: str | Path,
              strict_unexpected: bool = True) -> None:
    """Copy ``tensors`` (our names) into ``model``; every expected tensor must be there with
    the right shape. ``source`` names the file in error messages."""
    expected = own_state_dict(model)
    for name, param in expected.items():
        if name not in tensors:
            raise MissingTensorError(
                f"{source}: tensor {name!r} is missing (expected shape {tuple(param.shape)}). "
                f"The file is incomplete or for a different architecture."
            )
        found = tensors[name]
        if tuple(found.shape) != tuple(param.shape):
            raise ShapeMismatchError(
                f"{source}: tensor {name!r} has shape {tuple(found.shape)}, expected {tuple(param.shape)} "
                f"for this config; the weights do not belong to this model configuration."
            )
    unexpected = sorted(set(tensors) - set(expected) - {"unembed.weight"})
    if unexpected and strict_unexpected:
        raise WeightsError(
            f"{source}: {len(unexpected)} tensor(s) the model has no place for, e.g. {unexpected[:5]}; "
            f"the weights are for a different architecture or config."
        )
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name].to(param.dtype))
