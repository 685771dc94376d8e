"""Run the model and keep (or change) what flows through its hook points.

    logits, cache = run_with_cache(model, ids)          # every activation, by hook name
    cache["blocks.0.attn.hook_pattern"]                 # (B, nh, T, S)
    cache["pattern", 0]                                 # the same, TransformerLens shorthand
    logits = run_with_hooks(model, ids, fwd_hooks=[("blocks.3.hook_resid_post", patch)])

Hooks are attached for one forward pass and removed in a ``finally``, so an exception in
a hook never leaves the model altered. Hooks the caller attached by hand are left alone.

This module runs the model; what a run returns is ``activation_cache.ActivationCache`` and
the names it takes are ``hook_names.py`` (both re-exported here).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from lucidlm.errors import HookError, InputError
from lucidlm.inspect.activation_cache import ActivationCache
from lucidlm.inspect.hook_names import (  # noqa: F401  (re-exported: this module was their home)
    GLOBAL_SHORT_NAMES, OPT_IN_HOOKS, SHORT_NAMES, NamesFilter, check_layer, full_hook_name, resolve_hook_names,
    unknown_hook_error)
from lucidlm.inspect.tokens import TextOrIds
from lucidlm.model.hooks import HookFn, HookPoint

def _attach(model: nn.Module, pairs: list[tuple[str, HookFn]], dir: str = "fwd",
            ) -> list[tuple[HookPoint, HookFn, str]]:
    points = model.hook_points()
    attached = []
    for name, fn in pairs:
        points[name].add_hook(fn, dir=dir)
        attached.append((points[name], fn, dir))
    return attached


def _detach(attached: list[tuple[HookPoint, HookFn, str]]) -> None:
    for point, fn, dir in attached:
        point.remove_hook(fn, dir)


def _gradient_starts(model: nn.Module) -> list[tuple[str, HookFn]]:
    """Hooks that make the stream's start require grad where nothing else does: a quantized
    embedding's table is buffers, not a parameter, so without this no gradient would reach
    ``hook_embed`` (nor, in a fully quantized model, any hook). A float model's embedding
    output requires grad already and is left as it is."""
    def start_gradient(act: torch.Tensor, hook: HookPoint) -> Optional[torch.Tensor]:
        if torch.is_grad_enabled() and act.is_floating_point() and not act.requires_grad:
            return act.detach().requires_grad_()
        return None
    points = model.hook_points()
    return [(name, start_gradient) for name in ("hook_embed", "hook_pos_embed") if name in points]


def _as_ids(model: nn.Module, ids: Any, forward_kwargs: dict[str, Any], prepend_bos: Optional[bool] = None,
            padding_side: str = "right", caller: Optional[Callable[..., Any]] = None) -> Any:
    """Text or a list of texts -> ids (a list is padded; its attention mask joins the forward's
    arguments, so padding is never attended to). ``caller``: the function whose leftover
    keywords ``forward_kwargs`` are, named in the message for a misspelt one."""
    _check_forward_kwargs(model, forward_kwargs, caller)
    if isinstance(ids, str) or (isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], str)):
        from lucidlm.inspect.tokens import to_tokens
        tokens, mask = to_tokens(model, ids, prepend_bos, padding_side, return_attention_mask=True)
        if not bool(mask.all()):
            forward_kwargs.setdefault("attention_mask", mask)
        return tokens
    return ids


def _check_forward_kwargs(model: nn.Module, forward_kwargs: dict[str, Any],
                          caller: Optional[Callable[..., Any]] = None) -> None:
    """Options meant for the forward pass must be its arguments: name a misspelt one here,
    not as a TypeError from deep inside. The closest name is sought among the caller's own
    options (``names_filter``, ``fwd_hooks``, ...) as well as the forward pass's."""
    if not forward_kwargs:
        return
    import inspect

    from lucidlm.model.transformer import Transformer

    known = [n for n in inspect.signature(Transformer.forward).parameters if n not in ("self", "ids")]
    for name in forward_kwargs:
        if name not in known:
            from lucidlm.suggest import did_you_mean, keyword_options
            own = [n for n in keyword_options(caller) if n not in ("model", "ids")] if caller is not None else []
            label = f"{caller.__name__}()" if caller is not None else "run_with_cache / run_with_hooks"
            takes = f"its options are {', '.join(own)}; " if own else ""
            raise InputError(f"unknown option {name!r} for {label}; {takes}the forward pass takes "
                             f"{', '.join(known)}{did_you_mean(name, own + known) or '.'}")


def _hook_pairs(model: nn.Module, hooks: Sequence[tuple[Any, HookFn]]) -> list[tuple[str, HookFn]]:
    pairs: list[tuple[str, HookFn]] = []
    for target, fn in hooks:
        if not callable(fn):
            raise HookError(f"the hook for {target!r} is {fn!r}, not a function fn(activation, hook).")
        pairs.extend((name, fn) for name in resolve_hook_names(model, target))
    return pairs


def _as_batch(tokens: Any, logits: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(tokens, device=logits.device).reshape(logits.shape[0], -1)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor,
                    attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean cross-entropy of predicting each next token (TransformerLens's return_type="loss").
    attention_mask (B, T): only positions where this token and the next are real count, so
    padding adds nothing (as TransformerLens masks a left-padded batch)."""
    if attention_mask is None:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:],
                                               reduction="none")  # (B, T - 1)
    keep = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()  # (B, T - 1)
    return losses.masked_fill(~keep, 0.0).sum() / keep.sum()


def _default_metric(logits: torch.Tensor, tokens: Any, input_pos: Optional[torch.Tensor],
                    forward_kwargs: dict[str, Any]) -> torch.Tensor:
    """The next-token loss of the run, padding left out: the attention mask covers the
    tokens themselves unless the run wrote KV-cache slots (then it covers the slots)."""
    ids = _as_batch(tokens, logits)  # (B, T)
    mask = forward_kwargs.get("attention_mask") if input_pos is None else None
    mask = mask if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else None
    return next_token_loss(logits, ids, mask)


def token_columns(pattern: torch.Tensor, key_slots: Optional[slice] = None) -> torch.Tensor:
    """(..., T, S) attention weights -> (..., T, T), the weights on the sequence's own tokens.
    With prefix tuning S = P + T and the P prefix keys come first: their columns are left out
    (a row then sums to 1 minus what the prefix takes), so column j is token j.
    key_slots (a KV-cached step's ``cache.key_slots``): keep those columns instead, the cache
    slots written so far: (..., T_new, slots), column j is slot j."""
    if key_slots is not None:
        return pattern[..., key_slots]
    return pattern[..., pattern.shape[-1] - pattern.shape[-2]:]


def written_slots(model: nn.Module, input_pos: Optional[torch.Tensor]) -> Optional[slice]:
    """For a pass that wrote KV-cache slots ``input_pos``: the pattern columns of slots
    0..max(input_pos). The keys are a prefix's (if any), then every cache slot, so the slots
    are the last ``max_seq_len`` columns and are counted from the end."""
    if input_pos is None or getattr(model, "kv_caches", None) is None:
        return None
    n_slots = model.kv_caches[0].max_seq_len
    written = int(torch.as_tensor(input_pos).max()) + 1
    return slice(-n_slots, (written - n_slots) or None)  # end 0 would be empty: None when every slot is written


def run_with_cache(model: nn.Module, ids: TextOrIds, names_filter: NamesFilter = None,
                   device: Optional[Union[str, torch.device]] = None, remove_batch_dim: bool = False,
                   input_pos: Optional[torch.Tensor] = None, incl_bwd: bool = False,
                   metric: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   prepend_bos: Optional[bool] = None, padding_side: str = "right", **forward_kwargs: Any,
                   ) -> tuple[torch.Tensor, ActivationCache]:
    """One forward pass that records the selected activations (detached).

    ids: token ids (T,) or (B, T), text, or a list of texts (padded; see inspect/tokens.py).
    input_pos: KV-cache slots, passed to the model (set the cache up first with
    ``model.setup_kv_cache``); the cache then holds activations of the new positions only,
    and its patterns span every cache slot (``cache.key_slots``: the written ones).
    incl_bwd: also backpropagate ``metric(logits)`` (a scalar; default: the next-token loss)
    and cache each hook's gradient as ``name + "_grad"``, as TransformerLens does.
    """
    names = resolve_hook_names(model, names_filter)
    if device is not None:
        from lucidlm.devices import resolve_device
        device = resolve_device(device)
    activations: dict[str, torch.Tensor] = {}

    def make_saver(name: str) -> HookFn:
        def save(act: torch.Tensor, hook: HookPoint) -> None:
            act = act.detach()
            activations[name] = act.to(device) if device is not None else act
        return save

    tokens = _as_ids(model, ids, forward_kwargs, prepend_bos, padding_side, run_with_cache)
    attached = _attach(model, _gradient_starts(model)) if incl_bwd else []
    attached += _attach(model, [(name, make_saver(name)) for name in names])
    if incl_bwd:
        # each bwd hook sees the point's own gradient (HookPoint), whatever a user's hook returns
        attached += _attach(model, [(name, make_saver(name + "_grad")) for name in names], dir="bwd")
    try:
        with torch.enable_grad() if incl_bwd else contextlib.nullcontext():
            logits = model(tokens, input_pos=input_pos, **forward_kwargs)
            if incl_bwd:
                value = metric(logits) if metric is not None else _default_metric(logits, tokens, input_pos,
                                                                                  forward_kwargs)
                if value.numel() != 1:
                    raise InputError(f"incl_bwd needs a scalar to backpropagate, but metric(logits) has shape "
                                     f"{tuple(value.shape)}; reduce it (e.g. .mean() or .sum()).")
                value.backward()
    finally:
        _detach(attached)
    cache = ActivationCache(activations, model, key_slots=written_slots(model, input_pos))
    return logits, (cache.remove_batch_dim() if remove_batch_dim else cache)


def run_with_hooks(model: nn.Module, ids: TextOrIds,
                   fwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                   bwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                   reset_hooks_end: bool = True, prepend_bos: Optional[bool] = None,
                   padding_side: str = "right", **forward_kwargs: Any) -> torch.Tensor:
    """One forward pass with ``fn(activation, hook) -> new | None`` attached at each named
    hook point (or at every hook point whose name satisfies a predicate). ``bwd_hooks``:
    ``fn(grad, hook) -> new | None`` run when the returned logits are backpropagated (they
    are bound to this pass's graph, so they work after the hooks are reset)."""
    tokens = _as_ids(model, ids, forward_kwargs, prepend_bos, padding_side, run_with_hooks)
    # Both lists are checked before either is attached: a bad bwd entry must not leave the
    # fwd hooks on the model, silently editing every later pass.
    fwd, bwd = _hook_pairs(model, fwd_hooks), _hook_pairs(model, bwd_hooks)
    starts = _attach(model, _gradient_starts(model)) if bwd else []  # for this pass only
    attached = _attach(model, fwd) + _attach(model, bwd, dir="bwd")
    try:
        return model(tokens, **forward_kwargs)
    finally:
        _detach(starts)
        if reset_hooks_end:
            _detach(attached)
