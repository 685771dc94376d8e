"""A lock that serves its waiters in the order they came.

``threading.Lock`` promises no order: under steady load a request could lose the race for the
model again and again. Here each waiter queues an event and ``release`` hands the lock
straight to the oldest one, so requests get the model first come, first served.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class FairLock:
    def __init__(self) -> None:
        self._guard = threading.Lock()  # held only for a few lines, never while a generation runs
        self._held = False
        self._waiting: deque[threading.Event] = deque()

    def acquire(self) -> None:
        with self._guard:
            if not self._held:
                self._held = True
                return
            turn = threading.Event()
            self._waiting.append(turn)
        turn.wait()  # release() set it: the lock is ours, still marked held

    def release(self) -> None:
        with self._guard:
            if self._waiting:
                self._waiting.popleft().set()  # handed over: it stays held, by the next in line
            else:
                self._held = False

    @property
    def waiting(self) -> int:
        """How many are queued for the lock now."""
        return len(self._waiting)

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
