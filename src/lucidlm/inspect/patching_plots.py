"""Heatmaps of patching results: layer x position for the residual stream (and attention /
MLP outputs), layer x head for attention heads, and the five-panel "every" sweeps.

Colours are diverging and centred on zero (red: patching in the clean activation raises the
metric, blue: lowers it), so exact and attribution results read the same way.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure

from lucidlm.errors import InputError
from lucidlm.inspect.plots import PathLike, _draw_heatmap, save_figure


def _matrix(results: torch.Tensor, ndim: int, what: str) -> np.ndarray:
    results = torch.as_tensor(results).detach().float().cpu()
    if results.ndim != ndim:
        raise InputError(f"{what} takes patching results with {ndim} dimensions, got shape {tuple(results.shape)}.")
    return results.numpy()


def _limit(matrix: np.ndarray) -> float:
    """The colour scale's half-width, from the finite cells only: a NaN (a normalised metric whose
    clean - corrupt is 0) or an inf would otherwise set the scale for every other cell; those
    cells are drawn in the colour map's "bad" colour."""
    finite = np.abs(matrix[np.isfinite(matrix)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _layer_heatmap(matrix: np.ndarray, columns: Sequence[str], xlabel: str, inches_per_column: float, title: str,
                   metric_label: str, path: Optional[PathLike]) -> Figure:
    """One (layers, columns) heatmap on a zero-centred scale, a row per layer."""
    layers = matrix.shape[0]
    fig = Figure(figsize=(min(3 + inches_per_column * len(columns), 16), min(2 + 0.25 * layers, 14)))
    ax = fig.subplots()
    limit = _limit(matrix)
    image = _draw_heatmap(ax, matrix, [str(i) for i in range(layers)], columns, cmap="RdBu_r", vmin=-limit,
                          vmax=limit)
    fig.colorbar(image, ax=ax, label=metric_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer")
    ax.set_title(title)
    save_figure(fig, path)
    return fig


def plot_patching_layer_pos(results: torch.Tensor, tokens: Optional[Sequence[str]] = None,
                            title: str = "Activation patching: residual stream", metric_label: str = "metric",
                            path: Optional[PathLike] = None) -> Figure:
    """(layers, pos) results, e.g. get_act_patch_resid_pre: a row per layer, a column per token."""
    matrix = _matrix(results, 2, "plot_patching_layer_pos")
    T = matrix.shape[1]
    columns = list(tokens) if tokens is not None else [str(i) for i in range(T)]
    if len(columns) != T:
        raise InputError(f"got {len(columns)} token labels for patching results over {T} positions.")
    return _layer_heatmap(matrix, columns, "position", 0.7, title, metric_label, path)


def plot_patching_layer_head(results: torch.Tensor, title: str = "Activation patching: attention heads",
                             metric_label: str = "metric", path: Optional[PathLike] = None) -> Figure:
    """(layers, heads) results, e.g. get_act_patch_attn_head_out_all_pos."""
    matrix = _matrix(results, 2, "plot_patching_layer_head")
    return _layer_heatmap(matrix, [str(h) for h in range(matrix.shape[1])], "head", 0.45, title, metric_label, path)


def plot_patching_every(results: torch.Tensor, panel_titles: Sequence[str] = ("output (z)", "query", "key", "value",
                                                                                "pattern"),
                        title: str = "Activation patching: every head activation", metric_label: str = "metric",
                        path: Optional[PathLike] = None) -> Figure:
    """(panels, layers, X) results from the *_every sweeps, one heatmap per panel on a shared scale.
    Block sweeps (get_act_patch_block_every) pass panel_titles=("resid_pre", "attn_out", "mlp_out")."""
    matrix = _matrix(results, 3, "plot_patching_every")
    if len(panel_titles) != matrix.shape[0]:
        raise InputError(f"got {len(panel_titles)} panel titles for {matrix.shape[0]} panels of results.")
    panels, layers, width = matrix.shape
    fig = Figure(figsize=(min(2.5 + 0.35 * width, 6) * panels, min(2 + 0.25 * layers, 12)))
    axes = np.atleast_1d(fig.subplots(1, panels, sharey=True))
    limit = _limit(matrix)
    for ax, panel, name in zip(axes, matrix, panel_titles):
        image = _draw_heatmap(ax, panel, [str(i) for i in range(layers)], [str(i) for i in range(width)],
                              cmap="RdBu_r", vmin=-limit, vmax=limit)
        ax.set_title(name)
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=list(axes), label=metric_label)
    fig.suptitle(title)
    save_figure(fig, path)
    return fig
