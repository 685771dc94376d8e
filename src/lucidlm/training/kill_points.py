"""A test seam: ``LUCIDLM_TEST_KILL_AT=NAME:N`` makes the process SIGKILL itself the Nth time
it reaches the point ``NAME`` (step, eval, metrics, checkpoint, swap, data), so a test can
prove that a run killed at that moment resumes exactly. Off (one dict lookup) by default."""

from __future__ import annotations

import os
import signal
from typing import Callable, Optional

ENV = "LUCIDLM_TEST_KILL_AT"
_reached: dict[str, int] = {}


def kill_point(name: str, before_dying: Optional[Callable[[], None]] = None) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, count = spec.partition(":")
    if target != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(count or 1):
        if before_dying is not None:
            before_dying()  # e.g. half of a line, as a kill in the middle of a write leaves it
        os.kill(os.getpid(), signal.SIGKILL)
