"""Attention as a building block, outside the language model (seed 004's exercises).

``scaled_dot_product_attention(q, k, v, mask)`` is the textbook formula, returning the
weights too so they can be plotted; ``MultiHeadAttention`` takes separate query and
key/value inputs, so the same module does self-attention (``mha(x)``) and an encoder-decoder
transformer's cross-attention (``mha(decoder_x, encoder_out)``). The language model's own
``Attention`` (attention.py) adds what decoding needs: grouped heads, RoPE, a KV cache.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from lucidlm.errors import InputError


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: Optional[torch.Tensor] = None, *, scale: Optional[float] = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_k) + mask) v, and the attention weights.

    q: (..., T_q, d_k); k: (..., T_k, d_k); v: (..., T_k, d_v).
    mask: True (or 1) where a query may attend, False (or 0) where not, broadcastable to
        (..., T_q, T_k); a larger square mask (seed 004's ``tril(ones(32, 32))``) is cut to
        its top-left (T_q, T_k) corner. Any other float mask is torch's additive kind
        (``nn.Transformer.generate_square_subsequent_mask``: 0 attend, -inf not), added to the
        scores as ``F.scaled_dot_product_attention`` does: one holding anything but 0 and 1,
        and one of zeros only (that causal mask at length 1 is ``[[0.]]``, a batch without
        padding is all 0: as a keep-mask it would block every key). None: every query sees
        every key.
    Returns (output (..., T_q, d_v), weights (..., T_q, T_k)). A query that may attend to
    nothing gets all-zero weights rather than NaN.
    """
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise InputError(f"attention shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         f"q and k need the same last size, k and v the same number of positions.")
    T_q, T_k = q.shape[-2], k.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        if mask.ndim >= 2 and mask.shape[-2] >= T_q and mask.shape[-1] >= T_k:
            mask = mask[..., :T_q, :T_k]
        # (reads the mask's values: this is the seed's building block, not the model's decode path)
        if mask.is_floating_point() and not (((mask == 0) | (mask == 1)).all() and (mask == 1).any()):
            scores = scores + mask.to(scores.dtype)  # (..., T_q, T_k)
        else:
            scores = scores.masked_fill(~mask.to(torch.bool), float("-inf"))  # (..., T_q, T_k)
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # rows with every key masked
    return weights @ v, weights


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate query and key/value inputs.

    ``forward(query, key=None, value=None, mask=None)``: key defaults to query and value to
    key, so ``mha(x)`` is self-attention and ``mha(x, memory)`` cross-attention. kdim / vdim
    are the key / value inputs' widths when they differ from d_model (an encoder of another
    size). vdim defaults to kdim (values default to the keys, so ``mha(x, memory)`` takes one
    ``kdim``-wide memory); ``nn.MultiheadAttention``, whose value has no default, takes d_model
    there: pass ``vdim=`` to match it. Parameters mirror
    ``nn.MultiheadAttention``'s layout under readable names. The mask says where a query may
    attend (True), the opposite of ``nn.MultiheadAttention``'s boolean ``attn_mask`` and
    ``key_padding_mask`` (True = blocked); a float mask is added to the scores, as there.
    """

    def __init__(self, d_model: int, n_heads: int, bias: bool = True, kdim: Optional[int] = None,
                 vdim: Optional[int] = None) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise InputError(f"d_model={d_model} is not divisible by n_heads={n_heads}.")
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.d_model, self.kdim, self.vdim = d_model, kdim or d_model, vdim or kdim or d_model
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(self.kdim, d_model, bias=bias)
        self.v_proj = nn.Linear(self.vdim, d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None, return_weights: bool = False,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """query: (B, T_q, d_model); key: (B, T_k, kdim); value: (B, T_k, vdim).
        mask: True where a query may attend, (T_q, T_k) or (B, 1 or n_heads, T_q, T_k).
        Returns (B, T_q, d_model), and the weights (B, n_heads, T_q, T_k) if asked."""
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        B, T_q, _ = query.shape
        T_k = key.shape[1]
        q = self.q_proj(query).view(B, T_q, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T_q, hd)
        k = self.k_proj(key).view(B, T_k, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T_k, hd)
        v = self.v_proj(value).view(B, T_k, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T_k, hd)
        z, weights = scaled_dot_product_attention(q, k, v, mask)  # (B, nh, T_q, hd)
        out = self.o_proj(z.transpose(1, 2).reshape(B, T_q, self.n_heads * self.head_dim))
        return (out, weights) if return_weights else out

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Each input (B, T, width) with the width its projection takes, one batch size, and a
        value per key: else an InputError naming the setting, not a matmul's shape error."""
        for name, x, width, setting in (("query", query, self.d_model, "d_model"), ("key", key, self.kdim, "kdim"),
                                        ("value", value, self.vdim, "vdim")):
            if x.ndim != 3 or x.shape[-1] != width:
                hint = " (vdim defaults to kdim, else d_model; give vdim= when values have another width)" \
                    if name == "value" else ""
                raise InputError(f"{name} has shape {tuple(x.shape)}, but this module takes (batch, positions, "
                                 f"{width}) {name}s ({setting}={width}){hint}.")
        if not query.shape[0] == key.shape[0] == value.shape[0] or key.shape[1] != value.shape[1]:
            raise InputError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
                             f"must share the batch size, and key and value the number of positions.")
