"""Activation patching sweeps, as ``transformer_lens.patching`` offers them, and attribution
patching (their gradient approximation).

    _, clean_cache = model.run_with_cache(clean_ids)
    metric = lambda logits: logits[0, -1, paris] - logits[0, -1, rome]
    grid = get_act_patch_resid_pre(model, corrupted_ids, clean_cache, metric)   # (layers, pos)
    heads = get_act_patch_attn_head_out_all_pos(model, corrupted_ids, clean_cache, metric)  # (layers, heads)
    approx = attr_patch_resid_pre(model, clean_cache, corrupted_ids, metric)     # (layers, pos), 2 passes

Exact patching runs the corrupted prompt once per cell with one clean activation written
in, and records ``metric(logits)``: the same loop, the same hook names and the same result
as TransformerLens's functions. Attribution patching replaces the loop by one backward pass:
the change of the metric is estimated as (clean - corrupted activation) . d metric / d act,
taken on the corrupted run.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lucidlm.errors import InputError
from lucidlm.inspect.cache import ActivationCache, run_with_cache, run_with_hooks
from lucidlm.inspect.tokens import TextOrLooseIds
from lucidlm.suggest import keywords_checked

Metric = Callable[[torch.Tensor], torch.Tensor]
Setter = Callable[[torch.Tensor, Sequence[int], torch.Tensor], torch.Tensor]


# -- where a patch goes, by the shape of the activation ---------------------------------------
# Each setter writes the slice of the clean activation that ``index`` (layer first) selects into
# the corrupted one, and returns it; ``generic_activation_patch`` passes it a clone.
def layer_pos_patch_setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor) -> torch.Tensor:
    """index (layer, pos): patch one position of a (B, T, ...) activation, every batch row."""
    _, pos = index  # (B, T, ...) activations: the stream, attn_out, mlp_out
    corrupted[:, pos] = clean[:, pos]
    return corrupted


def layer_pos_head_vector_patch_setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor,
                                       ) -> torch.Tensor:
    """index (layer, pos, head): patch one head at one position of a (B, T, heads, hd) activation."""
    _, pos, head = index  # (B, T, heads, hd): q, k, v, z, result
    corrupted[:, pos, head] = clean[:, pos, head]
    return corrupted


def layer_head_vector_patch_setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor,
                                   ) -> torch.Tensor:
    """index (layer, head): patch one head at every position of a (B, T, heads, hd) activation."""
    _, head = index
    corrupted[:, :, head] = clean[:, :, head]
    return corrupted


def layer_head_pattern_patch_setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor,
                                    ) -> torch.Tensor:
    """index (layer, head): patch one head's whole (T, S) pattern (or scores) of (B, nh, T, S)."""
    _, head = index  # (B, nh, T, S): patterns and scores
    corrupted[:, head] = clean[:, head]
    return corrupted


def layer_head_pos_pattern_patch_setter(corrupted: torch.Tensor, index: Sequence[int], clean: torch.Tensor,
                                        ) -> torch.Tensor:
    """index (layer, head, dest): patch one query row of one head's (B, nh, T, S) pattern."""
    _, head, dest = index
    corrupted[:, head, dest] = clean[:, head, dest]
    return corrupted


def layer_head_dest_src_pos_pattern_patch_setter(corrupted: torch.Tensor, index: Sequence[int],
                                                 clean: torch.Tensor) -> torch.Tensor:
    """index (layer, head, dest, src): patch one attention weight of a (B, nh, T, S) pattern."""
    _, head, dest, src = index
    corrupted[:, head, dest, src] = clean[:, head, dest, src]
    return corrupted


# -- the generic sweep --------------------------------------------------------------------------
def _head_axis(name: str, clean: torch.Tensor) -> Optional[int]:
    """Where a cached activation keeps its heads: (B, nh, T, S) patterns and scores at 1,
    (B, T, heads, ·) per-head vectors at 2; None for (B, T, d) activations."""
    if name.endswith(("hook_pattern", "hook_attn_scores")):
        return 1
    return 2 if clean.ndim == 4 else None


def _axis_sizes(model: nn.Module, clean_cache: ActivationCache, activation_name: str, tokens: torch.Tensor,
                ) -> dict[str, int]:
    """The size of each index axis. Heads are counted on the clean activation: key/value-side
    ones (k, v, rot_k, k_input, v_input) have n_kv_heads on a grouped-query model."""
    name = clean_cache.full_name((activation_name, 0))
    clean = clean_cache[name]
    T = tokens.shape[-1]
    sizes = {"layer": model.config.n_layers, "pos": T, "dest_pos": T, "src_pos": T}
    axis = _head_axis(name, clean)
    if axis is not None:
        sizes["head"] = sizes["head_index"] = clean.shape[axis]
    return sizes


def _check_lengths(corrupted_tokens: torch.Tensor, clean_cache: ActivationCache, name: str) -> None:
    clean = clean_cache[name]
    T_clean = clean.shape[-2] if name.endswith(("hook_pattern", "hook_attn_scores")) else clean.shape[1]
    if corrupted_tokens.shape[-1] != T_clean or clean.shape[0] != corrupted_tokens.shape[0]:
        raise InputError(
            f"cannot patch {name!r}: the clean run cached it for {clean.shape[0]} sequence(s) of {T_clean} tokens "
            f"(shape {tuple(clean.shape)}), but the corrupted tokens have shape {tuple(corrupted_tokens.shape)}; "
            f"patching needs prompts of the same length, token for token (pad or rephrase one of them)."
        )


def _as_tokens(model: nn.Module, tokens: Any) -> torch.Tensor:
    from lucidlm.inspect.tokens import id_batch
    return id_batch(model, tokens, "corrupted_tokens")


def _scalar(value: Any) -> float:
    """The patching metric's value for one run: it must be one number."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise InputError(f"patching_metric(logits) must return one number, got a tensor of shape "
                         f"{tuple(value.shape)}; reduce it (e.g. logits[0, -1, a] - logits[0, -1, b]).")
    return float(value)


@keywords_checked(InputError)
def generic_activation_patch(model: nn.Module, corrupted_tokens: TextOrLooseIds, clean_cache: ActivationCache,
                             patching_metric: Metric, patch_setter: Setter, activation_name: str,
                             index_axis_names: Sequence[str]) -> torch.Tensor:
    """For every index over ``index_axis_names`` (the first is the layer), run the corrupted
    tokens with that slice of the clean activation patched in; the metric of each, shaped
    by the axes. ``activation_name`` is a short name ("resid_pre", "z", "pattern", ...)."""
    tokens = _as_tokens(model, corrupted_tokens)
    sizes = _axis_sizes(model, clean_cache, activation_name, tokens)
    unknown = [a for a in index_axis_names if a not in sizes]
    if unknown or index_axis_names[0] != "layer":
        raise InputError(f"index_axis_names={tuple(index_axis_names)}: the first must be 'layer', the others from "
                         f"{sorted(sizes)}.")
    shape = [sizes[a] for a in index_axis_names]
    _check_lengths(tokens, clean_cache, clean_cache.full_name((activation_name, 0)))
    out = torch.zeros(shape)
    with torch.no_grad():
        for index in itertools.product(*(range(n) for n in shape)):
            name = clean_cache.full_name((activation_name, index[0]))
            clean = clean_cache[name]

            def patch(act: torch.Tensor, hook: Any, index: tuple = index, clean: torch.Tensor = clean) -> torch.Tensor:
                return patch_setter(act.clone(), index, clean.to(act.device, act.dtype))
            logits = run_with_hooks(model, tokens, fwd_hooks=[(name, patch)])
            out[index] = _scalar(patching_metric(logits))
    return out


def _sweep(activation_name: str, setter: Setter, axes: Sequence[str], doc: str) -> Callable[..., torch.Tensor]:
    def sweep(model: nn.Module, corrupted_tokens: TextOrLooseIds, clean_cache: ActivationCache, patching_metric: Metric,
              ) -> torch.Tensor:
        return generic_activation_patch(model, corrupted_tokens, clean_cache, patching_metric, setter,
                                        activation_name, axes)
    sweep.__doc__ = f"{doc} Returns ({', '.join(axes)})."
    return sweep


get_act_patch_resid_pre = _sweep("resid_pre", layer_pos_patch_setter, ("layer", "pos"),
                                 "Patch the residual stream entering each block, at each position.")
get_act_patch_resid_mid = _sweep("resid_mid", layer_pos_patch_setter, ("layer", "pos"),
                                 "Patch the residual stream between attention and MLP.")
get_act_patch_attn_out = _sweep("attn_out", layer_pos_patch_setter, ("layer", "pos"),
                                "Patch each attention layer's output, at each position.")
get_act_patch_mlp_out = _sweep("mlp_out", layer_pos_patch_setter, ("layer", "pos"),
                               "Patch each MLP's output, at each position.")
get_act_patch_attn_head_out_by_pos = _sweep("z", layer_pos_head_vector_patch_setter, ("layer", "pos", "head"),
                                            "Patch each head's output (z) at each position.")
get_act_patch_attn_head_q_by_pos = _sweep("q", layer_pos_head_vector_patch_setter, ("layer", "pos", "head"),
                                          "Patch each head's queries at each position.")
get_act_patch_attn_head_k_by_pos = _sweep("k", layer_pos_head_vector_patch_setter, ("layer", "pos", "head"),
                                          "Patch each key/value head's keys at each position.")
get_act_patch_attn_head_v_by_pos = _sweep("v", layer_pos_head_vector_patch_setter, ("layer", "pos", "head"),
                                          "Patch each key/value head's values at each position.")
get_act_patch_attn_head_pattern_by_pos = _sweep("pattern", layer_head_pos_pattern_patch_setter,
                                                ("layer", "head_index", "dest_pos"),
                                                "Patch each head's attention pattern row for each query.")
get_act_patch_attn_head_pattern_dest_src_pos = _sweep(
    "pattern", layer_head_dest_src_pos_pattern_patch_setter, ("layer", "head_index", "dest_pos", "src_pos"),
    "Patch single attention weights.")
get_act_patch_attn_head_out_all_pos = _sweep("z", layer_head_vector_patch_setter, ("layer", "head"),
                                             "Patch each head's output (z) at every position at once.")
get_act_patch_attn_head_q_all_pos = _sweep("q", layer_head_vector_patch_setter, ("layer", "head"),
                                           "Patch each head's queries at every position.")
get_act_patch_attn_head_k_all_pos = _sweep("k", layer_head_vector_patch_setter, ("layer", "head"),
                                           "Patch each key/value head's keys at every position.")
get_act_patch_attn_head_v_all_pos = _sweep("v", layer_head_vector_patch_setter, ("layer", "head"),
                                           "Patch each key/value head's values at every position.")
get_act_patch_attn_head_pattern_all_pos = _sweep("pattern", layer_head_pattern_patch_setter, ("layer", "head_index"),
                                                 "Patch each head's whole attention pattern.")


def _pad_heads(results: torch.Tensor, heads: int) -> torch.Tensor:
    return torch.nn.functional.pad(results, (0, heads - results.shape[-1]))  # k/v of grouped heads


@keywords_checked(InputError)
def get_act_patch_attn_head_all_pos_every(model: nn.Module, corrupted_tokens: TextOrLooseIds,
                                          clean_cache: ActivationCache,
                                          metric: Metric) -> torch.Tensor:
    """(5, layers, heads): z, q, k, v (zero-padded past n_kv heads), pattern, all positions."""
    out = get_act_patch_attn_head_out_all_pos(model, corrupted_tokens, clean_cache, metric)
    rest = [get_act_patch_attn_head_q_all_pos, get_act_patch_attn_head_k_all_pos, get_act_patch_attn_head_v_all_pos,
            get_act_patch_attn_head_pattern_all_pos]
    return torch.stack([out] + [_pad_heads(f(model, corrupted_tokens, clean_cache, metric), out.shape[-1])
                                for f in rest])


@keywords_checked(InputError)
def get_act_patch_attn_head_by_pos_every(model: nn.Module, corrupted_tokens: TextOrLooseIds,
                                         clean_cache: ActivationCache,
                                         metric: Metric) -> torch.Tensor:
    """(5, layers, pos, heads): z, q, k, v (zero-padded past n_kv heads), pattern rows."""
    out = get_act_patch_attn_head_out_by_pos(model, corrupted_tokens, clean_cache, metric)
    parts = [out] + [_pad_heads(f(model, corrupted_tokens, clean_cache, metric), out.shape[-1]) for f in
                     (get_act_patch_attn_head_q_by_pos, get_act_patch_attn_head_k_by_pos,
                      get_act_patch_attn_head_v_by_pos)]
    parts.append(get_act_patch_attn_head_pattern_by_pos(model, corrupted_tokens, clean_cache, metric).transpose(1, 2))
    return torch.stack(parts)


@keywords_checked(InputError)
def get_act_patch_block_every(model: nn.Module, corrupted_tokens: TextOrLooseIds, clean_cache: ActivationCache,
                              metric: Metric) -> torch.Tensor:
    """(3, layers, pos): resid_pre, attn_out, mlp_out."""
    return torch.stack([f(model, corrupted_tokens, clean_cache, metric) for f in
                        (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out)])


# -- attribution patching -------------------------------------------------------------------------
@keywords_checked(InputError)
def attribution_patch(model: nn.Module, clean_cache: ActivationCache, corrupted_tokens: TextOrLooseIds, metric: Metric,
                      activation_name: str, index_axis_names: Sequence[str]) -> torch.Tensor:
    """The first-order estimate of what ``generic_activation_patch`` measures, for every cell
    at once: (clean - corrupted) activation times the metric's gradient on the corrupted run,
    summed over what the index leaves free. Estimates the change of the metric; add
    metric(corrupted logits) to compare with exact patching's values."""
    tokens = _as_tokens(model, corrupted_tokens)
    n_layers = model.config.n_layers
    names = [clean_cache.full_name((activation_name, layer)) for layer in range(n_layers)]
    _check_lengths(tokens, clean_cache, names[0])
    _, corrupted = run_with_cache(model, tokens, names_filter=names, incl_bwd=True, metric=metric)
    model.zero_grad(set_to_none=True)
    head_axis = _head_axis(names[0], clean_cache[names[0]])
    dims = {1: "bhqk", 2: "bthd", None: "btd"}[head_axis]  # the activation's axes
    kept = {("layer", "pos"): "t", ("layer", "pos", "head"): "th", ("layer", "head"): "h",
            ("layer", "head_index"): "h", ("layer", "head_index", "dest_pos"): "hq",
            ("layer", "head_index", "dest_pos", "src_pos"): "hqk"}.get(tuple(index_axis_names))
    if kept is None or not set(kept) <= set(dims):
        raise InputError(f"attribution patching of {activation_name!r} cannot be indexed by {tuple(index_axis_names)}.")
    out = []
    for name in names:
        delta = clean_cache[name].to(corrupted[name].device) - corrupted[name]
        out.append(torch.einsum(f"{dims}->{kept}", delta * corrupted[name + "_grad"]))  # batch and the rest summed
    return torch.stack(out).cpu()


def _attr(activation_name: str, axes: Sequence[str], doc: str) -> Callable[..., torch.Tensor]:
    def approx(model: nn.Module, clean_cache: ActivationCache, corrupted_tokens: TextOrLooseIds,
               metric: Metric) -> torch.Tensor:
        return attribution_patch(model, clean_cache, corrupted_tokens, metric, activation_name, axes)
    approx.__doc__ = f"{doc} The attribution estimate of the change in metric, ({', '.join(axes)})."
    return approx


attr_patch_resid_pre = _attr("resid_pre", ("layer", "pos"), "Residual stream entering each block.")
attr_patch_resid_mid = _attr("resid_mid", ("layer", "pos"), "Residual stream between attention and MLP.")
attr_patch_attn_out = _attr("attn_out", ("layer", "pos"), "Each attention layer's output.")
attr_patch_mlp_out = _attr("mlp_out", ("layer", "pos"), "Each MLP's output.")
attr_patch_attn_head_out_all_pos = _attr("z", ("layer", "head"), "Each head's output (z), all positions.")
attr_patch_attn_head_out_by_pos = _attr("z", ("layer", "pos", "head"), "Each head's output (z) per position.")
attr_patch_attn_head_pattern_all_pos = _attr("pattern", ("layer", "head_index"), "Each head's pattern.")


def _name_generated(namespace: dict[str, Any]) -> None:
    """Give each sweep made by ``_sweep`` / ``_attr`` its public name (it was ``_sweep.<locals>.sweep``
    in tracebacks and reprs) and refuse a misspelt keyword by name, with the closest option."""
    for public, fn in list(namespace.items()):
        if public.startswith(("get_act_patch_", "attr_patch_")) and getattr(fn, "__name__", "") in ("sweep", "approx"):
            fn.__name__ = fn.__qualname__ = public
            namespace[public] = keywords_checked(InputError)(fn)


_name_generated(globals())
