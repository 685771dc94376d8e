"""Generating past the context window by cropping (``context_overflow="crop"``, seed 003).

Seed 003 (and nanoGPT's ``generate``) keeps going when the text outgrows ``max_seq_len``:
each next token is predicted from the last ``max_seq_len`` tokens only. What that means for
the KV cache:

- until the context is full, nothing changes: the prompt is prefilled and tokens are
  decoded one by one against the cache;
- once it is full, every step drops the oldest token and the window's tokens move one
  position left. With learned or sinusoidal positions every token's input changes; with
  RoPE the scores between kept tokens would survive (they depend on distances), but each
  kept key was computed while attending to tokens that are now gone. Either way the cached
  keys and values are not those of the cropped window, so each further token recomputes the
  whole window (O(max_seq_len) per token, exactly seed 003's loop) instead of using a cache.

A prompt longer than the context is cropped the same way (its last ``max_seq_len`` tokens).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch

from lucidlm.generation.decode import sample_rows, suppress
from lucidlm.generation.sampling import sample_next


def sample_with_crop(model: Any, prompt: Sequence[int], max_new_tokens: int, settings: Any,
                     generator: Optional[torch.Generator], finished: torch.Tensor, pad_id: int = 0,
                     min_new_tokens: int = 0, eos_ids: Sequence[int] = (),
                     recorder: Any = None) -> Iterator[torch.Tensor]:
    """Like ``sample_rows`` for one row, but never stops for lack of context: yields (1,)
    next-token tensors for ``max_new_tokens`` steps or until ``finished`` is set."""
    limit = model.config.max_seq_len
    ids = list(prompt)
    window = ids[-limit:]
    cached = min(max_new_tokens, limit - len(window))  # tokens that still fit: KV-cached decoding
    for next_ids in sample_rows(model, [window], cached, settings, generator, finished, pad_id,
                                min_new_tokens, eos_ids, recorder=recorder):
        ids.append(int(next_ids[0]))
        yield next_ids
        if bool(finished.all()):
            return
    for t in range(cached, max_new_tokens):  # the context is full: crop and recompute
        with torch.inference_mode():
            context = torch.tensor([ids[-limit:]], device=model.device)  # (1, limit)
            logits = model(context, last_token_only=True)[:, -1].float()  # (1, V)
            if t < min_new_tokens:
                logits = suppress(logits, eos_ids)
            seen = torch.tensor([ids], device=model.device)  # repetition penalty sees everything
            next_ids = sample_next(logits, settings, seen, generator, recorder, prompt_len=len(prompt))
        ids.append(int(next_ids[0]))
        yield next_ids
        if bool(finished.all()):
            return
