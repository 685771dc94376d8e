"""Where training batches come from: random windows of a token stream (pre-training, as
nanoGPT), or whole examples in shuffled epochs (fine-tuning on a JSONL dataset).

Both give the loop the same small interface: ``next()`` -> (inputs, targets, share): this
rank's rows on the device, and the factor that turns the mean loss over this rank's counted
tokens into its part of the mean over the global batch; ``prefetch()`` draws the following
batch while the device works; ``eval_batches(split, iters)``; ``state_dict()`` for an exact
resume. Every rank draws the same *global* batch and keeps its own rows, so N processes
equal one process with an N times larger batch, and one saved state restores all of them.

Why ``share``: DDP and FSDP average the ranks' gradients, and gradient accumulation adds the
micro-batches' losses divided by their number: both weigh every micro-batch alike. When they
count different numbers of tokens (examples of other lengths, masked prompts), that is not
the mean over the step's whole batch that one process with one big batch takes. Scaling rank
r's loss on micro-batch k by ``accumulation * world * tokens_rk / tokens_step`` (the tokens
counted by every rank in every micro-batch of the optimizer step) makes the sum exact; every
rank computes it from the rows the step will draw, which are known in advance, without
communication or a device read-back. The loop divides by ``accumulation``, DDP by ``world``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from lucidlm.errors import CheckpointError, DataError
from lucidlm.training.checkpoint import encode_rng_state
from lucidlm.training.resume_checks import DAMAGED, check_cpu_rng_state
from lucidlm.validation import Fields
from lucidlm.training.distributed import DistributedContext, rank_slice
from lucidlm.training.loss import IGNORE_INDEX


def get_batch(tokens: np.ndarray, batch_size: int, block_size: int, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs (B, T) and next-token targets (B, T), int64."""
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)  # (B,)
    index = starts.numpy()[:, None] + np.arange(block_size + 1)  # (B, T+1)
    windows = torch.from_numpy(tokens[index].astype(np.int64))  # (B, T+1)
    x, y = windows[:, :-1], windows[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


@dataclass
class PaddedBatch:
    """Examples of different lengths as one batch (``pad_batch``): ``ids``, ``attention_mask``
    and next-token ``targets``, each (B, L) int64, with no loss where the target is padding."""

    ids: torch.Tensor  # (B, L) right-padded with pad_id
    attention_mask: torch.Tensor  # (B, L) 1 real, 0 padding
    targets: torch.Tensor  # (B, L) ids shifted left; ignore_index at padding and the last slot


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int, ignore_index: int = -100) -> PaddedBatch:
    """Variable-length examples as one right-padded batch with next-token targets.

    Position t predicts token t + 1, so targets[t] = ids[t + 1]; where that token is padding
    (or does not exist) the target is ``ignore_index`` and contributes no loss.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise DataError("pad_batch needs at least one sequence and no empty sequence.")
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = 1
    targets = torch.full_like(ids, ignore_index)
    targets[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], ignore_index)
    return PaddedBatch(ids, mask, targets)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # pinned memory lets the copy overlap the running kernels
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Prefetching:
    """The prefetch protocol: ``_draw()`` makes one batch; the state saved is the one from
    before the batch held in advance was drawn, so a resume draws it again."""

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        raise NotImplementedError

    def _get_state(self) -> Any:
        raise NotImplementedError

    def _set_state(self, state: Any) -> None:
        raise NotImplementedError

    _held: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None
    _state_before_held: Any = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        if self._held is None:
            self.prefetch()
        batch, self._held = self._held, None
        return batch

    def prefetch(self) -> None:
        if self._held is None:
            self._state_before_held = self._get_state()
            self._held = self._draw()

    def state_dict(self) -> Any:
        return self._state_before_held if self._held is not None else self._get_state()

    def load_state_dict(self, state: Any) -> None:
        self._held = None
        self._set_state(state)


class WindowBatches(Prefetching):
    """``batch_size`` random windows of ``block_size + 1`` tokens per rank (nanoGPT's get_batch)."""

    def __init__(self, train: np.ndarray, val: np.ndarray, batch_size: int, block_size: int, seed: int,
                 ctx: DistributedContext) -> None:
        self.splits = {"train": train, "val": val}
        self.batch_size, self.block_size, self.seed, self.ctx = batch_size, block_size, seed, ctx
        self.device = torch.device(ctx.device)
        self.generator = torch.Generator().manual_seed(seed)  # identical on every rank
        self.tokens_per_batch = batch_size * block_size

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        x, y = get_batch(self.splits["train"], self.batch_size * self.ctx.world_size, self.block_size,
                         self.generator)  # the global batch, (B * world, T)
        # Every window counts all its tokens: each rank's share of the global mean is equal.
        return to_device(rank_slice(x, self.ctx), self.device), to_device(rank_slice(y, self.ctx), self.device), 1.0

    def _get_state(self) -> str:
        return encode_rng_state(self.generator.get_state())

    def _set_state(self, state: str) -> None:
        self.generator.set_state(check_cpu_rng_state(state, "trainer_state.json", "data"))

    def eval_batches(self, split: str, iters: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same ``iters`` global batches at every evaluation, from their own generator."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        for _ in range(iters):
            x, y = get_batch(self.splits[split], self.batch_size * self.ctx.world_size, self.block_size, generator)
            yield to_device(x, self.device), to_device(y, self.device)


def fit_batch_to_examples(examples: int, batch_size: int, accumulation: int, world_size: int) -> tuple[int, int]:
    """(batch size, accumulation) for a training split of ``examples``: the ones asked for, made
    smaller when one optimizer step (batch size x accumulation x processes rows) would be larger
    than the split. Else the epoch's order would wrap inside the step and count some examples
    two or three times in its mean (3 examples, --batch-size 8: rows 1 0 2 1 0 2 1 0), where one
    pass over the data (a torch DataLoader's batch) counts each once. The micro-batch shrinks
    first, then the accumulation. DataError when there are fewer examples than processes."""
    if examples < world_size:
        raise DataError(f"the training split holds {examples} example(s), fewer than the {world_size} processes, "
                        f"each of which needs one; add examples, lower --val-fraction, or run fewer processes.")
    batch = min(batch_size, examples // world_size)
    return batch, min(accumulation, examples // (batch * world_size))


class ExampleBatches(Prefetching):
    """Whole examples (already padded to one length) in shuffled epochs.

    ``ids`` (N, L) and ``targets`` (N, L) with IGNORE_INDEX where no loss counts (padding,
    and the prompt when it is masked). Epoch e visits the examples in the order of a
    permutation seeded by (seed, e); a last partial batch wraps to the epoch's start (the
    recipe keeps a step no larger than the split, ``fit_batch_to_examples``, so a batch never
    holds an example twice within an epoch).

    Micro-batch i (counted from the run's start) is a pure function of i, and optimizer step s
    is micro-batches s * accumulation to (s + 1) * accumulation - 1, so when a micro-batch is
    drawn the tokens of its whole step are known: ``share`` weighs every one of them alike.
    """

    def __init__(self, train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
                 batch_size: int, seed: int, ctx: DistributedContext, accumulation: int = 1) -> None:
        self.splits = {"train": train, "val": val}
        self.batch_size, self.seed, self.ctx = batch_size, seed, ctx
        self.device = torch.device(ctx.device)
        self.global_batch = batch_size * ctx.world_size
        self.steps_per_epoch = max(1, math.ceil(len(train[0]) / self.global_batch))  # micro-batches
        self.tokens_per_batch = batch_size * train[0].shape[1]
        self.epoch, self.position = 0, 0  # position: micro-batches done in this epoch
        self._order = self._permutation(0)
        self._counted = (train[1] != IGNORE_INDEX).sum(dim=1)  # (N,) tokens with a loss, per example
        self.accumulation = 1
        self._step_tokens = (-1, 0)  # (first micro-batch of a step, tokens counted in the whole step)
        self.set_accumulation(accumulation)

    def set_accumulation(self, accumulation: int) -> None:
        """How many micro-batches make one optimizer step (the loop's setting: ``Trainer`` calls
        this), so that ``share`` weighs every counted token of a step alike."""
        if not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(f"accumulation must be a positive integer, not {accumulation!r}")
        if accumulation != self.accumulation:
            self.load_state_dict(self.state_dict())  # a batch held in advance was weighed for the old grouping
            self.accumulation, self._step_tokens = accumulation, (-1, 0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.splits["train"][0]), generator=generator)

    def _rows(self, index: int) -> torch.Tensor:
        """The examples of micro-batch ``index`` (counted from the run's start): (B * world,) rows."""
        epoch, position = divmod(index, self.steps_per_epoch)
        order = self._order if epoch == self.epoch else self._permutation(epoch)  # a step may span epochs
        start = position * self.global_batch
        return order[torch.arange(start, start + self.global_batch) % len(order)]

    def _tokens_in_step(self, index: int) -> int:
        """Tokens with a loss in every global micro-batch of the optimizer step ``index`` is in."""
        first = index - index % self.accumulation
        if self._step_tokens[0] != first:  # counted at the step's first draw; its others reuse it
            total = sum(int(self._counted[self._rows(i)].sum()) for i in range(first, first + self.accumulation))
            self._step_tokens = (first, total)
        return self._step_tokens[1]

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        index = self.epoch * self.steps_per_epoch + self.position  # micro-batches drawn since the run began
        rows = self._rows(index)  # (B * world,)
        share = 1.0
        if self.ctx.enabled or self.accumulation > 1:  # counted on the CPU: nothing is read back from a device
            mine = int(rank_slice(self._counted[rows], self.ctx).sum())
            share = self.accumulation * self.ctx.world_size * mine / max(self._tokens_in_step(index), 1)
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        ids, targets = self.splits["train"]
        return (to_device(rank_slice(ids[rows], self.ctx), self.device),
                to_device(rank_slice(targets[rows], self.ctx), self.device), share)

    def _get_state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def _set_state(self, state: dict[str, int]) -> None:
        fields = Fields(state, "trainer_state.json", CheckpointError, where="data", fix=DAMAGED)
        self.epoch, self.position = fields.int("epoch", low=0), fields.int("position", low=0,
                                                                           high=self.steps_per_epoch - 1)
        self._order = self._permutation(self.epoch)

    def eval_batches(self, split: str, iters: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``iters`` global batches of the split, in order (all of it if it is smaller)."""
        ids, targets = self.splits[split]
        for i in range(min(iters, math.ceil(len(ids) / self.global_batch))):
            rows = slice(i * self.global_batch, (i + 1) * self.global_batch)
            yield to_device(ids[rows], self.device), to_device(targets[rows], self.device)


__all__ = ["ExampleBatches", "IGNORE_INDEX", "PaddedBatch", "WindowBatches", "fit_batch_to_examples", "get_batch",
           "pad_batch"]
