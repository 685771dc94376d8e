"""Positional information: rotary (two layouts), sinusoidal and learned embeddings.

RoPE rotates pairs of query/key dimensions by an angle proportional to the position.
Which dimensions form a pair is a layout choice, and checkpoints disagree:

- ``half`` pairs dimension i with i + d/2 (the ``rotate_half`` form of seed 000 and of
  Hugging Face checkpoints);
- ``interleaved`` pairs dimension 2i with 2i+1 (Meta's original complex-number form, seed
  001, and what llama.cpp's GGUF converter produces by permuting Q/K rows).

The two are the same function up to a fixed permutation of each head's Q/K rows:
``permute_qk_to_interleaved`` / ``permute_qk_to_half`` convert weights between them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from lucidlm.devices import as_dtype
from lucidlm.errors import ConfigError
from lucidlm.model.rope_scaling import rope_frequency_divisors


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict[str, Any]] = None) -> torch.Tensor:
    """(head_dim/2,) angle per position step for each rotated pair: theta^(-2i/d), divided by
    the pair's factor when the model scales its RoPE (``rope_scaling.py``)."""
    unscaled = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return unscaled / rope_frequency_divisors(unscaled, scaling)


def rope_angles(max_seq_len: int, head_dim: int, theta: float,
                scaling: Optional[dict[str, Any]] = None) -> torch.Tensor:
    """(max_seq_len, head_dim/2) angle m * theta_i, computed in float64 for accuracy."""
    positions = torch.arange(max_seq_len, dtype=torch.float64)
    return torch.outer(positions, rope_inverse_frequencies(head_dim, theta, scaling))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, theta: float, variant: str,
                 scaling: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        self.variant = variant
        self.head_dim, self.max_seq_len, self.theta, self.scaling = head_dim, max_seq_len, theta, scaling
        # Non-persistent: derived from the config, so never stored in checkpoints.
        # float64 tables: rounding them to the activations' dtype happens after the lookup.
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2, dtype=torch.float64), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2, dtype=torch.float64), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        if self.cos.is_meta:
            return
        angles = rope_angles(self.max_seq_len, self.head_dim, self.theta, self.scaling)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not round the rotation table: keep it in float64. A
        # dtype change has already rounded it (turning it back to float64 would keep bfloat16's
        # 3 digits), so it is computed again where it now lives; a move alone keeps it as it is.
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float64:
            self.cos, self.sin = self.cos.double(), self.sin.double()
            self.reset_buffers()
        return self

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation for positions (B, T), laid out for ``apply_rope``: cos and sin, each
        (B, T, 1, hd). Each pair's two dimensions get the pair's cos; the first of the two gets
        -sin and the second +sin. Looked up once per forward pass and shared by every layer."""
        compute_dtype = torch.promote_types(dtype, torch.float32)  # bf16/fp16 rotate in fp32
        cos = self.cos[position_ids].unsqueeze(2)  # (B, T, 1, hd/2) float64
        sin = self.sin[position_ids].unsqueeze(2)
        if self.variant == "half":  # pair i is (i, i + hd/2)
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
        else:  # pair i is (2i, 2i + 1)
            cos, sin = cos.repeat_interleave(2, dim=-1), torch.stack([-sin, sin], dim=-1).flatten(-2)
        return cos.to(compute_dtype), sin.to(compute_dtype)  # (B, T, 1, hd) each

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: (B, T, n_heads, head_dim); position_ids: (B, T). Returns x rotated, same shape."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(position_ids, x.dtype)
        return apply_rope(x, cos, sin, self.variant)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, variant: str) -> torch.Tensor:
    """Rotate x (B, T, n_heads, head_dim) by a rotation looked up with ``RotaryEmbedding.cos_sin``
    (each (B, T, 1, hd)); ``variant`` says which dimensions pair up (module docstring).

    Each pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin): x * cos plus x's pair
    partners times the signed sin. Four ops a call instead of a split, six products and sums
    and a join: a decode step rotates q and k in every layer, and in eager mode each op's
    dispatch costs more than its arithmetic. The sums are the same floats as the split form."""
    xf = as_dtype(x, cos.dtype)
    if variant == "half":
        partners = xf.roll(xf.shape[-1] // 2, dims=-1)  # (x2, x1): the halves swapped
    else:
        partners = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x2, x1) within each pair
    return as_dtype(xf * cos + partners * sin, x.dtype)


def apply_rope_complex(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Seed 001's formulation: view pairs (2i, 2i+1) as complex numbers and multiply by
    e^{i m theta_i}. Equal to the ``interleaved`` variant; kept as a readable cross-check."""
    head_dim = x.shape[-1]
    freqs = position_ids.double()[..., None] * rope_inverse_frequencies(head_dim, theta)  # (B, T, hd/2)
    rotation = torch.polar(torch.ones_like(freqs), freqs).unsqueeze(2)  # (B, T, 1, hd/2)
    as_complex = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(as_complex * rotation).flatten(-2).to(x.dtype)


def permute_qk_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from the ``half`` layout to ``interleaved``.

    weight: (n_heads * head_dim, d_in) (or a bias of (n_heads * head_dim,)). Row i of a
    head's first half and row i of its second half become rows 2i and 2i+1. This is the
    permutation llama.cpp applies when it converts Hugging Face LLaMA weights to GGUF.
    """
    head_dim = weight.shape[0] // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(weight.shape)


def permute_qk_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``permute_qk_to_interleaved``: rows 2i, 2i+1 become i and i + head_dim/2."""
    head_dim = weight.shape[0] // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def sinusoidal_table(max_seq_len: int, d_model: int) -> torch.Tensor:
    """(max_seq_len, d_model) float64 table of "Attention is All You Need": sin on even
    dimensions, cos on odd ones, wavelengths growing geometrically up to 10000 * 2pi (seed 004).
    Dimensions pair up (2i, 2i+1), so d_model must be even. Computed in float64; the caller
    rounds it to its own dtype."""
    if d_model % 2:
        raise ConfigError(f"d_model={d_model} is odd; sinusoidal positions fill dimensions in (sin, cos) "
                          f"pairs, so give an even d_model.")
    positions = torch.arange(max_seq_len, dtype=torch.float64)[:, None]
    frequencies = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_seq_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(positions * frequencies)
    table[:, 1::2] = torch.cos(positions * frequencies)
    return table


class SinusoidalPositions(nn.Module):
    def __init__(self, max_seq_len: int, d_model: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.empty(max_seq_len, d_model), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The table in the buffer's dtype (a float64 model keeps it exact)."""
        if not self.table.is_meta:
            self.table.copy_(sinusoidal_table(*self.table.shape))

    def _apply(self, fn, recurse=True):
        # model.double() would widen the float32-rounded table: compute it again in the new dtype.
        before = self.table.dtype
        super()._apply(fn, recurse)
        if self.table.dtype != before:
            self.reset_buffers()
        return self

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.table[position_ids]  # (B, T, d)


class LearnedPositions(nn.Embedding):
    """GPT-2's learned absolute position embedding: one trained vector per position."""

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d)
        return super().forward(position_ids)


def position_embedding(kind: str, max_seq_len: int, d_model: int) -> Optional[nn.Module]:
    """The module that adds ``kind``'s positions to the token embeddings, (B, T) ids -> (B, T, d),
    or None where positions act inside attention (``rope``) or nowhere (``none``). A module with
    a table derived from the config, not trained, keeps it in a non-persistent buffer and has
    ``reset_buffers()`` (``Transformer.materialize`` calls it once storage exists)."""
    if kind == "learned":
        return LearnedPositions(max_seq_len, d_model)
    if kind == "sinusoidal":
        return SinusoidalPositions(max_seq_len, d_model)
    return None
