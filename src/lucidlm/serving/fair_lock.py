"""A lock that serves its waiters in the order they came.

``threading.Lock`` promises no order: under steady load a request could lose the race for the
model again and again. Here each waiter queues an event and ``release`` hands the lock
straight to the oldest one, so requests get the model first come, first served.

A waiter may queue an item (``acquire(item)``): the holder can then take waiters along by
their items (``take_along``, ``lucidlm serve --parallel``: requests that can decode in one
batch with the holder's), out of the queue; their ``acquire`` returns False, as their work is
the holder's now. The lock is not tied to a thread: whoever holds it may hand the release to
another (the batch, on the server's model thread, releases it when it ends).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable


class _Waiter:
    def __init__(self, item: Any) -> None:
        self.turn = threading.Event()
        self.item = item
        self.taken = False  # taken along by the holder, rather than handed the lock


class FairLock:
    def __init__(self) -> None:
        self._guard = threading.Lock()  # held only for a few lines, never while a generation runs
        self._held = False
        self._waiting: deque[_Waiter] = deque()

    def acquire(self, item: Any = None) -> bool:
        """Wait for the lock: True once it is ours; False when the holder took ``item`` along
        instead (``take_along``), and the lock is not ours."""
        with self._guard:
            if not self._held:
                self._held = True
                return True
            waiter = _Waiter(item)
            self._waiting.append(waiter)
        waiter.turn.wait()  # release() set it: the lock is ours, still marked held; or take_along did
        return not waiter.taken

    def take_along(self, wanted: Callable[[Any], bool], in_order: bool = False) -> list[Any]:
        """For the holder: the items of the waiters ``wanted`` accepts, asked oldest first (it may
        count what it accepted and refuse the rest), taken out of the queue; those waiters'
        ``acquire`` returns False. Waiters without an item are never asked. ``in_order``: stop
        at the first waiter not taken, so none is taken past an older one that waits on
        (a batch under way taking requests: the one it cannot take gets the model next)."""
        taken = []
        with self._guard:
            for waiter in list(self._waiting):
                if waiter.item is not None and wanted(waiter.item):
                    self._waiting.remove(waiter)
                    waiter.taken = True
                    taken.append(waiter)
                elif in_order:
                    break
        for waiter in taken:
            waiter.turn.set()
        return [waiter.item for waiter in taken]

    def release(self) -> None:
        with self._guard:
            if self._waiting:
                self._waiting.popleft().turn.set()  # handed over: it stays held, by the next in line
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
