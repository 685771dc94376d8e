"""``ActivationCache``: what ``run_with_cache`` recorded, by hook name, read-only; it also
answers TransformerLens shorthand (``cache["pattern", 0]``) and offers TransformerLens's
residual-stream analyses (``inspect/resid.py``) as methods.

Kept apart from the runners in ``cache.py`` (which re-exports it): reading a cache does not
need to know how one is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Optional, Union

import torch
from torch import nn

from lucidlm.errors import HookError, InputError
from lucidlm.inspect import resid
from lucidlm.inspect.resid import PosSlice, Stack, Tokens
from lucidlm.inspect.hook_names import full_hook_name, unknown_hook_error


class ActivationCache(Mapping):
    """Activations by hook name, read-only. Also answers TransformerLens shorthand:
    ``cache["pattern", 0]``, ``cache["resid_post", -1]``, ``cache["scale", 2, "ln1"]``,
    ``cache["embed"]``.

    key_slots: for a cache recorded at a KV-cached step (``run_with_cache(..., input_pos=...)``),
    the columns of the attention patterns that hold the cache slots written so far (the
    patterns span every slot, unwritten ones too); None for a pass over a whole sequence."""

    def __init__(self, activations: dict[str, torch.Tensor], model: nn.Module, has_batch_dim: bool = True,
                 key_slots: Optional[slice] = None) -> None:
        self._acts = activations
        self.model = model
        self.has_batch_dim = has_batch_dim
        self.key_slots = key_slots

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
        names = list(self._acts)
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        batch = "" if self.has_batch_dim else ", batch dim removed"
        return f"ActivationCache({_count(len(self))}{batch}: {shown})"

    def _repr_html_(self) -> str:
        """A table of every cached hook with its shape and dtype, for Jupyter."""
        import html

        from lucidlm.display import element_id, scoped_style
        view_id = element_id("cache")
        batch = "with a batch dim" if self.has_batch_dim else "batch dim removed"
        rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{html.escape(str(tuple(act.shape)))}</td>"
                       f"<td>{html.escape(str(act.dtype).removeprefix('torch.'))}</td></tr>"
                       for name, act in self._acts.items())
        style = scoped_style(view_id, {
            "": "font-family: sans-serif; font-size: 13px",
            "table": "border-collapse: collapse",
            "td, th": "font-family: monospace; padding: 1px 8px; border-bottom: 1px solid #eee; text-align: left",
            "caption": "text-align: left; padding-bottom: 4px",
        })
        return (f'<div id="{view_id}" class="lucidlm-cache">{style}<table>'
                f"<caption>ActivationCache: {_count(len(self))}, {batch}</caption>"
                f"<tr><th>hook</th><th>shape</th><th>dtype</th></tr>{rows}</table></div>")

    @property
    def n_layers(self) -> int:
        """The model's number of blocks (what a negative layer in ``cache["resid_post", -1]`` counts from)."""
        return self.model.config.n_layers

    def full_name(self, key: Union[str, tuple]) -> str:
        """``("pattern", 0)`` -> ``"blocks.0.attn.hook_pattern"``; full names pass through."""
        return full_hook_name(key, self.n_layers)

    # -- conveniences --
    def to(self, device: Union[str, torch.device]) -> "ActivationCache":
        """A new cache with every activation moved to ``device`` ("cpu", "cuda", "mps", "auto", a
        ``torch.device``); this one is left as it is. The model is not moved."""
        from lucidlm.devices import resolve_device
        device = resolve_device(device)
        return ActivationCache({k: v.to(device) for k, v in self._acts.items()}, self.model, self.has_batch_dim,
                               self.key_slots)

    def remove_batch_dim(self) -> "ActivationCache":
        """A new cache without the leading batch dim (``(1, T, d)`` -> ``(T, d)``), as
        TransformerLens's; it needs a batch of 1 (``InputError`` otherwise). A cache that has
        none is returned as it is."""
        if not self.has_batch_dim:
            return self
        batch = {v.shape[0] for v in self._acts.values()}
        if batch != {1}:
            raise InputError(f"remove_batch_dim needs a batch of 1, but the cached batch size is {sorted(batch)}.")
        return ActivationCache({k: v[0] for k, v in self._acts.items()}, self.model, has_batch_dim=False,
                               key_slots=self.key_slots)

    # -- residual-stream analyses (TransformerLens's, same numbers; see inspect/resid.py) --
    def accumulated_resid(self, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: PosSlice = None, mlp_input: bool = False, return_labels: bool = False) -> Stack:
        """The stream at each block's input, stacked: (n, [B,] T, d); see resid.accumulated_resid."""
        return resid.accumulated_resid(self, layer, incl_mid, apply_ln, pos_slice, mlp_input, return_labels)

    stack_residual = accumulated_resid

    def decompose_resid(self, layer: Optional[int] = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: PosSlice = None, incl_embeds: bool = True,
                        return_labels: bool = False) -> Stack:
        """The stream at ``layer``'s input split into what wrote it; see resid.decompose_resid."""
        return resid.decompose_resid(self, layer, mlp_input, mode, apply_ln, pos_slice, incl_embeds, return_labels)

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: PosSlice = None, apply_ln: bool = False) -> Stack:
        """Each head's output, (L * nh, [B,] T, d) labelled "L0H0"...; see resid.stack_head_results."""
        return resid.stack_head_results(self, layer, return_labels, incl_remainder, pos_slice, apply_ln)

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: Optional[int] = None, mlp_input: bool = False,
                          pos_slice: PosSlice = None, batch_slice: PosSlice = None, has_batch_dim: bool = True,
                          recompute_ln: bool = False) -> torch.Tensor:
        """Scale a stack by ``layer``'s cached norm scale; see resid.apply_ln_to_stack."""
        return resid.apply_ln_to_stack(self, residual_stack, layer, mlp_input, pos_slice, batch_slice,
                                       has_batch_dim, recompute_ln)

    def logit_attrs(self, residual_stack: torch.Tensor, tokens: Tokens, incorrect_tokens: Optional[Tokens] = None,
                    pos_slice: PosSlice = None, batch_slice: PosSlice = None,
                    has_batch_dim: bool = True) -> torch.Tensor:
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


def _count(n: int) -> str:
    return f"{n} activation" + ("" if n == 1 else "s")


__all__ = ["ActivationCache"]
