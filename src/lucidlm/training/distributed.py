"""Data-parallel training under ``torchrun --nproc_per_node N``.

torchrun starts N copies of the program with RANK / LOCAL_RANK / WORLD_SIZE set; each holds
a full model replica, computes gradients on its share of the batch, and DDP averages the
gradients across processes before every optimizer step. Without those variables everything
here is a no-op and training runs in one process.

How ranks get different data: every rank draws the same *global* batch of
``batch_size * world_size`` windows from an identically seeded generator and keeps its own
``batch_size`` rows. The ranks see disjoint data, the generator state is the same on every
rank (one checkpoint restores all of them), and the run equals a single-process run with
``batch_size * world_size`` up to floating-point summation order.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lucidlm.errors import ConfigError


@dataclass
class DistributedContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    strategy: str = "single"  # single | ddp | fsdp

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """FSDP: every rank holds a shard, so collectives (evaluation, saving) need all ranks."""
        return self.strategy == "fsdp"

    @property
    def is_main(self) -> bool:
        """Only this process prints, evaluates and writes files."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch, or the only process: the one that prints a run's summary."""
    return int(os.environ.get("RANK", "0")) == 0


def setup_distributed(device: str, strategy: str = "auto") -> DistributedContext:
    """Join the process group if torchrun launched us; pick this rank's device.
    ``strategy``: auto | ddp (a full replica per rank) | fsdp (FSDP2 shards)."""
    if not launched_by_torchrun():
        return DistributedContext(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        if torch.cuda.device_count() <= local_rank:
            raise ConfigError(
                f"rank {rank} wants GPU {local_rank}, but only {torch.cuda.device_count()} GPU(s) are visible; "
                f"use --nproc_per_node <= the GPU count, or --device cpu."
            )
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
        atexit.register(_destroy_process_group)
    return DistributedContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device,
                              strategy="fsdp" if strategy == "fsdp" else "ddp")



def rank_slice(batch: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """This rank's rows of a global batch (B * world_size, ...) -> (B, ...)."""
    if not ctx.enabled:
        return batch
    per_rank = batch.shape[0] // ctx.world_size
    return batch[ctx.rank * per_rank: (ctx.rank + 1) * per_rank]


def any_rank(flag: bool, ctx: DistributedContext) -> bool:
    """True on every rank if it is true on any (a Ctrl-C seen by one rank stops all of them
    at the same step, so none is left waiting in an all-reduce)."""
    if not ctx.enabled:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item() > 0)


def gather_rng_states(state: torch.Tensor, ctx: DistributedContext) -> list[torch.Tensor]:
    """Every rank's RNG state (a ByteTensor), in rank order, so rank 0 can checkpoint the
    dropout RNG of all ranks. Plain tensors, not all_gather_object: no pickles."""
    if not ctx.enabled:
        return [state]
    local = state.to(ctx.device)
    gathered = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local)
    return [g.cpu() for g in gathered]


def barrier(ctx: DistributedContext) -> None:
    if ctx.enabled:
        dist.barrier()


def cleanup_distributed(ctx: DistributedContext) -> None:
    """The end of a recipe: every rank waits for the others. The process group stays up for
    the next recipe of the same program (a sweep, pre-training then fine-tuning): torchrun's
    rendezvous cannot be joined twice, so a group destroyed here could never be created again
    (a second ``init_process_group`` waits forever). It is destroyed when the program exits."""
    barrier(ctx)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
