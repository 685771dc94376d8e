"""A real failed write for tests: the process's file-size limit (RLIMIT_FSIZE, with SIGXFSZ
ignored) makes the kernel refuse writes past ``limit`` bytes with EFBIG (a short write first, when
part fits), as a full disk refuses them with ENOSPC. Nothing is mocked, so every writer (Python's
io, safetensors, matplotlib, readline) meets it."""

from __future__ import annotations

import contextlib
import resource
import signal


@contextlib.contextmanager
def file_size_limit(limit: int = 64):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
