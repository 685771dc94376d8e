"""The names of hook points: TransformerLens's short names (``("pattern", 0)``, ``"embed"``)
turned into full ones, the filters that select hooks, and the error that suggests the name
meant. Shared by the activation cache (``activation_cache.py``), the runners (``cache.py``)
and the plots; ``cache.py`` re-exports these names.
"""

from __future__ import annotations

import difflib
import operator
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from lucidlm.errors import HookError

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
    # TransformerLens's aliases (utils.get_act_name)
    "attn_logits": "attn.hook_attn_scores", "query": "attn.hook_q", "key": "attn.hook_k", "value": "attn.hook_v",
}
# Hook points that exist only once switched on (model/hook_options.py), and the switch.
OPT_IN_HOOKS = {"hook_result": "set_use_attn_result", "hook_q_input": "set_use_split_qkv_input",
                "hook_k_input": "set_use_split_qkv_input", "hook_v_input": "set_use_split_qkv_input",
                "hook_attn_in": "set_use_attn_in", "hook_mlp_in": "set_use_hook_mlp_in"}
# Short names that live outside the blocks; "scale" / "normalized" without a layer are the
# final norm's, as in TransformerLens.
GLOBAL_SHORT_NAMES = {"embed": "hook_embed", "pos_embed": "hook_pos_embed",
                      "scale": "ln_final.hook_scale", "normalized": "ln_final.hook_normalized"}


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


def _unknown_short_name_error(short: str, key: tuple) -> HookError:
    if short in GLOBAL_SHORT_NAMES:
        return HookError(f"cache key {key!r}: {short!r} is not per layer; write cache[{short!r}].")
    close = difflib.get_close_matches(short, list(SHORT_NAMES) + list(GLOBAL_SHORT_NAMES), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return HookError(
        f"cache key {key!r}: unknown short name {short!r}.{hint} Short names are TransformerLens's "
        f"({', '.join(sorted(SHORT_NAMES))} per layer; {', '.join(sorted(GLOBAL_SHORT_NAMES))} without one); "
        f"or give a full hook name from model.hook_points() (like 'blocks.0.attn.hook_pattern')."
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


def as_index(value: Any) -> Optional[int]:
    """``value`` as a plain int when it is a layer or head index: an int, a numpy integer (what
    ``np.unravel_index`` over patching results gives) or a 0-d integer tensor (``results.argmax()``).
    None for a bool (True is not layer 1), a float and anything else."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.ndim or value.dtype == torch.bool)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_layer(layer: Any, n_layers: int) -> int:
    """Layer index as an int, negative counting from the end; HookError naming the valid range."""
    index = as_index(layer)
    if index is None:
        raise HookError(f"layer={layer!r} is not a layer index: give a whole number (0..{n_layers - 1}, "
                        f"negative counting from the end).")
    if not -n_layers <= index < n_layers:
        raise HookError(f"layer={index} is out of range: this model has {n_layers} layers (0..{n_layers - 1}).")
    return index % n_layers


def full_hook_name(key: Union[str, tuple], n_layers: int) -> str:
    """A cache key as a full hook name: ``("pattern", 0)`` -> ``"blocks.0.attn.hook_pattern"``,
    ``"embed"`` -> ``"hook_embed"``; full names pass through."""
    if isinstance(key, str):
        return GLOBAL_SHORT_NAMES.get(key, key)
    if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
        raise HookError(f"cache key {key!r} must be a hook name or a tuple like ('pattern', 0).")
    short, rest = key[0], key[1:]
    if short in GLOBAL_SHORT_NAMES and rest in ((), (None,)):  # ("embed",), ("embed", None): TransformerLens's forms
        return GLOBAL_SHORT_NAMES[short]
    if short not in SHORT_NAMES:
        raise _unknown_short_name_error(short, key)
    if not rest or rest[0] is None:
        raise HookError(f"cache key {key!r}: {short!r} is per layer; write cache[{short!r}, layer].")
    if as_index(rest[0]) is None:
        raise HookError(f"cache key {key!r}: the layer {rest[0]!r} is not a whole number; write "
                        f"cache[{short!r}, layer] with an int layer (0..{n_layers - 1}).")
    layer = check_layer(rest[0], n_layers)
    path = SHORT_NAMES[short]
    if "{sub}" in path:
        sub = rest[1] if len(rest) > 1 else None
        if sub not in ("ln1", "ln2"):
            raise HookError(f"cache key {key!r}: name the norm, e.g. "
                            f"cache[{short!r}, {layer}, 'ln1'] (ln1 or ln2).")
        path = path.format(sub=sub)
    return f"blocks.{layer}.{path}"


__all__ = ["GLOBAL_SHORT_NAMES", "NamesFilter", "OPT_IN_HOOKS", "SHORT_NAMES", "as_index", "check_layer",
           "full_hook_name", "resolve_hook_names", "unknown_hook_error"]
