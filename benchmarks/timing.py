"""The one timing rule the in-process benchmarks share: the best of ``repeats`` runs (the
least disturbed by the rest of a shared machine); and what every results file says of the
machine it ran on."""

from __future__ import annotations

import os
import platform
import time
from typing import Any


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine(**extra: Any) -> dict[str, Any]:
    """The machine a result was measured on: this project's hosts differ in kind (Intel Xeon
    with AVX-512 VNNI, AMD EPYC with AVX2), and lucidlm's kernels with them."""
    from lucidlm.quantization import blocks_kernel

    return {"platform": platform.platform(), "cpu": blocks_kernel.cpu_model(), "cpus": os.cpu_count(),
            "lucidlm_kernels": blocks_kernel.instruction_set() or "none (torch's)", **extra}
