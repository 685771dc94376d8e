"""Finite weights or a clear refusal: NaN / inf in a weight file is found at load time.

A NaN weight does not fail loudly: greedy decoding prints one token forever, sampling crashes
deep inside ``torch.multinomial``, a merge writes a NaN model. So every loader hands the
tensors it read to a ``FiniteCheck`` under the file's own tensor names. Each ``add`` queues
a finiteness flag computed on the device (no read-back); ``verify`` stacks the flags and reads
them back once, so the cost is one reduction over the values and one device sync per file,
nothing in the model's forward pass. Only on a failure are the bad values counted, for the message.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Mapping, Type, Union

import numpy as np
import torch

from lucidlm.errors import LucidLMError, WeightsError

# Floating dtypes torch's aminmax / isnan / isinf accept everywhere.
_REDUCIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
FIX = "The file is damaged or was saved from a diverged run; re-download, re-convert or re-save it from a good copy."


class FiniteCheck:
    """``error`` and ``fix`` say what a refusal raises and advises (an adapter file raises
    AdapterError; a merged model says nothing was written)."""

    def __init__(self, source: Union[str, Path], error: Type[LucidLMError] = WeightsError, fix: str = FIX) -> None:
        self.source, self.error, self.fix = str(source), error, fix
        self._queued: list[tuple[str, torch.Tensor, str]] = []
        self._flags: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def add(self, name: str, values: Union[torch.Tensor, np.ndarray], what: str = "values") -> None:
        """Queue tensor ``name`` (``what`` says which part of it ``values`` are, e.g. "block scales")."""
        if isinstance(values, np.ndarray):
            with warnings.catch_warnings():  # read-only memory maps: we only read them
                warnings.simplefilter("ignore", UserWarning)
                values = torch.from_numpy(values)
        if not values.is_floating_point() or values.numel() == 0:
            return  # integer codes are always finite
        if values.dtype not in _REDUCIBLE:  # float8 & co.: no min/max/isnan kernels; float32 holds them exactly
            values = values.float()
        # min and max in one reduction: NaN propagates into both, an infinity is one of them.
        # ~40x faster on CPU than isfinite(values).all(), which builds a boolean copy.
        # (A strided view, e.g. the scales inside quantized blocks, is copied first: reductions
        # over strided half-precision views are slow on CPU.)
        flag = torch.isfinite(torch.stack(torch.aminmax(values.contiguous()))).all()
        with self._lock:  # loaders add from several threads (gguf_fill.py); each pair stays together
            self._queued.append((name, values, what))
            self._flags.append(flag)

    def add_all(self, tensors: Mapping[str, torch.Tensor]) -> "FiniteCheck":
        for name, tensor in tensors.items():
            self.add(name, tensor)
        return self

    def verify(self) -> None:
        """Raise WeightsError naming the first tensor that holds a NaN or an infinity."""
        if not self._flags:
            return
        if len({f.device for f in self._flags}) == 1:
            flags = torch.stack(self._flags).tolist()  # the one read-back
        else:  # tensors on several devices: one read-back each
            flags = [bool(f) for f in self._flags]
        for ok, (name, values, what) in zip(flags, self._queued):
            if not ok:
                raise self.error(f"{self.source}: tensor {name!r} holds {_count(values)} {what}. {self.fix}")
        self._queued.clear()
        self._flags.clear()


def check_finite(tensors: Mapping[str, torch.Tensor], source: Union[str, Path],
                 error: Type[LucidLMError] = WeightsError, fix: str = FIX) -> None:
    FiniteCheck(source, error, fix).add_all(tensors).verify()


def _count(values: torch.Tensor) -> str:
    nan, inf = int(torch.isnan(values).sum()), int(torch.isinf(values).sum())
    parts = [f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else ""]
    return " and ".join(p for p in parts if p)
