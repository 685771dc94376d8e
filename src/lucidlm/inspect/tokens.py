"""Text <-> tokens the way TransformerLens's ``to_tokens`` / ``to_str_tokens`` / ``to_string`` do it.

    to_tokens(model, "The cat")                          # (1, T)
    to_tokens(model, ["The cat", "A"], prepend_bos=True) # (2, T_max), right-padded
    to_str_tokens(model, "The cat")                      # ['The', ' cat']
    to_string(model, ids)                                # text (or a list of texts for a batch)

``prepend_bos``: None keeps the tokenizer's own habit (SmolLM2's adds nothing, Gemma's adds
BOS); True makes sure the first token is BOS (GPT-2's BOS is ``<|endoftext|>``); False makes
sure it is not. A list of texts is padded to its longest member with the pad token
(falling back to EOS, then BOS, as TransformerLens does), on the right unless
``padding_side="left"``; ``return_attention_mask=True`` also returns the (B, T) mask of real
tokens, which the forward pass takes as ``attention_mask``.
"""

from __future__ import annotations

import numbers

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from lucidlm.errors import InputError, TokenizerError
from lucidlm.suggest import keywords_checked
from lucidlm.tokenizers.base import starts_with_added_bos

Text = Union[str, Sequence[str]]
# Token ids as the forward pass takes them: a list (T,), a list of lists (B, T), an integer tensor.
Ids = Union[Sequence[int], Sequence[Sequence[int]], torch.Tensor]
TextOrIds = Union[Text, Ids]
# What to_string, to_str_tokens and the one-sequence views read besides: one id, a numpy array.
LooseIds = Union[int, Ids, np.ndarray]
TextOrLooseIds = Union[Text, LooseIds]


def model_tokenizer(model: nn.Module) -> Any:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise TokenizerError(
            "this model has no tokenizer (model.tokenizer is None), so it cannot turn text into tokens; "
            "pass token ids instead, or load a model that comes with one (lucidlm.load(...))."
        )
    return tokenizer


def bos_id(tokenizer: Any) -> int:
    """The id put first by prepend_bos: BOS, or EOS for tokenizers like GPT-2's whose BOS is EOS."""
    for token_id in (tokenizer.bos_id, tokenizer.eos_id):
        if token_id is not None:
            return int(token_id)
    raise TokenizerError("prepend_bos=True, but this tokenizer has neither a BOS nor an EOS token; "
                         "pass prepend_bos=False (or None), or add the ids yourself.")


def pad_id(tokenizer: Any) -> int:
    for token_id in (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id):
        if token_id is not None:
            return int(token_id)
    return 0  # no special tokens at all (a char tokenizer): the mask says which ids are real


def encode(model: nn.Module, text: str, prepend_bos: Optional[bool] = None) -> list[int]:
    tokenizer = model_tokenizer(model)
    if not isinstance(text, str):
        raise InputError(f"expected text (a str or a list of str), got {type(text).__name__}.")
    ids = list(tokenizer.encode(text))
    added = starts_with_added_bos(tokenizer, ids)
    if prepend_bos and not added:
        ids = [bos_id(tokenizer), *ids]
    elif prepend_bos is False and added:
        ids = ids[1:]
    if not ids:
        raise InputError(f"the text {text!r} tokenizes to no tokens; give at least one character of text.")
    return ids


@keywords_checked(InputError)
def to_tokens(model: nn.Module, text: Text, prepend_bos: Optional[bool] = None, padding_side: str = "right",
              return_attention_mask: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Text -> ids (1, T); a list of texts -> (B, T_max) padded. On the model's device.
    ``return_attention_mask=True``: (ids, mask), the mask 1 on real tokens, 0 on padding."""
    if padding_side not in ("left", "right"):
        raise InputError(f"padding_side={padding_side!r}: expected 'right' or 'left'.")
    if not (prepend_bos is None or isinstance(prepend_bos, bool)):  # 1 == True, but "yes" is not a choice
        raise InputError(f"prepend_bos={prepend_bos!r}: expected True, False or None (the tokenizer's habit).")
    texts = [text] if isinstance(text, str) else list(text) if isinstance(text, (list, tuple)) else None
    if texts is None or not all(isinstance(t, str) for t in texts):
        raise InputError(f"to_tokens takes a text or a list of texts, got {_shown(text)}.")
    if not texts:
        raise InputError("to_tokens got an empty list of texts; give at least one.")
    rows = [encode(model, t, prepend_bos) for t in texts]
    width = max(len(r) for r in rows)
    pad = pad_id(model_tokenizer(model))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if padding_side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    device = model.device  # a quantized embedding has no float weight
    ids, mask = ids.to(device), mask.to(device)
    return (ids, mask) if return_attention_mask else ids


@keywords_checked(InputError)
def to_str_tokens(model: nn.Module, text_or_ids: TextOrLooseIds,
                  prepend_bos: Optional[bool] = None) -> Union[list[str], list[list[str]]]:
    """Each token as the text it stands for: a list of str, or a list of lists for a batch
    (a list of texts, or a (B, T) tensor with B > 1)."""
    tokenizer = model_tokenizer(model)
    if isinstance(text_or_ids, str):
        ids: Any = encode(model, text_or_ids, prepend_bos)
    elif isinstance(text_or_ids, (list, tuple)) and text_or_ids and isinstance(text_or_ids[0], str):
        return [to_str_tokens(model, t, prepend_bos) for t in text_or_ids]
    else:
        ids = _id_rows(text_or_ids, "to_str_tokens")
    if ids and isinstance(ids[0], list):
        if len(ids) > 1:
            return [[tokenizer.id_to_token(i) for i in row] for row in ids]
        ids = ids[0]
    return [tokenizer.id_to_token(i) for i in ids]


@keywords_checked(InputError)
def to_string(model: nn.Module, ids: LooseIds) -> Union[str, list[str]]:
    """Ids -> text: one str for (T,) or a single id list, a list of str for (B, T)."""
    tokenizer = model_tokenizer(model)
    if isinstance(ids, torch.Tensor) and ids.ndim > 2:
        raise InputError(f"to_string takes ids of shape (T,) or (B, T), got {tuple(ids.shape)}.")
    ids = _id_rows(ids, "to_string")
    if ids and isinstance(ids[0], list):
        return [tokenizer.decode(row) for row in ids]
    return tokenizer.decode(ids)


def id_batch(model: nn.Module, text_or_ids: Any, caller: str) -> torch.Tensor:
    """Text, a list of texts, ids (T,) / (B, T) or lists of ids, as a (B, T) long tensor;
    anything else is refused naming ``caller``, never a torch conversion error."""
    if isinstance(text_or_ids, str) or (isinstance(text_or_ids, (list, tuple)) and text_or_ids
                                        and all(isinstance(t, str) for t in text_or_ids)):
        return to_tokens(model, text_or_ids)
    rows = _id_rows(text_or_ids, caller)
    rows = rows if rows and isinstance(rows[0], list) else [rows]
    if not rows[0] or len({len(r) for r in rows}) != 1:
        raise InputError(f"{caller} takes at least one token id per row, rows of equal length; got {_shown(rows)}.")
    return torch.tensor(rows, dtype=torch.long)


def one_sequence(ids: Any) -> Any:
    """The lens and the attention view read one sequence: of a list of texts, the first (as of a
    (B, T) batch of ids, row 0). Taken alone, so no padding of the others lengthens it."""
    if isinstance(ids, (list, tuple)) and ids and all(isinstance(t, str) for t in ids):
        return ids[0]
    return ids


def check_cache_fits(cache_positions: int, n_tokens: int, caller: str) -> None:
    """A cache handed in must be of the sequence shown, whose tokens label its columns. The
    cache keeps no attention mask, so a padded row cannot be cut back to its text: refused
    (row 0 of a batch cache is read when it is the batch's longest, unpadded)."""
    if cache_positions == n_tokens + 1:  # run_with_cache(model, text, prepend_bos=True)
        raise InputError(
            f"{caller}: the cache holds {cache_positions} positions, one more than the text's {n_tokens} token(s): "
            f"it was made with a BOS prepended. Pass the same tokens, to_tokens(model, text, prepend_bos=True), "
            f"instead of the text, or leave cache out.")
    if cache_positions != n_tokens:
        raise InputError(
            f"{caller}: the cache holds {cache_positions} positions, but the text has {n_tokens} token(s), so the "
            f"columns would sit under the wrong tokens (a padded batch's cache, or another text's). Pass the cache "
            f"of this text alone (_, cache = run_with_cache(model, text)), or leave cache out.")


def _id_rows(ids: Any, caller: str) -> Any:
    """Token ids as a list of ints, or a list of lists of ints for a batch; anything else
    (None, floats, strings, a float tensor) is refused naming ``caller``. Numpy arrays and
    lists of (T,) tensors or arrays are ids too, as TransformerLens's to_str_tokens takes them."""
    ids = _listed(ids, caller)
    if _is_id(ids):  # one id: a 0-d tensor (logits.argmax()), an int or a numpy integer
        return [int(ids)]
    if isinstance(ids, (list, tuple)):
        if all(_is_id(i) for i in ids):
            return [int(i) for i in ids]
        rows = [_listed(row, caller) for row in ids]
        if all(isinstance(row, (list, tuple)) and all(_is_id(i) for i in row) for row in rows):
            return [[int(i) for i in row] for row in rows]
    raise InputError(f"{caller} takes token ids (a list of ints, a list of lists, or an integer tensor), got "
                     f"{_shown(ids)}.")


def _listed(ids: Any, caller: str) -> Any:
    """A tensor or numpy array of integers as (nested) Python lists; anything else as it is."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InputError(f"{caller} takes integer token ids, got a tensor of dtype {ids.dtype}.")
        return ids.tolist()
    if isinstance(ids, np.ndarray):
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"{caller} takes integer token ids, got a numpy array of dtype {ids.dtype}.")
        return ids.tolist()
    return ids


def _is_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
