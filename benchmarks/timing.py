"""The one timing rule the in-process benchmarks share: the best of ``repeats`` runs (the
least disturbed by the rest of a shared machine)."""

from __future__ import annotations

import time


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
