"""The C heap (glibc's malloc): handing freed memory back while a model loads, keeping it
while a model trains.

Loading: a streaming loader frees a few MB of temporaries per tensor (float32 rows, unpacked
codes) between the buffers the model keeps. glibc's malloc keeps such freed chunks for reuse,
and once a large block has been freed it serves everything up to that size from its heap,
where the kept buffers pin the holes: measured on SmolLM2 in int4, 270 MB of freed-but-resident
heap for a 101 MB model. ``malloc_trim(0)`` hands the free pages back (~1 ms), so the loader
calls ``trim`` every few tens of MB converted: the resident memory stays the model's.

Training is the opposite case: every step allocates the same large buffers again (the logits,
batch x block x vocab floats, and their gradient: 210 MB each for seed 004's word model).
glibc maps any block over 32 MB afresh with ``mmap`` and unmaps it on free, so each step
faults in and zeroes every 4 KiB page of them again. ``keep_freed_memory()`` serves them from
the heap and keeps what is freed there for the next step, as torch's caching allocator does on
a GPU: a 210 MB buffer's allocation and first fill took 101 ms before and 35 ms after, and
seed 004's word model trained 20 steps plus its evaluations in 37 s instead of 54 s (2-core
AMD EPYC VM). When the last such block ends, the settings go back to glibc's defaults and the
kept pages go back to the OS.

Both are no-ops where the C library is not glibc (macOS, musl, Windows).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading
from typing import Iterator, Optional

import torch


# mallopt's parameters (malloc.h) and glibc's defaults for them
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536
KEEP_TRIM_THRESHOLD = 2**31 - 1  # the largest int: free memory at the heap's top is never given back


@functools.lru_cache(maxsize=1)
def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    # musl (no gnu_get_libc_version), macOS (no mallopt) and others lack one of them
    return libc if all(hasattr(libc, name) for name in ("gnu_get_libc_version", "malloc_trim", "mallopt")) else None


_keeping = 0  # how many keep_freed_memory blocks are open (threads may train side by side)
_keeping_lock = threading.Lock()


@contextlib.contextmanager
def keep_freed_memory() -> Iterator[None]:
    """Inside the block, large allocations come from the heap and freed memory stays there for
    the next one (no ``mmap``/``munmap`` per step); at the end of the last open block, glibc's
    default settings come back and the free pages go back to the OS. Peak resident memory is
    what the block's largest live buffers need (plus the heap's holes), not more per step."""
    global _keeping
    libc = _glibc()
    if libc is None:
        yield
        return
    with _keeping_lock:
        if _keeping == 0:
            libc.mallopt(M_MMAP_MAX, 0)
            libc.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)
        _keeping += 1
    try:
        yield
    finally:
        with _keeping_lock:
            _keeping -= 1
            if _keeping == 0:
                libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
                libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
                libc.malloc_trim(0)


def trim() -> None:
    """Return the C heap's free pages to the OS (glibc), else nothing."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class TrimEvery:
    """``step(n_bytes)`` after each converted tensor; trims once ``every`` bytes have gone by."""

    def __init__(self, every: int = 24 << 20) -> None:
        self.every, self.pending = every, 0

    def step(self, n_bytes: int) -> None:
        self.pending += n_bytes
        if self.pending >= self.every:
            trim()
            self.pending = 0


class Scratch:
    """One reusable buffer per dtype for a loader's temporaries (float32 rows before the cast
    to bfloat16, int32 codes before torch's int4 packing). A fresh allocation costs a page
    fault per 4 KB on first write (0.1 s per 270 MB here, more than the arithmetic), and
    ``trim`` hands freed pages back, so temporaries allocated anew per tensor were faulted in
    again and again; a scratch buffer is faulted in once per load."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``n`` elements of ``dtype`` (flat) with arbitrary contents, valid until the next
        ``take`` of that dtype: the caller must copy out whatever it keeps."""
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < n:
            buffer = self._buffers[dtype] = torch.empty(n, dtype=dtype)
        return buffer[:n]
