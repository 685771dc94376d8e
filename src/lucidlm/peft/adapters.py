"""Houlsby bottleneck adapters (Houlsby et al., 2019; seed 004 section 3.2.1).

A small residual MLP is inserted after the attention output projection and after the MLP's
down projection of every block, before each joins the residual stream:

    h  ->  h + up(act(down(h)))        down: d -> bottleneck, up: bottleneck -> d

``up`` starts at zero, so the adapted model starts out equal to the base; only the adapters
(2 * (2 * d * bottleneck + bottleneck + d) numbers per block) are trained. Unlike LoRA, the
nonlinearity means an adapter cannot be merged into the weights.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.quantization.base import check_float_model
from lucidlm.suggest import keywords_checked
from lucidlm.peft.trainable import check_one_method, freeze_base

ADAPTED_OUTPUTS = ("attn.o_proj", "mlp.down_proj")
NORMS = ("ln1", "ln2", "ln_final")  # what train_norms trains (Houlsby), and what save_adapter then saves
NONLINEARITIES = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}


class BottleneckAdapter(nn.Module):
    """A Houlsby bottleneck adapter: h + up(nonlinearity(down(h))), with down (d -> bottleneck)
    and up (bottleneck -> d). ``up`` starts at zero, so a new adapter is the identity. Input and
    output (..., d)."""

    def __init__(self, d_model: int, bottleneck: int, nonlinearity: str = "gelu") -> None:
        super().__init__()
        self.down = nn.Linear(d_model, bottleneck)
        self.up = nn.Linear(bottleneck, d_model)
        self.nonlinearity = nonlinearity
        nn.init.zeros_(self.up.weight)  # identity at the start: training begins from the base model
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(NONLINEARITIES[self.nonlinearity](self.down(h)))  # (..., d)


class AdaptedLinear(nn.Linear):
    """A frozen ``nn.Linear`` whose output passes through a bottleneck adapter. The base
    ``weight``/``bias`` keep their names, so the base part of ``state_dict`` is unchanged.
    ``train_norms``: the model's norms belong to the adapter (trained with it, saved with it)."""

    peft_method = "adapter"  # trainable.attached_methods

    def __init__(self, base: nn.Linear, adapter: BottleneckAdapter, train_norms: bool = False) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.adapter = adapter
        self.train_norms = train_norms
        self.disabled = False
        self.train(base.training)  # a new layer starts in training mode; follow the model's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # (..., d)
        return out if self.disabled else self.adapter(out)

    def as_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear


def adapted_layers(model: nn.Module) -> Iterator[tuple[str, AdaptedLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, AdaptedLinear):
            yield name, module


@keywords_checked(AdapterError)
def add_adapters(model: nn.Module, bottleneck: int = 64, nonlinearity: str = "gelu",
                 train_norms: bool = False) -> list[str]:
    """Insert a bottleneck adapter after ``attn.o_proj`` and ``mlp.down_proj`` of every block
    and freeze the rest (Houlsby also trained the layer norms: ``train_norms=True``).
    Returns the adapted module names."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise AdapterError("bottleneck adapters need a lucidlm Transformer (a model with .blocks).")
    check_float_model(model, "adding bottleneck adapters")
    d_model = model.config.d_model
    if isinstance(bottleneck, bool) or not isinstance(bottleneck, int) or not 0 < bottleneck <= d_model:
        raise AdapterError(f"adapter bottleneck={bottleneck!r} must be an integer in 1..d_model={d_model}.")
    if nonlinearity not in NONLINEARITIES:
        raise AdapterError(f"unknown adapter nonlinearity {nonlinearity!r}; choose one of {', '.join(NONLINEARITIES)}.")
    if any(True for _ in adapted_layers(model)):
        raise AdapterError("the model already has bottleneck adapters; load a fresh base model to add new ones.")
    check_one_method(model, "adapter")
    freeze_base(model)
    names = []
    for i, block in enumerate(blocks):
        for path in ADAPTED_OUTPUTS:
            parent_name, child = path.split(".")
            parent = getattr(block, parent_name)
            base = getattr(parent, child)
            adapter = BottleneckAdapter(d_model, bottleneck, nonlinearity).to(base.weight.device, base.weight.dtype)
            setattr(parent, child, AdaptedLinear(base, adapter, train_norms))
            names.append(f"blocks.{i}.{path}")
    if train_norms:
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in NORMS:
                module.requires_grad_(True)
    return names


def adapter_parameter_count(d_model: int, bottleneck: int, n_layers: int) -> int:
    """Two adapters per block, each down (d*b + b) and up (b*d + d)."""
    return n_layers * 2 * (2 * d_model * bottleneck + bottleneck + d_model)


def adapters_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.adapter.{key}": value.detach()
            for name, layer in adapted_layers(model) for key, value in layer.adapter.state_dict().items()}


def load_adapters_state(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy saved adapter tensors in; every tensor must find its place with the same shape."""
    expected = adapters_state_dict(model)
    for key, found in tensors.items():
        if key not in expected:
            raise AdapterError(f"{source}: tensor {key!r} has no place in this model (it has "
                               f"{len(expected)} adapter tensors, e.g. {next(iter(expected), 'none')!r}); "
                               f"the adapter was trained on a different base model.")
        if tuple(found.shape) != tuple(expected[key].shape):
            raise AdapterError(f"{source}: tensor {key!r} has shape {tuple(found.shape)} but this model needs "
                               f"{tuple(expected[key].shape)}; the adapter was trained on a different base model.")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise AdapterError(f"{source}: adapter tensor {missing[0]!r} is missing ({len(missing)} in all); "
                           f"the file is incomplete.")
    with torch.no_grad():
        for name, layer in adapted_layers(model):
            for key, param in layer.adapter.state_dict().items():
                param.copy_(tensors[f"{name}.adapter.{key}"])


def set_adapters_disabled(model: nn.Module, disabled: bool) -> None:
    for _, layer in adapted_layers(model):
        layer.disabled = disabled


def remove_adapters(model: nn.Module) -> None:
    """Put the plain linear layers back (the base weights were never touched)."""
    for module_name, layer in list(adapted_layers(model)):
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.as_linear())
