"""Which keys each query may see, and each token's position, from static shapes only.

With a KV cache, attention always runs over the whole preallocated cache (S slots) and a
mask built from the query slots (``input_pos``) hides what is not written yet, as gpt-fast
does: every decode step has the same shapes, so it can be compiled once and replayed as a
CUDA graph, and nothing has to be read back from the device to know how far the cache is
filled. Everything here is tensor arithmetic; no value leaves the device.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def fit_key_mask(attention_mask: Optional[torch.Tensor], key_len: int) -> Optional[torch.Tensor]:
    """The caller's padding mask (B, S') as (B, key_len) bool: cut, or extended with True
    (slots past what the caller described are tokens still to be written, which are real)."""
    if attention_mask is None:
        return None
    keys_real = attention_mask[:, :key_len].bool()
    missing = key_len - keys_real.shape[1]  # a shape, known without reading the tensor
    return F.pad(keys_real, (0, missing), value=True) if missing > 0 else keys_real


def positions_of(query_slots: torch.Tensor, keys_real: Optional[torch.Tensor], batch: int) -> torch.Tensor:
    """(B, T) positions of the queries at ``query_slots`` (T,): the slot itself, or, with
    padding, the number of real tokens before it (so a left-padded row starts at 0)."""
    if keys_real is None:
        return query_slots[None, :].expand(batch, -1)
    counted = (keys_real.long().cumsum(-1) - 1).clamp(min=0)  # (B, S)
    return counted.index_select(1, query_slots)


def attention_mask_for(query_slots: torch.Tensor, key_len: int, keys_real: Optional[torch.Tensor],
                       ) -> torch.Tensor:
    """(B or 1, 1, T, S) bool, True where the query at ``query_slots[t]`` may see key slot s:
    s <= its own slot (causal; later slots are unwritten or in the future) and s not padding."""
    key_slots = torch.arange(key_len, device=query_slots.device)
    causal = key_slots[None, :] <= query_slots[:, None]  # (T, S)
    if keys_real is None:
        return causal[None, None]
    # A padding query would see no key at all (NaN softmax); let it see itself. Its output
    # is never used, and real tokens never see padding keys.
    own_slot = key_slots[None, :] == query_slots[:, None]  # (T, S)
    return ((causal[None] & keys_real[:, None, :]) | own_slot[None]).unsqueeze(1)


def sliding_window_mask(mask: Optional[torch.Tensor], query_slots: torch.Tensor, key_len: int,
                        window: int) -> Optional[torch.Tensor]:
    """``mask`` (B, 1, T, S) or None (plain causal), narrowed so that the query in slot i sees
    only keys in slots i - window + 1 .. i. Slots differ by the same amount as positions, so
    left padding does not move the window. Unchanged when no key is that far back (S <= window)."""
    if key_len <= window:  # shapes only: decided without reading the slots
        return mask
    key_slots = torch.arange(key_len, device=query_slots.device)
    distance = query_slots[:, None] - key_slots[None, :]  # (T, S)
    in_window = (distance >= 0) & (distance < window)  # causal too
    return in_window[None, None] if mask is None else mask & in_window
