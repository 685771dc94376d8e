"""Pictures of what the model does: attention heatmaps, position encodings, RoPE angles, logit lens.

Every function returns a matplotlib ``Figure`` (built without pyplot, so nothing opens a
window and nothing global is left behind) and, given ``path``, saves it as both
``path.png`` and ``path.svg``. Seed 004's ``plot_attention_weight_matrix`` and
``plot_position_encodings`` are the models for the first two.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from matplotlib.figure import Figure

from lucidlm.errors import HookError, InputError
from lucidlm.validation import MAX_CONTEXT, MAX_WIDTH, check_float, check_int
from lucidlm.inspect.cache import ActivationCache, check_layer, token_columns
from lucidlm.inspect.hook_names import as_index
from lucidlm.inspect.logit_lens import LogitLens
from lucidlm.model.positions import rope_angles, sinusoidal_table

PathLike = Union[str, Path]


def save_figure(fig: Figure, path: Optional[PathLike]) -> list[Path]:
    """Write ``path.png`` and ``path.svg``; returns the files written. The suffixes are added to
    the whole name ("figs/L0.H1" -> "figs/L0.H1.png"), so a dot inside a name never makes two
    figures share a file; a path already ending in .png or .svg has that suffix swapped."""
    if path is None:
        return []
    from lucidlm.staging import atomic_write_bytes

    path = Path(path)
    base = path.with_suffix("") if path.suffix.lower() in (".png", ".svg") else path
    written = []
    for suffix in (".png", ".svg"):
        target = base.with_name(base.name + suffix)
        image = io.BytesIO()
        fig.savefig(image, format=suffix[1:], dpi=120, bbox_inches="tight")
        atomic_write_bytes(target, image.getvalue())  # a full disk keeps the earlier figure whole
        written.append(target)
    return written


def attention_pattern(pattern_or_cache: Union[ActivationCache, torch.Tensor], layer: int, head: int,
                      batch: int = 0) -> np.ndarray:
    """One head's (T, T) attention pattern, from a cache or a (B,) nh, T, S tensor: the weights
    on the sequence's tokens (a prefix's keys, S - T of them first, left out: ``token_columns``).
    A cache of a KV-cached step gives (T_new, slots written so far)."""
    if isinstance(pattern_or_cache, ActivationCache):
        layer = check_layer(layer, pattern_or_cache.n_layers)
        pattern = pattern_or_cache["pattern", layer]
        if pattern_or_cache.has_batch_dim:
            pattern = pattern[batch]
    else:
        pattern = pattern_or_cache
        if pattern.ndim == 4:
            pattern = pattern[batch]
    if pattern.ndim != 3:
        raise HookError(f"expected an attention pattern of shape (n_heads, T, S), got {tuple(pattern.shape)}.")
    n_heads = pattern.shape[0]
    index = as_index(head)  # an int, a numpy integer or a 0-d tensor (argmax over patching results)
    if index is None:
        raise HookError(f"head={head!r} is not a head index: give a whole number (0..{n_heads - 1}).")
    if not -n_heads <= index < n_heads:
        raise HookError(f"head={index} is out of range: layer {layer} has {n_heads} heads (0..{n_heads - 1}).")
    key_slots = pattern_or_cache.key_slots if isinstance(pattern_or_cache, ActivationCache) else None
    return token_columns(pattern[index], key_slots).float().cpu().numpy()


def _draw_heatmap(ax: Any, matrix: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str],
                  cmap: str = "Blues", vmin: float = 0.0, vmax: float = 1.0, fontsize: int = 8) -> Any:
    image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    if len(col_labels) <= 64:
        ax.set_xticks(range(len(col_labels)), [_label(t) for t in col_labels], rotation=90, fontsize=fontsize)
    if len(row_labels) <= 64:
        ax.set_yticks(range(len(row_labels)), [_label(t) for t in row_labels], fontsize=fontsize)
    return image


def _label(token: str) -> str:
    """Make whitespace visible on a tick label: a leading space is a different token."""
    return token.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t") or "∅"


def _tokens_or_positions(tokens: Optional[Sequence[str]], n: int) -> list[str]:
    """One label per key position (a KV-cached step's keys are every token so far; its queries
    are the last of them), else the positions' numbers."""
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = list(tokens)
    if len(tokens) != n:
        raise HookError(f"got {len(tokens)} token labels for an attention pattern over {n} positions; "
                        f"give one label per key position.")
    return tokens


def plot_attention(pattern_or_cache: Union[ActivationCache, torch.Tensor], layer: int, head: int,
                   tokens: Optional[Sequence[str]] = None, path: Optional[PathLike] = None,
                   title: Optional[str] = None) -> Figure:
    """Heatmap of one head: row = query (the token attending), column = key (attended to)."""
    matrix = attention_pattern(pattern_or_cache, layer, head)
    T, S = matrix.shape
    key_tokens = _tokens_or_positions(tokens, S)
    query_tokens = key_tokens[-T:]  # the queries are the last T keys
    size = min(4 + 0.3 * S, 16)
    fig = Figure(figsize=(size + 1.5, min(3 + 0.3 * T, 14)))
    ax = fig.subplots()
    image = _draw_heatmap(ax, matrix, query_tokens, key_tokens)
    fig.colorbar(image, ax=ax, label="attention weight")
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    layer_index = as_index(layer)  # "layer 1", not "layer tensor(1)"; a bare pattern's layer is only a label
    ax.set_title(title or f"Attention pattern, layer {layer if layer_index is None else layer_index}, "
                          f"head {as_index(head)}")
    save_figure(fig, path)
    return fig


def plot_attention_heads(cache: ActivationCache, layer: int, tokens: Optional[Sequence[str]] = None,
                         path: Optional[PathLike] = None) -> Figure:
    """A grid with every head of one layer."""
    layer = check_layer(layer, cache.n_layers)
    n_heads = cache["pattern", layer].shape[-3]
    cols = math.ceil(math.sqrt(n_heads))
    rows = math.ceil(n_heads / cols)
    fig = Figure(figsize=(3.2 * cols + 1, 3.2 * rows + 0.6))
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    image = None
    for head, ax in enumerate(axes):
        if head >= n_heads:
            ax.axis("off")
            continue
        matrix = attention_pattern(cache, layer, head)
        labels = _tokens_or_positions(tokens, matrix.shape[1])
        show = labels if len(labels) <= 24 else [""] * len(labels)
        image = _draw_heatmap(ax, matrix, show[-matrix.shape[0]:], show, fontsize=6)
        ax.set_title(f"head {head}", fontsize=9)
    fig.suptitle(f"Attention patterns, layer {layer}")
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.6, label="attention weight")
    save_figure(fig, path)
    return fig


def plot_position_encodings(P: Optional[Union[torch.Tensor, np.ndarray]] = None, max_seq_len: int = 64,
                            d_model: int = 128, path: Optional[PathLike] = None) -> Figure:
    """The sinusoidal position matrix (positions x embedding dims), as seed 004 draws it.
    With no P, the table for ``max_seq_len`` x ``d_model`` is built."""
    if P is None:
        check_int(max_seq_len, "max_seq_len", InputError, low=1, high=MAX_CONTEXT)
        check_int(d_model, "d_model", InputError, low=2, high=MAX_WIDTH)
        if d_model % 2:
            raise InputError(f"d_model={d_model} is odd; sinusoidal positions fill dimensions in (sin, cos) "
                             f"pairs, so give an even d_model.")
    P = sinusoidal_table(max_seq_len, d_model) if P is None else P
    P = P.detach().cpu().numpy() if isinstance(P, torch.Tensor) else np.asarray(P)
    n_positions, dims = P.shape
    fig = Figure(figsize=(12, min(8, max(3, n_positions / 4))))
    ax = fig.subplots()
    image = ax.imshow(P, aspect="auto", cmap="Blues_r", interpolation="nearest")
    fig.colorbar(image, ax=ax)
    if dims <= 64:
        ax.set_xticks(range(dims))
    if n_positions <= 32:
        ax.set_yticks(range(n_positions))
    ax.set_xlabel("Embedding index")
    ax.set_ylabel("Position index")
    ax.set_title("Sinusoidal position encodings")
    save_figure(fig, path)
    return fig


def plot_rope_angles(head_dim: int = 64, max_seq_len: int = 128, theta: float = 10000.0,
                     path: Optional[PathLike] = None) -> Figure:
    """RoPE turns each (query, key) dimension pair i by the angle m * theta^(-2i/d) at position m.
    Left: cos of that angle per position and pair (fast pairs flicker, slow ones barely move).
    Right: each pair's wavelength in tokens, which grows geometrically up to ~2*pi*theta."""
    check_int(head_dim, "head_dim", InputError, low=2, high=MAX_WIDTH)
    if head_dim % 2:
        raise InputError(f"head_dim={head_dim} is odd; RoPE turns dimensions in pairs, so give an even head_dim.")
    check_int(max_seq_len, "max_seq_len", InputError, low=1, high=MAX_CONTEXT)
    check_float(theta, "theta", InputError, low=1.0, low_open=True)
    angles = rope_angles(max_seq_len, head_dim, theta).numpy()  # (S, hd/2)
    wavelengths = 2 * np.pi / (angles[1] if max_seq_len > 1 else rope_angles(2, head_dim, theta).numpy()[1])
    fig = Figure(figsize=(13, 5))
    left, right = fig.subplots(1, 2, width_ratios=[2, 1])
    image = left.imshow(np.cos(angles), aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=left, label="cos(m · θ_i)")
    left.set_xlabel("dimension pair i")
    left.set_ylabel("position m")
    left.set_title(f"RoPE rotation angles (head_dim={head_dim}, θ={theta:g})")
    right.semilogy(range(len(wavelengths)), wavelengths, marker=".")
    right.axhline(max_seq_len, color="grey", linestyle="--", label=f"positions shown ({max_seq_len})")
    right.set_xlabel("dimension pair i")
    right.set_ylabel("wavelength (tokens)")
    right.set_title("One full turn takes")
    right.legend(fontsize=8)
    save_figure(fig, path)
    return fig


def plot_logit_lens(lens: LogitLens, path: Optional[PathLike] = None) -> Figure:
    """Logit-lens table: rows are layers, columns positions, colour the top token's
    probability, text the top token. ``lens`` is a ``LogitLens`` from ``logit_lens()``."""
    if not hasattr(lens, "top_probs"):
        raise InputError(f"plot_logit_lens takes what logit_lens(model, text) returns, got {type(lens).__name__}.")
    probs = lens.top_probs[:, :, 0].float().cpu().numpy()  # (L+1, T)
    n_rows, T = probs.shape
    fig = Figure(figsize=(min(3 + 1.0 * T, 24), min(1.5 + 0.35 * n_rows, 16)))
    ax = fig.subplots()
    image = _draw_heatmap(ax, probs, lens.layer_labels, lens.input_tokens, cmap="viridis", fontsize=7)
    if T * n_rows <= 1200:
        for l in range(n_rows):
            for t in range(T):
                ax.text(t, l, _label(lens.top_tokens[l][t][0])[:8], ha="center", va="center", fontsize=6,
                        color="white" if probs[l, t] < 0.6 else "black")
    fig.colorbar(image, ax=ax, label="probability of the top token")
    ax.set_xlabel("input position (token)")
    ax.set_ylabel("residual stream after block")
    ax.set_title("Logit lens: top next-token guess read off every layer")
    save_figure(fig, path)
    return fig
