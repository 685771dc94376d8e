"""The checks ``Transformer.forward`` runs at the door, before the unchecked ``step``.

They read the ids (and cache slots) back to the host once, here at the API boundary, so
that nothing inside the forward pass has to: generation validates its ids on the Python
side and calls ``step`` directly, which keeps every decode step free of host syncs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lucidlm.errors import InputError, SequenceTooLongError, TokenIdError


def check_ids(ids: torch.Tensor | Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Token ids as a (B, T) long tensor on ``device``, every id in 0..vocab_size-1."""
    if not isinstance(ids, torch.Tensor):
        if not isinstance(ids, (list, tuple)):
            raise InputError(f"token ids must be a tensor or a list of ints, got {type(ids).__name__}.")
        try:  # no dtype: a list of floats must stay float and be refused below, not truncated
            ids = torch.tensor(ids, device=device)
        except (TypeError, ValueError, RuntimeError):  # strings, ragged rows, None inside
            raise InputError(f"token ids must be a list of ints (or of equal-length lists of ints), got "
                             f"{str(ids)[:60]}.") from None
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise InputError(f"expected token ids of shape (batch, seq_len) with seq_len >= 1, got {tuple(ids.shape)}.")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise InputError(f"token ids must be an integer tensor, got dtype {ids.dtype}.")
    low, high = ids.aminmax()
    low, high = int(low), int(high)  # the one read-back, at the boundary
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise TokenIdError(
            f"token id {bad} is out of range: this model's vocabulary has ids 0..{vocab_size - 1} "
            f"(vocab_size={vocab_size}). Encode text with the model's own tokenizer."
        )
    return ids.long()


def check_slots(input_pos: torch.Tensor, length: int, device: torch.device, limit: int,
                max_seq_len: int) -> torch.Tensor:
    """KV-cache slots as a (length,) long tensor, each in 0..limit-1."""
    try:
        input_pos = torch.as_tensor(input_pos, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(f"input_pos must be {length} integer cache slots (one per token), got "
                         f"{type(input_pos).__name__} {input_pos!r:.40}.") from None
    if input_pos.shape != (length,) or input_pos.is_floating_point():
        raise InputError(f"input_pos must be {length} integer cache slots (one per token), got "
                         f"{tuple(input_pos.shape)} {input_pos.dtype}.")
    low, high = input_pos.aminmax()
    if int(low) < 0:
        raise InputError(f"input_pos has slot {int(low)}; cache slots count from 0.")
    check_length(int(high) + 1, limit, max_seq_len)
    return input_pos.long()


def check_positions(position_ids: torch.Tensor | Sequence[Sequence[int]], batch: int, length: int,
                    max_seq_len: int, device: torch.device) -> torch.Tensor:
    """Caller-given positions as a (batch, length) long tensor, each in 0..max_seq_len-1: the
    rotary, sinusoidal and learned tables have one row per position up to the context window,
    and a negative index would silently read a row from the table's end. A (length,) or
    (1, length) tensor is shared by every row."""
    try:
        position_ids = torch.as_tensor(position_ids, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(f"position_ids must be integer positions of shape ({batch}, {length}), got "
                         f"{type(position_ids).__name__} {position_ids!r:.40}.") from None
    if position_ids.ndim == 1:
        position_ids = position_ids[None]
    if position_ids.ndim != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise InputError(f"position_ids has shape {tuple(position_ids.shape)}, expected ({batch}, {length}): "
                         f"one position per token.")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise InputError(f"position_ids must be an integer tensor, got dtype {position_ids.dtype}.")
    low, high = position_ids.aminmax()
    low, high = int(low), int(high)  # one read-back, at the boundary, as for the ids
    if low < 0 or high >= max_seq_len:
        raise InputError(f"position_ids holds position {low if low < 0 else high}, but this model's positions "
                         f"run 0..{max_seq_len - 1} (max_seq_len={max_seq_len}); count positions from 0.")
    return position_ids.long().expand(batch, length)


def check_length(length: int, limit: int, max_seq_len: int) -> None:
    """``length`` tokens fit ``limit`` (the context window ``max_seq_len``, or a shorter cache)."""
    if length > limit:
        raise SequenceTooLongError(
            f"sequence of {length} tokens is longer than the context window of {limit} tokens "
            f"(max_seq_len={max_seq_len}); shorten the prompt or max_new_tokens."
        )
