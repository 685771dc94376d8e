"""Decomposing the residual stream, as TransformerLens's ``ActivationCache`` does it.

These are the functions behind ``cache.accumulated_resid``, ``cache.decompose_resid``,
``cache.stack_head_results``, ``cache.apply_ln_to_stack`` and ``cache.logit_attrs``; each
returns what TransformerLens 3.9 returns on the same weights (labels included), so ported
analysis code reads the same numbers. Shapes: a "stack" is (components, [B,] [T,] d).

The one choice TransformerLens leaves to its loader: lucidlm never folds the final norm's
weight into the unembedding, so ``logit_attrs`` folds it into the token directions itself,
which is what TransformerLens computes for a model loaded with ``fold_ln=True`` (its
default). Without that, attributions would not add up to the logits.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from lucidlm.errors import HookError, InputError
from lucidlm.inspect.hook_names import as_index
from lucidlm.inspect.tokens import encode
from lucidlm.quantization.base import dense_weight

PosSlice = Union[None, int, tuple, slice, Sequence[int], torch.Tensor]
# The stacks come alone, or with one label per entry when return_labels=True.
Stack = Union[torch.Tensor, tuple[torch.Tensor, list[str]]]
# A token for logit attribution: an id, a text that is one token, or ids (a list or a tensor).
Tokens = Union[int, str, Sequence[int], torch.Tensor]


def apply_slice(tensor: torch.Tensor, pos_slice: PosSlice, dim: int) -> torch.Tensor:
    """TransformerLens's ``Slice``: None keeps all, an int picks one (dropping the dim), a
    tuple is ``slice(*t)``, a list or tensor picks those indices."""
    if pos_slice is None:
        return tensor
    index: Any
    if isinstance(pos_slice, tuple):
        index = slice(*pos_slice)
    elif isinstance(pos_slice, (int, slice)):
        index = pos_slice
    elif isinstance(pos_slice, (list, torch.Tensor)):
        index = torch.as_tensor(pos_slice, dtype=torch.long)
    else:
        raise InputError(f"pos_slice={pos_slice!r}: expected None, an int, a tuple, a slice or a list of indices.")
    slices: list[Any] = [slice(None)] * tensor.ndim
    slices[dim] = index
    return tensor[tuple(slices)]


def _final_layer(cache: Any, layer: Optional[int]) -> int:
    """``layer`` as an int in 0..n_layers (n_layers: the unembedding's input, also for -1 / None);
    numpy integers and 0-d tensors are indices too (``as_index``)."""
    n = cache.n_layers
    index = n if layer is None else as_index(layer)
    if index == -1:
        index = n
    if index is None:
        raise HookError(f"layer={layer!r} is not a layer index: take a whole number 0..{n} (or -1 / None for "
                        f"the unembedding).")
    if not 0 <= index <= n:
        raise HookError(f"layer={index} is out of range: take 0..{n} (or -1 / None for the unembedding).")
    return index


def _norm_kind(model: Any) -> str:
    return getattr(model.config, "norm", "none")


def apply_ln_to_stack(cache: Any, stack: torch.Tensor, layer: Optional[int] = None, mlp_input: bool = False,
                      pos_slice: PosSlice = None, batch_slice: PosSlice = None, has_batch_dim: bool = True,
                      recompute_ln: bool = False) -> torch.Tensor:
    """Treat each component of ``stack`` as input to ``layer``'s norm (ln1, or ln2 with
    ``mlp_input``; ``layer`` = n_layers or None = the final norm) and scale it by that norm's
    cached scale: what each component contributes after normalisation. LayerNorm also
    centres each component. The norm's weight is not applied (as in TransformerLens).
    ``recompute_ln`` (final norm only): run the final norm itself on each component."""
    model = cache.model
    if _norm_kind(model) not in ("layer", "rms"):
        return stack
    layer = _final_layer(cache, layer)
    if has_batch_dim:
        stack = apply_slice(stack, batch_slice, dim=1)
    if layer == cache.n_layers and model.ln_final is None:  # post-norm blocks end in their own norm
        return stack
    if recompute_ln and layer == cache.n_layers:
        param = model.ln_final.weight
        with torch.no_grad():
            return model.ln_final(stack.to(param.device, param.dtype))
    if _norm_kind(model) == "layer":
        stack = stack - stack.mean(dim=-1, keepdim=True)
    if layer == cache.n_layers:
        key = "ln_final.hook_scale"
    else:
        key = f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_scale"
    scale = _scale_at(cache, key, pos_slice)  # ([B,] [T,] 1)
    if cache.has_batch_dim:  # the cache's batch dim, whether or not the stack has one (as TransformerLens)
        scale = apply_slice(scale, batch_slice, dim=0)
    return stack / scale


def _scale_at(cache: Any, key: str, pos_slice: PosSlice) -> torch.Tensor:
    """The cached norm scale ``key`` at the positions ``pos_slice`` picks. A cache recorded
    with ``last_token_only=True`` holds the final norm's scale for the last position only
    (B, 1, 1) while the stream has all T: only the last position can be normalised then."""
    scale = cache[key]
    stream = next((cache[n] for n in ("hook_embed", f"blocks.{cache.n_layers - 1}.hook_resid_post",
                                      "blocks.0.hook_resid_pre") if n in cache), None)
    full = stream.shape[-2] if stream is not None else scale.shape[-2]
    have = scale.shape[-2]
    if have == full:
        return apply_slice(scale, pos_slice, dim=-2)
    positions = apply_slice(torch.arange(full, device=scale.device), pos_slice, dim=0)  # the stream positions wanted
    if bool((positions < full - have).any()):
        raise InputError(f"{key} was cached for the last {have} of {full} positions only (run_with_cache(..., "
                         f"last_token_only=True)), so positions before it cannot be normalised; pass "
                         f"pos_slice=-1, or record the cache without last_token_only.")
    shifted = positions - (full - have)  # the same positions among the cached ones
    return apply_slice(scale, int(shifted) if shifted.ndim == 0 else shifted, dim=-2)


def accumulated_resid(cache: Any, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                      pos_slice: PosSlice = None, mlp_input: bool = False, return_labels: bool = False) -> Stack:
    """The residual stream at the input of each block up to ``layer`` ("0_pre", "1_pre", ...,
    and "final_post" when ``layer`` is n_layers / None / -1), stacked: (n, [B,] T, d).
    ``incl_mid``: also the stream between attention and MLP of every earlier block;
    ``mlp_input``: and of ``layer`` itself. ``apply_ln``: normalised as ``layer``'s input
    (the final norm recomputed per entry when ``layer`` is the end: the logit lens)."""
    layer = _final_layer(cache, layer)
    labels, parts = [], []
    for i in range(layer + 1):
        if i == cache.n_layers:
            parts.append(cache["resid_post", cache.n_layers - 1])
            labels.append("final_post")
            continue
        parts.append(_resid_pre(cache, i))
        labels.append(f"{i}_pre")
        if (incl_mid and i < layer) or (mlp_input and i == layer):
            parts.append(cache["resid_mid", i])
            labels.append(f"{i}_mid")
    stack = torch.stack([apply_slice(p, pos_slice, dim=-2) for p in parts])
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input=mlp_input, pos_slice=pos_slice,
                                  has_batch_dim=cache.has_batch_dim, recompute_ln=layer == cache.n_layers)
    return (stack, labels) if return_labels else stack


def _resid_pre(cache: Any, layer: int) -> torch.Tensor:
    """Block ``layer``'s input; the previous block's output is the same tensor, so a cache
    that kept only ``resid_post`` answers too."""
    name, previous = f"blocks.{layer}.hook_resid_pre", f"blocks.{layer - 1}.hook_resid_post"
    if name not in cache and layer > 0 and previous in cache:
        return cache[previous]
    return cache[name]


def decompose_resid(cache: Any, layer: Optional[int] = None, mlp_input: bool = False, mode: str = "all",
                    apply_ln: bool = False, pos_slice: PosSlice = None, incl_embeds: bool = True,
                    return_labels: bool = False) -> Stack:
    """The input to ``layer`` split into what wrote it: "embed", "pos_embed" (if the model
    has one), then "{l}_attn_out" and "{l}_mlp_out" of every earlier block. ``mode``:
    "all", "attn" or "mlp". The entries sum to ``resid_pre`` of ``layer`` (pre-norm models)."""
    if mode not in ("all", "attn", "mlp"):
        raise InputError(f"mode={mode!r}: expected 'all', 'attn' or 'mlp'.")
    layer = _final_layer(cache, layer)
    labels, parts = [], []
    if incl_embeds:
        for name, label in (("hook_embed", "embed"), ("hook_pos_embed", "pos_embed")):
            if name in cache:
                parts.append(cache[name])
                labels.append(label)
    for i in range(layer):
        if mode != "mlp":
            parts.append(cache["attn_out", i])
            labels.append(f"{i}_attn_out")
        if mode != "attn":
            parts.append(cache["mlp_out", i])
            labels.append(f"{i}_mlp_out")
    if mlp_input and mode != "mlp":
        parts.append(cache["attn_out", layer])
        labels.append(f"{layer}_attn_out")
    stack = torch.stack([apply_slice(p, pos_slice, dim=-2) for p in parts])
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
    return (stack, labels) if return_labels else stack


def head_results(cache: Any, layer: int) -> torch.Tensor:
    """([B,] T, nh, d): each head's write into the residual stream (before the output bias);
    the cached ``hook_result`` if present, else computed from ``hook_z`` and o_proj."""
    name = f"blocks.{layer}.attn.hook_result"
    if name in cache:
        return cache[name]
    attn = cache.model.blocks[layer].attn
    nh, hd = attn.n_heads, attn.head_dim
    w_o = effective_weight(attn.o_proj).T.reshape(nh, hd, -1)  # (nh, hd, d)
    z = cache["z", layer]  # ([B,] T, nh, hd)
    return torch.einsum("...hk,hkd->...hd", z.to(w_o.dtype), w_o)


def stack_head_results(cache: Any, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                       pos_slice: PosSlice = None, apply_ln: bool = False) -> Stack:
    """Every head's output of the blocks before ``layer``, as a stack (L * nh, [B,] T, d)
    labelled "L0H0", "L0H1", ...; ``incl_remainder`` adds the rest of the stream."""
    layer = _final_layer(cache, layer)
    labels: list[str] = []
    parts = []
    for i in range(layer):
        parts.append(apply_slice(head_results(cache, i), pos_slice, dim=-3))  # ([B,] T, nh, d)
        labels.extend(f"L{i}H{h}" for h in range(cache.model.config.n_heads))
    if parts:
        stack = torch.cat(parts, dim=-2).movedim(-2, 0)  # (L * nh, [B,] T, d)
        if incl_remainder:
            remainder = apply_slice(cache["resid_post", layer - 1], pos_slice, dim=-2) - stack.sum(0)
            stack = torch.cat([stack, remainder[None]])
            labels.append("remainder")
    elif incl_remainder:
        raise HookError("stack_head_results(layer=0, incl_remainder=True): there is no block before layer 0.")
    else:
        stack = torch.zeros(0, *apply_slice(cache["hook_embed"], pos_slice, dim=-2).shape)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, pos_slice=pos_slice)
    return (stack, labels) if return_labels else stack


def tokens_to_residual_directions(model: Any, tokens: Tokens) -> torch.Tensor:
    """The residual-stream direction that raises each token's logit: its unembedding column
    times the final norm's weight. A single token gives (d,), a tensor of ids (..., d)."""
    if isinstance(tokens, str):
        tokens = single_token(model, tokens)
    tokens = _token_ids(model, tokens)
    w_u = effective_weight(model.unembed)  # (V, d)
    directions = w_u[tokens.reshape(-1) if tokens.numel() == 1 else tokens]
    directions = directions[0] if tokens.numel() == 1 else directions
    norm_weight = getattr(model.ln_final, "weight", None)  # norm="none": an Identity, nothing to fold
    if norm_weight is not None:  # fold the final norm's weight in, as TransformerLens's fold_ln does
        directions = directions * norm_weight.detach()
    return directions


def effective_weight(module: Any) -> torch.Tensor:
    """The (out, in) matrix a linear layer applies: a quantized layer's codes dequantized, plus
    the active LoRA adapter's ``scale * B @ A`` when it is not merged into the weight (its
    frozen base weight alone would leave the adapter's write out of every head's result)."""
    weight = dense_weight(module)
    name = getattr(module, "active_adapter", None)
    if name is not None and not module.disabled and module.merged_adapter is None:
        weight = (weight.float() + module.delta_weight(name).to(weight.device)).to(weight.dtype)
    return weight


def _token_ids(model: Any, tokens: Any) -> torch.Tensor:
    """Token ids as a long tensor, each checked against the vocabulary (an id past it would be
    an IndexError deep in the unembedding)."""
    from lucidlm.errors import TokenIdError

    try:  # no dtype: 1.5 must be refused below, not truncated to 1
        tokens = torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(f"tokens must be a token id, a text that is one token, or a tensor of ids; got "
                         f"{str(tokens)[:60]}.") from None
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InputError(f"tokens must be integer ids, got {tokens.dtype} values ({str(tokens.tolist())[:40]}).")
    tokens = tokens.long()
    vocab = model.config.vocab_size
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise TokenIdError(f"token id {bad} is out of range: this model's vocabulary has ids 0..{vocab - 1}.")
    return tokens


def single_token(model: Any, text: str) -> int:
    """The id of a text that is one token, encoded without BOS (TransformerLens's
    ``to_single_token``): a tokenizer that puts BOS first by itself would make it two."""
    ids = encode(model, text, prepend_bos=False) if getattr(model, "tokenizer", None) is not None else None
    if ids is None or len(ids) != 1:
        raise InputError(f"{text!r} is {'not encodable without a tokenizer' if ids is None else f'{len(ids)} tokens'}"
                         f"; logit attribution needs a single token (pass its id instead).")
    return int(ids[0])


def logit_attrs(cache: Any, residual_stack: torch.Tensor, tokens: Tokens, incorrect_tokens: Optional[Tokens] = None,
                pos_slice: PosSlice = None, batch_slice: PosSlice = None,
                has_batch_dim: bool = True) -> torch.Tensor:
    """Direct logit attribution: how much each component of ``residual_stack`` (normalised by
    the final norm's cached scale) pushes the logit of ``tokens`` (minus ``incorrect_tokens``)."""
    directions = tokens_to_residual_directions(cache.model, tokens)
    if incorrect_tokens is not None:
        wrong = tokens_to_residual_directions(cache.model, incorrect_tokens)
        if wrong.shape != directions.shape:
            raise InputError(f"tokens and incorrect_tokens must have the same shape, got {tuple(directions.shape[:-1])} "
                             f"and {tuple(wrong.shape[:-1])}.")
        directions = directions - wrong
    scaled = apply_ln_to_stack(cache, residual_stack, None, pos_slice=pos_slice, batch_slice=batch_slice,
                               has_batch_dim=has_batch_dim)
    return (scaled * directions.to(scaled.dtype)).sum(dim=-1)
