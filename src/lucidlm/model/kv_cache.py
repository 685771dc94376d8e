"""A static, preallocated key/value cache (gpt-fast style).

Generation fills it once with the prompt (prefill), then writes one position per decoded
token. ``update(input_pos, k, v)`` writes at explicit slots and returns the whole cache, so
shapes never change, nothing is reallocated and nothing is read back while decoding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lucidlm.devices import as_dtype


class KVCache(nn.Module):
    """``reserve_rows``: room for that many rows in all (a batch under way that takes new
    prompts, ``add_rows``): ``k`` and ``v`` are then views of the first ``batch_size`` rows of
    larger buffers, allocated unwritten (so not in memory until used) and zeroed a row at a
    time as rows are added."""

    def __init__(self, batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None, reserve_rows: int = 0) -> None:
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self._reserved: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (R, n_kv, S, hd) each, R >= B
        if reserve_rows > batch_size:
            self._reserved = tuple(torch.empty((reserve_rows, *shape[1:]), dtype=dtype, device=device)
                                   for _ in range(2))
            for buffer in self._reserved:
                buffer[:batch_size].zero_()
            k, v = (buffer[:batch_size] for buffer in self._reserved)
        else:
            k, v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: Optional[int] = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, hd) at slots ``input_pos`` (T,); return the whole cache,
        (B, n_kv, max_seq_len, hd), or its first ``length`` slots. Slots not written yet hold
        stale values: the caller's mask hides them (``masks.attention_mask_for``). Same shapes
        every step, no read-back. Fewer rows than the cache holds fill its first rows (beam
        search runs its one prompt once, then copies the rows: ``reorder``)."""
        cache_k, cache_v = self.k, self.v
        if k.shape[0] < self.batch_size:
            cache_k, cache_v = cache_k[:k.shape[0]], cache_v[:k.shape[0]]  # views: written in place
        cache_k.index_copy_(2, input_pos, as_dtype(k, cache_k.dtype))
        cache_v.index_copy_(2, input_pos, as_dtype(v, cache_v.dtype))
        if length is not None and length < self.max_seq_len:
            return cache_k[:, :, :length], cache_v[:, :, :length]  # (B, n_kv, length, hd)
        return cache_k, cache_v

    def place(self, row: int, length: int, start: int) -> None:
        """Move the first ``length`` slots of row 0 to slots ``start``.. of row ``row`` (a prompt
        run alone, put where its left-padded row of a batch keeps it)."""
        for cache in (self.k, self.v):
            cache[row, :, start:start + length] = cache[0, :, :length].clone()  # the ranges may overlap

    def add_rows(self, count: int, written: int) -> None:
        """``count`` more rows at the end (a batch under way taking new prompts), zeroed: within
        the reserve, the views grow over it; past it, new buffers, the old rows' first
        ``written`` slots copied over (the rest are unwritten, masked)."""
        rows = self.batch_size
        for i, name in enumerate(("k", "v")):
            old = getattr(self, name)
            if self._reserved is not None and rows + count <= self._reserved[i].shape[0]:
                grown = self._reserved[i][:rows + count]
                grown[rows:].zero_()  # zero, not stale: a masked slot's value still meets a 0 weight in SDPA
            else:
                grown = old.new_zeros((rows + count, *old.shape[1:]))
                grown[:rows, :, :written] = old[:, :, :written]
            setattr(self, name, grown)

    def keep_rows(self, count: int) -> None:
        """Keep the first ``count`` rows (the rows after them have ended): views, so adding
        rows later reuses the room."""
        self.k, self.v = self.k[:count], self.v[:count]

    def shift_slots(self, shift: int, end: int) -> None:
        """Move every row's slots ``shift``..``end``-1 to 0..``end - shift``-1: a batch under way
        drops slots that no row still decoding reads, so that prompts joining it find room at
        the end. The two ranges overlap, so the source is copied first."""
        for cache in (self.k, self.v):
            cache[:, :, :end - shift] = cache[:, :, shift:end].clone()

    def copy_slots(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of row ``row``'s first ``length`` slots, k and v (n_kv, length, hd) each, for
        ``write_slots`` to put back (a prompt that joins a batch under way runs in row 0 first)."""
        return self.k[row, :, :length].clone(), self.v[row, :, :length].clone()

    def write_slots(self, row: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put ``copy_slots``' copy back into the first slots of row ``row``."""
        for cache, values in zip((self.k, self.v), saved):
            cache[row, :, :values.shape[1]] = values

    def reorder(self, beam_idx: torch.Tensor, length: Optional[int] = None) -> None:
        """Keep the rows ``beam_idx`` (beam search reshuffles hypotheses every step); only the
        first ``length`` slots (those written so far; None: all) of the rows that change are
        copied. Copying the whole cache moved every row's unwritten slots and the rows that
        stay, twice (a gather, then the copy back), every step: SmolLM2, 4 beams, a 37-token
        chat prompt, 16 new tokens, about 3x the elements this copies."""
        moved = torch.nonzero(beam_idx != torch.arange(len(beam_idx), device=beam_idx.device)).view(-1)  # (m,)
        if len(moved) == 0:  # every beam went on from itself
            return
        sources = beam_idx[moved]  # (m,) read whole before any row is overwritten
        for cache in (self.k, self.v):
            written = cache[:, :, :length]  # (B, n_kv, length, hd) a view
            written.index_copy_(0, moved, written.index_select(0, sources))
