"""Prefix tuning (Li & Liang, 2021; seed 004 section 3.1.1).

Every attention layer gets P extra key/value pairs that all queries can see, as if an
invisible, trained prompt came before the text. That prompt takes no positions: the text's
still count from 0 and the prefix keys are not rotated. peft's ``PrefixTuning`` numbers the
text from P instead, so its logits differ; ``position_ids`` counted from P reproduce them
(the two formats are not interchangeable anyway: a prefix has no PEFT file).

Training the keys/values directly is unstable, so (as in the paper) they are produced by a
small MLP from P trainable vectors:

    tokens (P, d) -> Linear(d, hidden) -> tanh -> Linear(hidden, n_layers * 2 * kv_dim) -> (k, v) per layer

After training, ``freeze_prefix`` evaluates the MLP once and keeps only the resulting keys
and values (n_layers * 2 * P * kv_dim numbers): the MLP was only a training aid.

The encoder is installed as the model's ``prefix_encoder``: the Transformer calls it once per
forward pass for every layer's keys/values, (n_layers, 2, n_kv, P, hd), and hands each layer
its slice; attention prepends them and widens the mask.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.quantization.base import check_float_model
from lucidlm.suggest import keywords_checked
from lucidlm.peft.trainable import check_one_method, freeze_base
from lucidlm.validation import MAX_CONTEXT, MAX_WIDTH, Fields, check_allocation


class PrefixEncoder(nn.Module):
    """The trainable prefix of prefix tuning (Li & Liang): ``length`` token vectors (P, d) passed
    through an MLP (d -> hidden -> every layer's keys and values), which the attention layers
    put before the sequence's own keys and values. Calling it returns (n_layers, 2, n_kv, P, hd)
    (None while disabled); ``freeze()`` keeps only those keys/values, for inference."""

    peft_method = "prefix"  # trainable.attached_methods

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, d_model: int, length: int,
                 hidden: int) -> None:
        super().__init__()
        self.n_layers, self.n_kv_heads, self.head_dim, self.length = n_layers, n_kv_heads, head_dim, length
        self.tokens = nn.Parameter(torch.randn(length, d_model))  # (P, d)
        self.hidden = nn.Linear(d_model, hidden)
        self.to_kv = nn.Linear(hidden, n_layers * 2 * n_kv_heads * head_dim)
        # Zero keys/values at the start: the prefix then only slightly dilutes attention,
        # instead of pouring random values into a pretrained model (as LoRA starts with B = 0).
        nn.init.zeros_(self.to_kv.weight)
        nn.init.zeros_(self.to_kv.bias)
        self.frozen = False
        self.disabled = False  # disable_adapters: the model runs as if there were no prefix

    def forward(self) -> Optional[torch.Tensor]:
        """Every layer's prefix keys/values, (n_layers, 2, n_kv, P, hd); None while disabled."""
        if self.disabled:
            return None
        if self.frozen:
            return self.kv
        h = torch.tanh(self.hidden(self.tokens))  # (P, hidden)
        kv = self.to_kv(h).view(self.length, self.n_layers, 2, self.n_kv_heads, self.head_dim)
        return kv.permute(1, 2, 3, 0, 4)  # (L, 2, n_kv, P, hd)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_kv(self, layer: int) -> torch.Tensor:
        """(2, n_kv, P, hd) for one layer. The rows of ``to_kv`` for this layer only, so the
        big projection is computed once per forward in total, not once per layer."""
        if self.frozen:
            return self.kv[layer]
        h = torch.tanh(self.hidden(self.tokens))  # (P, hidden)
        rows = slice(layer * 2 * self.kv_dim, (layer + 1) * 2 * self.kv_dim)
        kv = F.linear(h, self.to_kv.weight[rows], self.to_kv.bias[rows])  # (P, 2 * kv_dim)
        return kv.view(self.length, 2, self.n_kv_heads, self.head_dim).permute(1, 2, 0, 3)

    def freeze(self) -> None:
        """Evaluate the MLP once and keep only the keys/values, as a buffer."""
        if self.frozen:
            return
        with torch.no_grad():
            kv = torch.stack([self.layer_kv(i) for i in range(self.n_layers)])  # (L, 2, n_kv, P, hd)
        del self.tokens, self.hidden, self.to_kv
        self.register_buffer("kv", kv.contiguous())
        self.frozen = True


def prefix_encoder(model: nn.Module) -> Optional[PrefixEncoder]:
    return getattr(model, "prefix_encoder", None)


@keywords_checked(AdapterError)
def add_prefix(model: nn.Module, length: int = 16, hidden: Optional[int] = None,
               source: str = "add_prefix") -> PrefixEncoder:
    """Give every attention layer ``length`` trainable prefix keys/values (through an MLP of
    width ``hidden``, default d_model) and freeze the rest of the model. ``source`` names
    where the sizes came from in errors (an adapter file)."""
    if getattr(model, "blocks", None) is None:
        raise AdapterError("prefix tuning needs a lucidlm Transformer (a model with .blocks).")
    check_float_model(model, "prefix tuning")
    cfg = model.config
    sizes = Fields({"length": length, "hidden": hidden}, source, AdapterError, fix="give a prefix length of typically 10-30 and a positive hidden size")
    length = sizes.int("length", low=1, high=MAX_CONTEXT)
    hidden = sizes.int("hidden", default=None, low=1, high=MAX_WIDTH) or cfg.d_model
    if prefix_encoder(model) is not None:
        raise AdapterError("the model already has a prefix; load a fresh base model to add a new one.")
    check_one_method(model, "prefix")
    # tokens + MLP (what trains) or keys/values (frozen): refuse before allocating either
    count = prefix_parameter_count(cfg.d_model, cfg.n_layers, cfg.n_kv_heads * cfg.head_dim, length, hidden)
    check_allocation(count * model.embed.weight.element_size(),
                     f"{source}: a prefix of length={length} (hidden={hidden}) for {cfg.n_layers} layers",
                     AdapterError, "use a shorter prefix (typical: 10-30 tokens)")
    freeze_base(model)
    encoder = PrefixEncoder(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, length, hidden)
    encoder.train(model.training)  # a new module starts in training mode; follow the model's
    model.add_module("prefix_encoder", encoder.to(model.embed.weight.device, model.embed.weight.dtype))
    return encoder


def freeze_prefix(model: nn.Module) -> None:
    """Compute the model's prefix keys/values once and drop the MLP that made them (the prefix
    can no longer train, and inference no longer runs the MLP). AdapterError without a prefix."""
    encoder = prefix_encoder(model)
    if encoder is None:
        raise AdapterError("the model has no prefix to freeze; add one with add_prefix().")
    encoder.freeze()


def prefix_parameter_count(d_model: int, n_layers: int, kv_dim: int, length: int, hidden: int) -> int:
    """Trainable numbers while training: tokens + MLP."""
    out = n_layers * 2 * kv_dim
    return length * d_model + (d_model * hidden + hidden) + (hidden * out + out)


def set_prefix_disabled(model: nn.Module, disabled: bool) -> None:
    """Switch the prefix off (or back on); the encoder and its weights stay in place."""
    encoder = prefix_encoder(model)
    if encoder is not None:
        encoder.disabled = disabled


def remove_prefix(model: nn.Module) -> None:
    set_prefix_disabled(model, True)
    if prefix_encoder(model) is not None:
        model.prefix_encoder = None
