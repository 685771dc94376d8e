"""The loop's own part of a checkpoint (``trainer_state.json``): everything besides weights
and optimizer that an exact resume needs - step, best validation loss, the losses so far,
the batch source's position and every rank's RNG state.

Kept apart from ``loop.py`` because it is about what a resume restores, not how a step runs;
``Trainer.state_dict`` / ``Trainer.load_state_dict`` call these two functions. The file is
written by ``checkpointer.py`` and checked field by field by ``resume_checks.py`` before it
reaches ``load_trainer_state``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lucidlm.training.distributed import gather_rng_states


def trainer_state(trainer: Any) -> dict[str, Any]:
    """The state of ``trainer`` (a ``loop.Trainer``) as JSON-ready values. Collective under
    torchrun (every rank's dropout RNG is gathered): every rank must call it."""
    trainer.flush_losses()
    from lucidlm.training.checkpoint import encode_rng_state

    torch_states = gather_rng_states(torch.get_rng_state(), trainer.ctx)
    from lucidlm.training.resume_checks import TRAINER_STATE_FORMAT

    state = {
        "format_version": TRAINER_STATE_FORMAT,
        "step": trainer.step, "last_eval_step": trainer.last_eval_step, "world_size": trainer.ctx.world_size,
        "best_val_loss": trainer.best_val_loss if math.isfinite(trainer.best_val_loss) else None,
        "train_losses": trainer.train_losses, "data": trainer.data.state_dict(),
        "torch_rng": [encode_rng_state(s) for s in torch_states], "torch_version": torch.__version__,
    }
    if trainer.device.type == "cuda":
        cuda_states = gather_rng_states(torch.cuda.get_rng_state(trainer.device), trainer.ctx)
        state["cuda_rng"] = [encode_rng_state(s) for s in cuda_states]
    return state


def load_trainer_state(trainer: Any, state: dict[str, Any]) -> None:
    """Put ``trainer`` (and this rank's RNGs) back where ``state`` was saved."""
    from lucidlm.errors import CheckpointError
    from lucidlm.training.checkpoint import decode_rng_state
    from lucidlm.training.resume_checks import DAMAGED

    trainer.step, trainer.last_eval_step = int(state["step"]), int(state.get("last_eval_step", -1))
    best = state.get("best_val_loss")
    trainer.best_val_loss = math.inf if best is None else float(best)
    trainer.train_losses = [float(x) for x in state.get("train_losses", [])][: trainer.step]
    trainer.data.load_state_dict(state["data"])
    # One dropout RNG state per saved rank; a rank the saved run did not have (a resume with
    # more processes, setup.check_same_settings) keeps its fresh seed.
    rank = trainer.ctx.rank
    if rank < len(state["torch_rng"]):
        torch.set_rng_state(decode_rng_state(state["torch_rng"][rank]))  # checked when read
    if trainer.device.type == "cuda" and rank < len(state.get("cuda_rng") or []):
        try:
            torch.cuda.set_rng_state(decode_rng_state(state["cuda_rng"][rank]), trainer.device)
        except (RuntimeError, IndexError) as exc:
            raise CheckpointError(f"trainer_state.json: field 'cuda_rng' is not a CUDA RNG state of this "
                                  f"device ({exc}); {DAMAGED}.") from None


__all__ = ["load_trainer_state", "trainer_state"]
