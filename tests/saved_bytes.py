"""What a training step's memory is made of: the tensors autograd keeps for the backward pass."""

from __future__ import annotations

from typing import Any, Callable

import torch


def saved_for_backward(run: Callable[[], Any], model: torch.nn.Module) -> tuple[Any, int]:
    """``run()``'s result and the bytes of the distinct storages autograd saves while it runs
    forward, ``model``'s parameters left out (they are held anyway). Counted, not timed, so
    a test can compare two ways of running the same step exactly."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return result, sum(n for ptr, n in saved.items() if ptr not in params)
