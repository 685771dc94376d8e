"""The training loop, and only the loop: steps, gradient accumulation, clipping, the
learning-rate schedule, evaluation and checkpoint cadence.

Everything else is handed in (recipes in ``pretrain.py`` / ``finetune.py`` build it): the
model (and ``train_model``, the module a micro-step calls with (ids, targets) to get the
loss: ``step.TrainStep``, compiled and/or under DDP/FSDP), the batches, the
optimizer, a checkpointer and callbacks (progress bar, metrics file and plot, samples).

No step reads a value back from the device: losses stay tensors until every
``log_interval`` steps (or an evaluation), when they are read in one go, so the host
keeps queueing work ahead of a GPU. The next batch is drawn while the forward pass runs.

The ``Callback`` hooks are defined here, beside the ``Trainer`` they are handed. Beside it:
``loop_contract.py`` (the ``TrainResult`` and the ``BatchSource``, re-exported here), ``trainer_state.py`` (what of the loop a checkpoint keeps for an exact resume) and
``divergence.py`` (a NaN/inf loss or weight stops the run before it checkpoints).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from lucidlm import host_memory
from lucidlm.training.distributed import DistributedContext, any_rank
from lucidlm.training.divergence import TrainingDiverged, diverged_message, first_nonfinite, parameters_finite
from lucidlm.training.interrupt import install_interrupt_handler, restore_handlers
from lucidlm.training.kill_points import kill_point
from lucidlm.training.checkpointer import Checkpointer
from lucidlm.training.config import LoopConfig
from lucidlm.training.loop_contract import BatchSource, TrainResult
from lucidlm.training.loss import IGNORE_INDEX, masked_cross_entropy
from lucidlm.training.schedule import get_lr
from lucidlm.training.step import TrainStep
from lucidlm.training.trainer_state import load_trainer_state, trainer_state


class Callback:
    """Hooks the loop calls on the main process; override the ones you need. A callback with
    ``collective = True`` gets ``on_evaluate`` on every rank of a sharded (FSDP) run."""

    def on_fit_start(self, trainer: Trainer) -> None: ...
    def on_log(self, trainer: Trainer, losses: list[float]) -> None: ...
    def on_eval_start(self, trainer: Trainer, batches: int) -> None: ...  # up to this many batches
    def on_eval_batch(self, trainer: Trainer) -> None: ...
    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None: ...
    def on_fit_end(self, trainer: Trainer, result: TrainResult) -> None: ...


class Trainer:
    """The training loop over a model, its batches and optimizer, with ``config`` (a LoopConfig)
    giving steps, accumulation, clipping, schedule and evaluation cadence. ``fit()`` runs it to
    ``config.max_iters`` and returns a TrainResult; the recipes (``pretrain``, ``finetune``)
    build one, so most code never makes a Trainer itself.

        trainer = Trainer(model, data, optimizer, config, checkpointer=ckpt, callbacks=[...])
        result = trainer.fit()   # result.val_loss, result.checkpoint

    ``data`` (a ``BatchSource``) gives ``next()`` -> (x, y) (B, T) on the device, ``prefetch()``,
    ``tokens_per_batch`` and ``eval_batches(split, iters)``; ``train_model(x, y)`` returns the loss
    (default ``TrainStep(model)``)."""

    def __init__(self, model: torch.nn.Module, data: BatchSource, optimizer: torch.optim.Optimizer,
                 config: LoopConfig, *, train_model: Optional[torch.nn.Module] = None,
                 checkpointer: Optional[Checkpointer] = None,
                 callbacks: Sequence[Callback] = (), ctx: Optional[DistributedContext] = None,
                 autocast_dtype: Optional[torch.dtype] = None) -> None:
        self.model, self.data, self.optimizer, self.config = model, data, optimizer, config
        self.train_model = train_model if train_model is not None else TrainStep(model)
        self.checkpointer, self.callbacks = checkpointer, list(callbacks)
        self.ctx = ctx or DistributedContext(device=str(next(model.parameters()).device))
        self.device = torch.device(self.ctx.device)
        self.autocast_dtype = autocast_dtype
        # A source whose micro-batches count different numbers of tokens weighs each by its part of
        # the whole step's tokens (its ``share``, batches.py): it must know which micro-batches make a step.
        set_accumulation = getattr(data, "set_accumulation", None)
        if set_accumulation is not None:
            set_accumulation(config.gradient_accumulation_steps)
        self.step, self.last_eval_step, self.best_val_loss = 0, -1, math.inf
        self.train_losses: list[float] = []
        self.metrics: list[dict[str, Any]] = []
        self._pending: list[torch.Tensor] = []  # losses of steps not yet read back
        # Losses read back but not yet handed to ``on_log``: an evaluation or a checkpoint reads
        # them first (``flush_losses``), and the next ``_log`` still owes them to the callbacks.
        self._unlogged: list[float] = []
        self._stop_requested = False
        # Tokens with a loss that the last evaluation counted, per split: a NaN loss over none is
        # no divergence (estimate_loss). The last checkpoint this run saved (or resumed from) is
        # what a diverged run keeps; ``_checked`` train losses are known finite.
        self.eval_tokens: dict[str, int] = {}
        self.saved_step: Optional[int] = None
        self.saved_path: Optional[Path] = None
        self._checked = 0
        self.train_time, self.tokens_seen = 0.0, 0  # since the last evaluation (tokens/s)
        # Seconds spent in training steps this run, and how many steps: the ETA's rate. No
        # evaluation, sampling or checkpoint time is in it, so the ETA does not jump after one.
        self.step_seconds, self.steps_timed = 0.0, 0

    def seconds_left(self) -> Optional[float]:
        """Training-step time still to go at this run's step rate (None before a step is timed)."""
        if self.steps_timed == 0:
            return None
        return max(self.config.max_iters - self.step, 0) * self.step_seconds / self.steps_timed

    # ------------------------------------------------------------------ schedule
    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step``: linear warmup, then cosine decay to
        ``min_lr`` (``get_lr``), or ``learning_rate`` throughout when ``decay_lr`` is off."""
        cfg = self.config
        if not cfg.decay_lr:
            return cfg.learning_rate
        return get_lr(step, cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr)

    @property
    def learning_rates(self) -> list[float]:
        """The rate of every step taken so far (the schedule is a pure function of the step)."""
        return [self.lr_at(s) for s in range(len(self.train_losses) + len(self._pending))]

    @property
    def tokens_per_step(self) -> int:
        return self.data.tokens_per_batch * self.config.gradient_accumulation_steps * self.ctx.world_size

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns its loss as a device tensor (not read back)."""
        cfg = self.config
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.train_model.train()
        total = torch.zeros((), device=self.device)
        accumulation = cfg.gradient_accumulation_steps
        cuda_graphs = getattr(cfg, "compile", False) and getattr(cfg, "compile_mode", "") == "reduce-overhead"
        for micro_step in range(accumulation):
            if cuda_graphs:  # a new replay may reuse the last one's output memory
                torch.compiler.cudagraph_mark_step_begin()
            # (B, T) each, on the device; a source may add the share of the step's loss that this
            # micro-batch on this rank holds, times accumulation x processes (batches.py): then the
            # step's gradient and ``total`` are the mean over every token the whole step counts.
            x, y, *extra = self.data.next()
            share = extra[0] if extra else 1.0
            last = micro_step == accumulation - 1
            # Under DDP, all-reduce gradients once per step, on the last micro-batch only.
            no_sync = getattr(self.train_model, "no_sync", None)
            sync = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with sync:
                with self.autocast():
                    loss = self.train_model(x, y) / accumulation  # model + masked cross-entropy
                if share != 1.0:  # a Python float: no read-back
                    loss = loss * share
                self.data.prefetch()  # the next batch is read while the device computes
                loss.backward()
            total += loss.detach()
        kill_point("step")  # test seam: gradients computed, weights not yet updated
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._pending.append(total)
        return total

    def flush_losses(self) -> list[float]:
        """Read the pending step losses back (one transfer; averaged over ranks)."""
        if not self._pending:
            return []
        losses = torch.stack(self._pending)
        if self.ctx.enabled:
            torch.distributed.all_reduce(losses)
            losses /= self.ctx.world_size
        values = losses.tolist()
        self._pending.clear()
        self.train_losses.extend(values)
        self._unlogged.extend(values)
        return values

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def estimate_loss(self, iters: int) -> dict[str, float]:
        """Mean loss per counted token over up to ``iters`` batches of each split (the same
        batches every time): what one batch of them all would give, as a training step
        weighs its tokens. A mean of the batches' means would weigh a padded or
        prompt-masked batch's tokens more, and change with --batch-size."""
        self.model.eval()
        shown = self.callbacks if self.ctx.is_main else []
        for callback in shown:
            callback.on_eval_start(self, 2 * iters)
        out = {}
        for split in ("train", "val"):
            total, counted = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
            for x, y in self.data.eval_batches(split, iters):
                with self.autocast():
                    logits = self.model(x)
                n = (y != IGNORE_INDEX).sum()  # tokens with a loss in this batch
                total += masked_cross_entropy(logits, y) * n
                counted += n
                kill_point("eval")  # test seam: in the middle of an evaluation
                for callback in shown:
                    callback.on_eval_batch(self)
            # NaN when these batches count no token (as F.cross_entropy's mean over nothing), not
            # a 0.0 that reads as a perfect model.
            out[split] = float(total / counted)
            self.eval_tokens[split] = int(counted)
        self.model.train()
        return out

    def evaluate(self, iters: int) -> dict[str, Any]:
        """Losses (every rank when the model is sharded, else the main one), then callbacks."""
        record: dict[str, Any] = {}
        if self.ctx.is_main or self.ctx.sharded:
            with torch.random.fork_rng(devices=[]):  # leave the training RNG exactly as it was
                losses = self.estimate_loss(iters)
        # Before any callback: sampling or logging a NaN model is no use, and the checkpoint
        # that follows must not replace the last good one.
        self.check_diverged(losses if (self.ctx.is_main or self.ctx.sharded) else {})
        if self.ctx.is_main or self.ctx.sharded:
            record = {
                "step": self.step, "train_loss": losses["train"], "val_loss": losses["val"],
                "val_ppl": math.exp(min(losses["val"], 50.0)), "lr": self.lr_at(max(self.step - 1, 0)),
                "tokens_per_s": self.tokens_seen / self.train_time if self.train_time > 0 else None,
                "elapsed": time.perf_counter() - self._start, "eval_iters": iters,
            }
            self.best_val_loss = min(self.best_val_loss, losses["val"])
        for callback in self.callbacks:  # a collective one (sampling a sharded model) runs on every rank
            if self.ctx.is_main or (self.ctx.sharded and getattr(callback, "collective", False)):
                callback.on_evaluate(self, record)
        if self.ctx.is_main:
            self.metrics.append(record)
        self.last_eval_step = self.step
        self.train_time, self.tokens_seen = 0.0, 0
        return record

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything besides weights and optimizer that an exact resume needs (trainer_state.py).
        Collective under torchrun: every rank must call it."""
        return trainer_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` saved (step, losses, metrics, RNG states) for an exact resume."""
        load_trainer_state(self, state)

    def save_checkpoint(self) -> Optional[Path]:
        """Write a checkpoint through the checkpointer; its path, or None without a checkpointer
        (and on ranks other than 0). Collective under torchrun."""
        if self.checkpointer is None:
            return None
        path = self.checkpointer.save(self)
        self.saved_step, self.saved_path = self.step, path
        return path

    def check_diverged(self, eval_losses: dict[str, float]) -> None:
        """Raise TrainingDiverged when a training loss since the last check, an evaluation loss over
        counted tokens (``eval_losses``, from ``estimate_loss``) or a weight is NaN or infinite.
        Collective under torchrun: every rank calls it at the same step, and all raise together."""
        self.flush_losses()  # collective: the same (rank-averaged) losses on every rank
        what = None
        bad_step = first_nonfinite(self.train_losses[self._checked:], self._checked)
        if bad_step is not None:
            what = f"the training loss became {bad_step[1]} at step {bad_step[0]}"
        for split, loss in eval_losses.items():
            if what is None and not math.isfinite(loss) and self.eval_tokens.get(split):
                what = f"the {split} loss is {loss}"
        if what is None and not parameters_finite(self.model.parameters()):
            what = "the weights hold NaN or infinite values"
        if any_rank(what is not None, self.ctx):
            what = what or "another process's loss or weights are not finite"
            raise TrainingDiverged(diverged_message(self.step, what, self.saved_step, self.saved_path))
        self._checked = len(self.train_losses)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainResult:
        """Train from the current step to ``config.max_iters``, evaluating and checkpointing every
        ``eval_interval`` steps and once at the end; Ctrl-C (``request_stop``) finishes the step,
        saves and returns. Returns the TrainResult (losses, last evaluation, checkpoint path)."""
        # Every step allocates the logits and their gradient anew: kept in the C heap between
        # steps, they are not faulted in and zeroed again each time (host_memory.py: a third
        # of a large-vocabulary step on CPU). CUDA tensors are not affected.
        with host_memory.keep_freed_memory():
            return self._fit()

    def _fit(self) -> TrainResult:
        cfg, ctx = self.config, self.ctx
        self._start = time.perf_counter()
        interrupted, checkpoint_path = False, None
        if self.step > 0 and self.saved_step is None:  # resumed: its checkpoint is the last good one
            self.saved_step = self.step
        self._checked = len(self.train_losses)  # a resumed run's losses were checked when they were saved
        previous_handler = install_interrupt_handler(self)
        if ctx.is_main:
            for callback in self.callbacks:
                callback.on_fit_start(self)
        try:
            while self.step < cfg.max_iters:
                if self.step % cfg.eval_interval == 0 and self.step != self.last_eval_step:
                    self.evaluate(cfg.eval_iters)
                    checkpoint_path = self.save_checkpoint()
                if any_rank(self._stop_requested, ctx):
                    interrupted = True
                    break
                t0 = time.perf_counter()
                self.train_step()
                if self.step % cfg.log_interval == 0:
                    self._log()
                seconds = time.perf_counter() - t0
                self.train_time += seconds
                self.step_seconds, self.steps_timed = self.step_seconds + seconds, self.steps_timed + 1
                self.tokens_seen += self.tokens_per_step
            if interrupted:
                self.check_diverged({})
                checkpoint_path = self.save_checkpoint()
            elif self.last_eval_step != self.step:
                self.evaluate(cfg.final_eval_iters or cfg.eval_iters)
                checkpoint_path = self.save_checkpoint()
            self._log()
        finally:
            restore_handlers(previous_handler)
        last = self.metrics[-1] if self.metrics else {}
        result = TrainResult(
            step=self.step, train_losses=list(self.train_losses), train_loss=last.get("train_loss"),
            val_loss=last.get("val_loss"), best_val_loss=self.best_val_loss, checkpoint=checkpoint_path,
            interrupted=interrupted, elapsed=time.perf_counter() - self._start, metrics=list(self.metrics))
        if ctx.is_main:
            for callback in self.callbacks:
                callback.on_fit_end(self, result)
        return result

    def _log(self) -> None:
        self.flush_losses()  # collective under torchrun: every rank calls it at the same steps
        losses, self._unlogged = self._unlogged, []  # every step since the last on_log, read back here or before
        if losses and self.ctx.is_main:
            for callback in self.callbacks:
                callback.on_log(self, losses)

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint and return (what Ctrl-C does)."""
        self._stop_requested = True


__all__ = ["Callback", "Trainer", "TrainResult"]
