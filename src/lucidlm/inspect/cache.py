"""Run the model and keep (or change) what flows through its hook points.

    logits, cache = run_with_cache(model, ids)          # every activation, by hook name
    cache["blocks.0.attn.hook_pattern"]                 # (B, nh, T, S)
    cache["pattern", 0]                                 # the same, TransformerLens shorthand
    logits = run_with_hooks(model, ids, fwd_hooks=[("blocks.3.hook_resid_post", patch)])

Hooks are attached for one forward pass and removed in a ``finally``, so an exception in
a hook never leaves the model altered. Hooks the caller attached by hand are left alone.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from lucidlm.errors import HookError, InputError
from lucidlm.inspect import resid
from lucidlm.model.hooks import HookFn, HookPoint

NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]

# TransformerLens-style short names -> the hook's path inside ``blocks.{layer}``.
SHORT_NAMES = {
    "resid_pre": "hook_resid_pre", "attn_out": "hook_attn_out", "resid_mid": "hook_resid_mid",
    "mlp_out": "hook_mlp_out", "resid_post": "hook_resid_post",
    "q": "attn.hook_q", "k": "attn.hook_k", "v": "attn.hook_v", "rot_q": "attn.hook_rot_q",
    "rot_k": "attn.hook_rot_k", "attn_scores": "attn.hook_attn_scores", "pattern": "attn.hook_pattern",
    "attn": "attn.hook_pattern", "z": "attn.hook_z",
    "pre": "mlp.hook_pre", "post": "mlp.hook_post", "pre_linear": "mlp.hook_pre_linear",
    "mlp_pre": "mlp.hook_pre", "mlp_post": "mlp.hook_post",
    "scale": "{sub}.hook_scale", "normalized": "{sub}.hook_normalized",
    "result": "attn.hook_result", "q_input": "hook_q_input", "k_input": "hook_k_input",
    "v_input": "hook_v_input", "attn_in": "hook_attn_in", "mlp_in": "hook_mlp_in",
}
# Hook points that exist only once switched on (model/hook_options.py), and the switch.
OPT_IN_HOOKS = {"hook_result": "set_use_attn_result", "hook_q_input": "set_use_split_qkv_input",
                "hook_k_input": "set_use_split_qkv_input", "hook_v_input": "set_use_split_qkv_input",
                "hook_attn_in": "set_use_attn_in", "hook_mlp_in": "set_use_hook_mlp_in"}
# Short names that live outside the blocks.
GLOBAL_SHORT_NAMES = {"embed": "hook_embed", "pos_embed": "hook_pos_embed"}


def unknown_hook_error(name: str, valid: Sequence[str]) -> HookError:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    opt_in = next((setter for suffix, setter in OPT_IN_HOOKS.items() if name.endswith(suffix)), None)
    if opt_in is not None:
        hint += f" {name.rsplit('.', 1)[-1]} is opt-in: turn it on with model.{opt_in}(True)."
    return HookError(
        f"unknown hook name {name!r}.{hint} This model has {len(valid)} hook points; "
        f"list them with model.hook_points() (names look like 'blocks.0.attn.hook_pattern')."
    )


def resolve_hook_names(model: nn.Module, names_filter: NamesFilter) -> list[str]:
    """The hook names a filter selects: None = all, a name, a list of names, or a predicate."""
    all_names = list(model.hook_points())
    if names_filter is None:
        return all_names
    if callable(names_filter):
        return [n for n in all_names if names_filter(n)]
    if not isinstance(names_filter, (str, list, tuple, set, frozenset)):
        raise HookError(f"names_filter={names_filter!r} is invalid: give a hook name, a list of names, a predicate "
                        f"(name -> bool) or None (every hook).")
    names = [names_filter] if isinstance(names_filter, str) else list(names_filter)
    known = set(all_names)
    for name in names:
        if not isinstance(name, str):
            raise HookError(f"names_filter holds {name!r}, which is not a hook name; give names like "
                            f"'blocks.0.attn.hook_pattern'.")
        if name not in known:
            raise unknown_hook_error(name, all_names)
    return names


class ActivationCache(Mapping):
    """Activations by hook name, read-only. Also answers TransformerLens shorthand:
    ``cache["pattern", 0]``, ``cache["resid_post", -1]``, ``cache["scale", 2, "ln1"]``,
    ``cache["embed"]``."""

    def __init__(self, activations: dict[str, torch.Tensor], model: nn.Module, has_batch_dim: bool = True) -> None:
        self._acts = activations
        self.model = model
        self.has_batch_dim = has_batch_dim

    # -- Mapping --
    def __getitem__(self, key: Union[str, tuple]) -> torch.Tensor:
        name = self.full_name(key)
        if name not in self._acts:
            if name in self.model.hook_points():
                raise HookError(
                    f"hook {name!r} exists but was not cached: it was left out by names_filter "
                    f"(or did not run). Cached: {len(self._acts)} hooks."
                )
            raise unknown_hook_error(name, list(self._acts) or list(self.model.hook_points()))
        return self._acts[name]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._acts

    def __iter__(self) -> Iterator[str]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations: {', '.join(list(self._acts)[:4])}, ...)"

    @property
    def n_layers(self) -> int:
        return self.model.config.n_layers

    def full_name(self, key: Union[str, tuple]) -> str:
        """``("pattern", 0)`` -> ``"blocks.0.attn.hook_pattern"``; full names pass through."""
        if isinstance(key, str):
            return GLOBAL_SHORT_NAMES.get(key, key)
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise HookError(f"cache key {key!r} must be a hook name or a tuple like ('pattern', 0).")
        short, rest = key[0], key[1:]
        if short in GLOBAL_SHORT_NAMES and not rest:
            return GLOBAL_SHORT_NAMES[short]
        if short not in SHORT_NAMES:
            raise unknown_hook_error(short, sorted(SHORT_NAMES) + sorted(GLOBAL_SHORT_NAMES))
        if not rest or not isinstance(rest[0], int):
            raise HookError(f"cache key {key!r}: {short!r} is per layer; write cache[{short!r}, layer].")
        layer = check_layer(rest[0], self.n_layers)
        path = SHORT_NAMES[short]
        if "{sub}" in path:
            sub = rest[1] if len(rest) > 1 else None
            if sub not in ("ln1", "ln2"):
                raise HookError(f"cache key {key!r}: name the norm, e.g. "
                                f"cache[{short!r}, {layer}, 'ln1'] (ln1 or ln2).")
            path = path.format(sub=sub)
        return f"blocks.{layer}.{path}"

    # -- conveniences --
    def to(self, device: Union[str, torch.device]) -> "ActivationCache":
        from lucidlm.devices import resolve_device
        device = resolve_device(device)
        return ActivationCache({k: v.to(device) for k, v in self._acts.items()}, self.model, self.has_batch_dim)

    def remove_batch_dim(self) -> "ActivationCache":
        if not self.has_batch_dim:
            return self
        batch = {v.shape[0] for v in self._acts.values()}
        if batch != {1}:
            raise InputError(f"remove_batch_dim needs a batch of 1, but the cached batch size is {sorted(batch)}.")
        return ActivationCache({k: v[0] for k, v in self._acts.items()}, self.model, has_batch_dim=False)

    # -- residual-stream analyses (TransformerLens's, same numbers; see inspect/resid.py) --
    def accumulated_resid(self, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: Any = None, mlp_input: bool = False, return_labels: bool = False) -> Any:
        """The stream at each block's input, stacked: (n, [B,] T, d); see resid.accumulated_resid."""
        return resid.accumulated_resid(self, layer, incl_mid, apply_ln, pos_slice, mlp_input, return_labels)

    stack_residual = accumulated_resid

    def decompose_resid(self, layer: Optional[int] = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: Any = None, incl_embeds: bool = True,
                        return_labels: bool = False) -> Any:
        """The stream at ``layer``'s input split into what wrote it; see resid.decompose_resid."""
        return resid.decompose_resid(self, layer, mlp_input, mode, apply_ln, pos_slice, incl_embeds, return_labels)

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: Any = None, apply_ln: bool = False) -> Any:
        """Each head's output, (L * nh, [B,] T, d) labelled "L0H0"...; see resid.stack_head_results."""
        return resid.stack_head_results(self, layer, return_labels, incl_remainder, pos_slice, apply_ln)

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: Optional[int] = None, mlp_input: bool = False,
                          pos_slice: Any = None, batch_slice: Any = None, has_batch_dim: bool = True,
                          recompute_ln: bool = False) -> torch.Tensor:
        """Scale a stack by ``layer``'s cached norm scale; see resid.apply_ln_to_stack."""
        return resid.apply_ln_to_stack(self, residual_stack, layer, mlp_input, pos_slice, batch_slice,
                                       has_batch_dim, recompute_ln)

    def logit_attrs(self, residual_stack: torch.Tensor, tokens: Any, incorrect_tokens: Any = None,
                    pos_slice: Any = None, batch_slice: Any = None, has_batch_dim: bool = True) -> torch.Tensor:
        """Direct logit attribution of each component; see resid.logit_attrs."""
        return resid.logit_attrs(self, residual_stack, tokens, incorrect_tokens, pos_slice, batch_slice,
                                 has_batch_dim)

    def apply_ln_final(self, resid_stream: torch.Tensor) -> torch.Tensor:
        """The model's final norm applied to any residual-stream tensor (..., d); identity
        for models without one (post-norm blocks end in their own norm)."""
        if not isinstance(resid_stream, torch.Tensor):
            raise InputError(f"apply_ln_final takes a residual-stream tensor (..., d_model), got "
                             f"{type(resid_stream).__name__}.")
        ln_final = self.model.ln_final
        if ln_final is None:
            return resid_stream
        param = next(ln_final.parameters())
        with torch.no_grad():
            return ln_final(resid_stream.to(param.device, param.dtype))


def check_layer(layer: int, n_layers: int) -> int:
    """Layer index, negative counting from the end; HookError naming the valid range."""
    if not -n_layers <= layer < n_layers:
        raise HookError(f"layer={layer} is out of range: this model has {n_layers} layers (0..{n_layers - 1}).")
    return layer % n_layers


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
        fns = point.fns if dir == "fwd" else point.bwd_fns
        # Remove by identity: the same function may be attached elsewhere, or twice.
        for i in range(len(fns) - 1, -1, -1):
            if fns[i] is fn:
                del fns[i]
                break


def _as_ids(model: nn.Module, ids: Any, forward_kwargs: dict[str, Any], prepend_bos: Optional[bool] = None,
            padding_side: str = "right") -> Any:
    """Text or a list of texts -> ids (a list is padded; its attention mask joins the forward's
    arguments, so padding is never attended to)."""
    _check_forward_kwargs(model, forward_kwargs)
    if isinstance(ids, str) or (isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], str)):
        from lucidlm.inspect.tokens import to_tokens
        tokens, mask = to_tokens(model, ids, prepend_bos, padding_side, return_attention_mask=True)
        if not bool(mask.all()):
            forward_kwargs.setdefault("attention_mask", mask)
        return tokens
    return ids


def _check_forward_kwargs(model: nn.Module, forward_kwargs: dict[str, Any]) -> None:
    """Options meant for the forward pass must be its arguments: name a misspelt one here,
    not as a TypeError from deep inside."""
    import inspect

    from lucidlm.model.transformer import Transformer

    known = [n for n in inspect.signature(Transformer.forward).parameters if n not in ("self", "ids")]
    for name in forward_kwargs:
        if name not in known:
            from lucidlm.suggest import did_you_mean
            raise InputError(f"unknown option {name!r} for run_with_cache / run_with_hooks; the forward pass takes "
                             f"{', '.join(known)}{did_you_mean(name, known) or '.'}")


def _hook_pairs(model: nn.Module, hooks: Sequence[tuple[Any, HookFn]]) -> list[tuple[str, HookFn]]:
    pairs: list[tuple[str, HookFn]] = []
    for target, fn in hooks:
        if not callable(fn):
            raise HookError(f"the hook for {target!r} is {fn!r}, not a function fn(activation, hook).")
        pairs.extend((name, fn) for name in resolve_hook_names(model, target))
    return pairs


def _as_batch(tokens: Any, logits: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(tokens, device=logits.device).reshape(logits.shape[0], -1)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each next token (TransformerLens's return_type="loss")."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def run_with_cache(model: nn.Module, ids: Any, names_filter: NamesFilter = None,
                   device: Optional[Union[str, torch.device]] = None, remove_batch_dim: bool = False,
                   input_pos: Optional[torch.Tensor] = None, incl_bwd: bool = False,
                   metric: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   prepend_bos: Optional[bool] = None, padding_side: str = "right", **forward_kwargs: Any,
                   ) -> tuple[torch.Tensor, ActivationCache]:
    """One forward pass that records the selected activations (detached).

    ids: token ids (T,) or (B, T), text, or a list of texts (padded; see inspect/tokens.py).
    input_pos: KV-cache slots, passed to the model (set the cache up first with
    ``model.setup_kv_cache``); the cache then holds activations of the new positions only.
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

    tokens = _as_ids(model, ids, forward_kwargs, prepend_bos, padding_side)
    attached = _attach(model, [(name, make_saver(name)) for name in names])
    if incl_bwd:
        attached += _attach(model, [(name, make_saver(name + "_grad")) for name in names], dir="bwd")
    try:
        with torch.enable_grad() if incl_bwd else contextlib.nullcontext():
            logits = model(tokens, input_pos=input_pos, **forward_kwargs)
            if incl_bwd:
                value = metric(logits) if metric is not None else next_token_loss(logits, _as_batch(tokens, logits))
                if value.numel() != 1:
                    raise InputError(f"incl_bwd needs a scalar to backpropagate, but metric(logits) has shape "
                                     f"{tuple(value.shape)}; reduce it (e.g. .mean() or .sum()).")
                value.backward()
    finally:
        _detach(attached)
    cache = ActivationCache(activations, model)
    return logits, (cache.remove_batch_dim() if remove_batch_dim else cache)


def run_with_hooks(model: nn.Module, ids: Any,
                   fwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                   bwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                   reset_hooks_end: bool = True, prepend_bos: Optional[bool] = None,
                   padding_side: str = "right", **forward_kwargs: Any) -> torch.Tensor:
    """One forward pass with ``fn(activation, hook) -> new | None`` attached at each named
    hook point (or at every hook point whose name satisfies a predicate). ``bwd_hooks``:
    ``fn(grad, hook) -> new | None`` run when the returned logits are backpropagated (they
    are bound to this pass's graph, so they work after the hooks are reset)."""
    tokens = _as_ids(model, ids, forward_kwargs, prepend_bos, padding_side)
    attached = _attach(model, _hook_pairs(model, fwd_hooks))
    attached += _attach(model, _hook_pairs(model, bwd_hooks), dir="bwd")
    try:
        return model(tokens, **forward_kwargs)
    finally:
        if reset_hooks_end:
            _detach(attached)
