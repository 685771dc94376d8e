"""The loss curve of a training run as a PNG: per-step training loss (raw and smoothed)
with the periodic train/val evaluations on top.

Draws on a bare matplotlib ``Figure`` with the Agg canvas, so it works headless and never
switches the pyplot backend of the program that calls it.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from lucidlm.errors import InputError
from lucidlm.validation import check_float

__all__ = ["plot_loss_curves", "read_metrics"]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The evaluation records of a ``metrics.jsonl`` file, one dict per line. Lines a killed run
    tore (half-written JSON, NUL bytes, no integer ``step``) are dropped with a note, never a
    traceback, as training's own reader (``training/callbacks.py``) drops them."""
    path = Path(path)
    records, torn = [], []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip(b" \t\r\x00"):
            if raw:
                torn.append(number)
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            step = record["step"]
            if isinstance(step, bool) or not isinstance(step, int):
                raise TypeError(step)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError):
            torn.append(number)
            continue
        records.append(record)
    if torn:
        print(f"note: {path}: dropped {len(torn)} torn line(s) (line {', '.join(map(str, torn[:5]))}), left by a "
              f"run that was killed while writing; the other records are kept.", flush=True)
    return records


def _smooth(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average, debiased like Adam's moments so the start is not pulled to 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


def plot_loss_curves(metrics: Sequence[dict[str, Any]] | str | Path, path: str | Path,
                     step_losses: Optional[Sequence[float]] = None, title: str = "training loss",
                     smoothing: float = 0.9, learning_rates: Optional[Sequence[float]] = None) -> Path:
    """Write the loss curve to ``path`` (PNG) and return the path.

    metrics: records with ``step``, ``train_loss``, ``val_loss`` (or a metrics.jsonl path).
    step_losses: the training loss of every optimizer step, step 1 first (optional).
    smoothing: the weight on the past of the running average drawn over step_losses, in [0, 1).
    learning_rates: the learning rate of every optimizer step; drawn in a panel beside the losses.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # The EMA's debiasing divides by 1 - smoothing**i: 1 would divide by zero, above 1 or below 0 it diverges.
    smoothing = check_float(smoothing, "smoothing", InputError, low=0.0, high=1.0, high_open=True,
                            fix="give the running average's weight on the past, e.g. 0.9 (0: no smoothing)")
    records = read_metrics(metrics) if isinstance(metrics, (str, Path)) else list(metrics)
    fig = Figure(figsize=(12 if learning_rates else 8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    if learning_rates:
        grid = fig.add_gridspec(1, 3)
        ax = fig.add_subplot(grid[0, :2])
        lr_ax = fig.add_subplot(grid[0, 2])
        lr_ax.plot(range(1, len(learning_rates) + 1), learning_rates, color="tab:red", linewidth=1.2)
        lr_ax.set_xlabel("step")
        lr_ax.set_ylabel("learning rate")
        lr_ax.set_title("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        lr_ax.grid(True, alpha=0.3)
    else:
        ax = fig.add_subplot(1, 1, 1)
    if step_losses:
        steps = range(1, len(step_losses) + 1)
        ax.plot(steps, step_losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
        ax.plot(steps, _smooth(step_losses, smoothing), color="tab:blue", linewidth=1.2,
                label=f"train (EMA {smoothing})")
    evals = [r for r in records if "step" in r]
    for key, color, label in (("train_loss", "tab:green", "train (eval)"), ("val_loss", "tab:orange", "val (eval)")):
        points = [(r["step"], r[key]) for r in evals if r.get(key) is not None and math.isfinite(r[key])]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, "o-", color=color, markersize=4, linewidth=1.2, label=label)
    if evals and evals[-1].get("val_loss") is not None:
        last = evals[-1]
        ax.annotate(f"val {last['val_loss']:.3f}", (last["step"], last["val_loss"]),
                    textcoords="offset points", xytext=(-10, 10), ha="right", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(loc="upper right", fontsize=9)
    fig.tight_layout()
    from lucidlm.staging import atomic_write_bytes

    path = Path(path)
    image = io.BytesIO()
    fig.savefig(image, format="png")
    atomic_write_bytes(path, image.getvalue())  # redrawn every evaluation: a full disk keeps the last one whole
    return path
