"""The server's model lock hands itself to its waiters in the order they came."""

from __future__ import annotations

import threading
import time

from lucidlm.serving.fair_lock import FairLock


def queued(lock: FairLock, count: int) -> None:
    deadline = time.monotonic() + 30
    while lock.waiting < count:
        assert time.monotonic() < deadline, f"{lock.waiting} waiting, expected {count}"
        time.sleep(0.001)


def test_waiters_get_the_lock_first_come_first_served():
    lock = FairLock()
    order: list[int] = []

    def take(i: int) -> None:
        with lock:
            order.append(i)

    lock.acquire()
    threads = []
    for i in range(5):  # each queued before the next starts: their order of arrival is 0..4
        threads.append(threading.Thread(target=take, args=(i,)))
        threads[-1].start()
        queued(lock, i + 1)
    order.append(-1)  # the holder's own work, before it lets go
    lock.release()
    for thread in threads:
        thread.join(timeout=30)
    assert order == [-1, 0, 1, 2, 3, 4]
    assert lock.waiting == 0
    lock.acquire()  # free again: taken at once
    lock.release()


class Waiters:
    """Threads queued on a held ``lock`` in the given order, each with its item: ``outcome``
    (name -> what its acquire returned) and ``order`` (the names that got the lock, in turn)."""

    def __init__(self, lock: FairLock, waiters: list[tuple[str, object]]) -> None:
        self.lock, self.outcome, self.order = lock, {}, []
        lock.acquire()
        self.threads = []
        for count, (name, item) in enumerate(waiters, 1):
            self.threads.append(threading.Thread(target=self._wait, args=(name, item)))
            self.threads[-1].start()
            queued(lock, count)

    def _wait(self, name: str, item) -> None:
        self.outcome[name] = self.lock.acquire(item)
        if self.outcome[name]:
            self.order.append(name)
            self.lock.release()

    def release_and_join(self) -> None:
        self.lock.release()
        for thread in self.threads:
            thread.join(timeout=30)


def test_the_holder_takes_along_the_waiters_it_wants_and_the_rest_keep_their_order():
    lock = FairLock()
    waiters = Waiters(lock, [("plain", None), ("a", "batchable"), ("b", "other"), ("c", "batchable"),
                             ("d", "batchable")])
    accepted = []

    def wanted(item) -> bool:  # at most two, as --parallel 3 with the holder's own row would
        if item == "batchable" and len(accepted) < 2:
            accepted.append(item)
            return True
        return False

    assert lock.take_along(wanted) == ["batchable", "batchable"]
    assert lock.waiting == 3  # plain, b, d
    waiters.release_and_join()
    assert waiters.outcome == {"plain": True, "a": False, "b": True, "c": False, "d": True}
    assert waiters.order == ["plain", "b", "d"]  # the ones left behind, in the order they came


def test_take_along_in_order_stops_at_the_first_waiter_it_does_not_take():
    """A batch under way takes requests oldest first and none past one that must wait on (one
    it cannot take, or one that runs alone): that one gets the lock next."""
    lock = FairLock()
    waiters = Waiters(lock, [("a", "batchable"), ("b", "other"), ("c", "batchable"), ("d", None), ("e", "batchable")])
    asked: list[str] = []

    def wanted(item) -> bool:
        asked.append(item)
        return item == "batchable"

    assert lock.take_along(wanted, in_order=True) == ["batchable"]  # a; b is refused, so c is not asked
    assert asked == ["batchable", "other"] and lock.waiting == 4
    waiters.release_and_join()
    assert waiters.outcome == {"a": False, "b": True, "c": True, "d": True, "e": True}
    assert waiters.order == ["b", "c", "d", "e"]
