"""What a run shows and records, as loop callbacks (main process only; under FSDP the
sampler runs on every rank, which decode together).

- ``Sampler``      at each evaluation, continues a prompt with the sampling settings given
                   (temperature, top-p, seed) for its full token count, sliding the context
                   window past the model's; with a ``base`` context, the base model too
- ``MetricsLog``   OUT/metrics.jsonl (one record per evaluation) and OUT/loss.png (losses
                   beside the learning-rate curve)
- ``Console``      the progress bar (its ETA from training-step time only), evaluation
                   progress, the printed evaluation lines, a schedule that ends early, and
                   on Ctrl-C the command that continues the run
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lucidlm.inspect import loss_plot
from lucidlm.staging import atomic_write_text
from lucidlm.training.kill_points import kill_point
from lucidlm.training.loop import Callback, Trainer, TrainResult
from lucidlm.training.step import unsharded

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


class Sampler(Callback):
    """Adds ``sample`` (and ``base_sample``) to each evaluation record.

    ``base``: a context manager factory under which the model is the untuned base (e.g.
    ``peft.disable_adapters``); the base sample is taken once and shown beside each tuned one.
    """

    collective = True  # under FSDP every rank runs it: the ranks decode in step, rank 0 records

    def __init__(self, prompt_ids: Sequence[int], tokens: int, tokenizer: Any, temperature: float = 0.0,
                 top_p: Optional[float] = None, seed: int = 0,
                 base: Optional[Callable[[], contextlib.AbstractContextManager]] = None) -> None:
        self.prompt_ids, self.tokens, self.tokenizer = list(prompt_ids), tokens, tokenizer
        self.settings = dict(temperature=temperature, top_p=top_p, seed=seed)
        self.base, self.base_text = base, None

    def sample(self, model: torch.nn.Module) -> str:
        from lucidlm.generation import generate

        model.eval()
        try:
            with torch.random.fork_rng(devices=[]):
                # "crop": past the context each token comes from the last max_seq_len tokens, as
                # nanoGPT's generate, so a sample has its --sample-tokens tokens (or ends at EOS)
                result = generate(model, self.prompt_ids, max_new_tokens=self.tokens, context_overflow="crop",
                                  **self.settings)
        finally:
            clear = getattr(model, "clear_kv_cache", None)
            if clear is not None:
                clear()
            model.train()
        # Decode prompt and continuation together: word tokens need the spaces between them.
        return self.tokenizer.decode(self.prompt_ids + list(result.token_ids))

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.tokens <= 0:
            return
        with unsharded(trainer.model, trainer.ctx):  # FSDP: each rank gathers the whole model
            if self.base is not None and self.base_text is None:
                with self.base():
                    self.base_text = self.sample(trainer.model)
            record["sample"] = self.sample(trainer.model)
        if self.base_text is not None:
            record["base_sample"] = self.base_text


class MetricsLog(Callback):
    """OUT/metrics.jsonl, one JSON line per evaluation, appended with a single write and
    fsynced, so a kill leaves at most one torn last line, which the next run drops."""

    def __init__(self, out_dir: Path, title: str) -> None:
        self.path, self.plot, self.title = Path(out_dir) / METRICS_NAME, Path(out_dir) / PLOT_NAME, title

    def on_fit_start(self, trainer: Trainer) -> None:
        """Keep the records of the evaluations the checkpoint knows (a run killed after an
        evaluation but before its checkpoint wrote lines its resume writes again; a new run
        keeps none), and drop a line torn by a kill."""
        kept = read_metrics(self.path, trainer.last_eval_step) if self.path.is_file() else []
        if self.path.is_file():  # a kill or a full disk now keeps either the old file or the new one
            atomic_write_text(self.path, "".join(json.dumps(record) + "\n" for record in kept))
        trainer.metrics = kept

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            kill_point("metrics", lambda: os.write(fd, line[: len(line) // 2]))  # test seam: a torn line
            written = os.write(fd, line)  # one write: the line lands whole or (killed) not at all
            while written < len(line):
                written += os.write(fd, line[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        trainer.flush_losses()
        loss_plot.plot_loss_curves([*trainer.metrics, record], self.plot, trainer.train_losses, title=self.title,
                         learning_rates=trainer.learning_rates)


def read_metrics(path: Path, last_step: int) -> list[dict[str, Any]]:
    """The records of ``path`` with step <= ``last_step``; lines a kill tore (half-written JSON,
    NUL bytes) are dropped with a note, never a traceback (``inspect.loss_plot.read_metrics``)."""
    return [record for record in loss_plot.read_metrics(path) if record["step"] <= last_step]


class Console(Callback):
    """A tqdm bar (when stderr is a terminal) and one printed line per evaluation.

    ``resume_command``: the command that continues this run, shown after Ctrl-C. ``quiet``: no
    header, bars, evaluation lines or samples; warnings and the Ctrl-C line still show.
    """

    BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # no tqdm ETA

    def __init__(self, progress: bool, header: str = "", resume_command: Optional[str] = None,
                 quiet: bool = False) -> None:
        self.progress, self.header, self.resume_command = progress and not quiet, header, resume_command
        self.quiet = quiet
        self.bar, self.eval_bar = None, None

    def report(self, message: str) -> None:
        """A line of the run's progress (the header, an evaluation), which ``quiet`` leaves out."""
        if not self.quiet:
            self.print(message)

    def print(self, message: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def on_fit_start(self, trainer: Trainer) -> None:
        from tqdm.auto import tqdm

        from lucidlm.training.schedule import schedule_warning
        from lucidlm.training.setup import precision_warning

        if self.header:
            self.report(self.header + (f", resuming at step {trainer.step}" if trainer.step else ""))
        # tqdm's own ETA divides by wall time, evaluations included; ours counts training steps only.
        self.bar = tqdm(total=trainer.config.max_iters, initial=trainer.step, desc="train", dynamic_ncols=True,
                        bar_format=self.BAR_FORMAT, disable=not (self.progress and sys.stderr.isatty()))
        if trainer.step < trainer.config.max_iters:
            for warning in (precision_warning(trainer.autocast_dtype, trainer.device),
                            schedule_warning(trainer.config)):
                if warning:
                    self.print(warning)

    def on_eval_start(self, trainer: Trainer, batches: int) -> None:
        if self.bar is not None and not self.bar.disable:
            from tqdm.auto import tqdm

            self.eval_bar = tqdm(total=batches, desc=f"evaluating at step {trainer.step}", leave=False,
                                 dynamic_ncols=True)
        else:  # no live bar: say what the wait is, once
            self.report(f"evaluating at step {trainer.step} (up to {batches} batches)...")

    def on_eval_batch(self, trainer: Trainer) -> None:
        if self.eval_bar is not None:
            self.eval_bar.update(1)

    def on_log(self, trainer: Trainer, losses: list[float]) -> None:
        self.bar.update(len(losses))
        rate = trainer.tokens_seen / max(trainer.train_time, 1e-9)
        left = trainer.seconds_left()
        self.bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{trainer.lr_at(trainer.step - 1):.2e}",
                             tok_s=f"{rate:,.0f}", eta="?" if left is None else format_seconds(left), refresh=False)

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None
        speed = f", {record['tokens_per_s']:,.0f} tok/s" if record.get("tokens_per_s") else ""
        left = trainer.seconds_left()
        eta = f", eta {format_seconds(left)}" if left is not None and trainer.step < trainer.config.max_iters else ""
        if math.isnan(record["val_loss"]) and not trainer.eval_tokens.get("val"):  # a mean over no token
            val = "n/a (no token with a loss in the val batches)"
        elif not math.isfinite(record["val_loss"]):  # the loop stops a diverged run before this (divergence.py)
            val = f"{record['val_loss']} (diverged)"
        else:
            val = f"{record['val_loss']:.4f} (ppl {record['val_ppl']:.2f})"
        self.report(f"step {record['step']}: train loss {record['train_loss']:.4f}, val loss {val}{speed}{eta}")
        if record.get("sample"):
            self.report(f"  sample: {record['sample'][:200]!r}")
        if record.get("base_sample"):
            self.report(f"  base model (adapter off): {record['base_sample'][:200]!r}")

    def on_fit_end(self, trainer: Trainer, result: TrainResult) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.eval_bar is not None:
            self.eval_bar.close()
        if result.interrupted:
            again = self.resume_command or "the same command with --resume"
            self.print(f"interrupted: saved a checkpoint at step {result.step} in {result.checkpoint}; continue "
                       f"with:\n  {again}")


def format_seconds(seconds: float) -> str:
    """1:02:03 / 4:05 (h:mm:ss or m:ss), as a countdown reads."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
