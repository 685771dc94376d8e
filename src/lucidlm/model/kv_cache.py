"""A static, preallocated key/value cache (gpt-fast style).

Generation fills it once with the prompt (prefill), then writes one position per decoded
token. ``update(input_pos, k, v)`` writes at explicit slots, so shapes never change and
nothing is reallocated while decoding.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, hd) at slots ``input_pos`` (T,); return the filled prefix
        of the cache, (B, n_kv, end, hd) with end = last written slot + 1."""
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        if end - start == input_pos.numel():  # contiguous slots (always, in generation): a plain copy
            self.k[:, :, start:end].copy_(k)
            self.v[:, :, start:end].copy_(v)
        else:
            self.k[:, :, input_pos] = k.to(self.k.dtype)
            self.v[:, :, input_pos] = v.to(self.v.dtype)
        # Attending only to the filled prefix (not all max_seq_len slots) keeps CPU decoding
        # fast; the slice is a view, so nothing is copied.
        return self.k[:, :, :end], self.v[:, :, :end]

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Keep the rows ``beam_idx`` (beam search reshuffles hypotheses every step)."""
        self.k.copy_(self.k.index_select(0, beam_idx))
        self.v.copy_(self.v.index_select(0, beam_idx))
