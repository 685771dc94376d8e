"""How long the examples are, in tokens: the numbers to choose a padding length by (seed
004 prints the median and max and box-plots the truncated tokens), saved beside the loss
plot as ``token_lengths.json`` and ``token_lengths.png`` (a histogram and a box plot)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPORT_NAME = "token_lengths.json"
PLOT_NAME = "token_lengths.png"
PERCENTILES = (50, 90, 95, 99)


def length_stats(lengths: Sequence[int], length: int) -> dict[str, Any]:
    """count, mean, min, percentiles, max, and how many examples ``length`` truncates."""
    values = np.asarray(lengths, dtype=np.float64)
    stats: dict[str, Any] = {"count": int(values.size), "mean": float(values.mean()), "min": int(values.min())}
    for p in PERCENTILES:
        stats[f"p{p}"] = float(np.percentile(values, p))  # linear interpolation, as numpy's default
    over = values > length
    stats.update(max=int(values.max()), length=int(length), truncated=int(over.sum()),
                 truncated_tokens=int((values[over] - length).sum()))
    return stats


def describe(stats: dict[str, Any]) -> str:
    percentiles = ", ".join(f"p{p} {stats[f'p{p}']:.0f}" for p in PERCENTILES)
    return (f"{stats['count']} examples, tokens: mean {stats['mean']:.1f}, min {stats['min']}, {percentiles}, "
            f"max {stats['max']}; length {stats['length']} truncates {stats['truncated']} example(s) "
            f"({stats['truncated_tokens']} tokens)")


def write_length_report(lengths: Sequence[int], length: int, out_dir: str | Path) -> dict[str, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from lucidlm.staging import atomic_write_bytes, atomic_write_text

    out_dir = Path(out_dir)
    stats = length_stats(lengths, length)
    atomic_write_text(out_dir / REPORT_NAME, json.dumps(stats, indent=2) + "\n")  # a failed write keeps the old one
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    hist, box = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    hist.hist(lengths, bins=min(50, max(5, len(set(lengths)))), color="tab:blue", alpha=0.8)
    hist.axvline(length, color="tab:red", linestyle="--", label=f"length {length}")
    hist.set_xlabel("tokens per example")
    hist.set_ylabel("examples")
    hist.set_title(f"{stats['count']} examples, mean {stats['mean']:.1f} tokens")
    hist.legend(fontsize=9)
    box.boxplot(list(lengths), vert=True)
    box.axhline(length, color="tab:red", linestyle="--")
    box.set_ylabel("tokens per example")
    box.set_title(f"{stats['truncated']} truncated")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png")
    atomic_write_bytes(out_dir / PLOT_NAME, image.getvalue())
    return stats
