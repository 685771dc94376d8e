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


def test_the_holder_takes_along_the_waiters_it_wants_and_the_rest_keep_their_order():
    lock = FairLock()
    outcome: dict[str, bool] = {}
    order: list[str] = []

    def wait(name: str, item) -> None:
        outcome[name] = lock.acquire(item)
        if outcome[name]:
            order.append(name)
            lock.release()

    lock.acquire()
    threads = []
    for count, (name, item) in enumerate([("plain", None), ("a", "batchable"), ("b", "other"), ("c", "batchable"),
                                          ("d", "batchable")], 1):
        threads.append(threading.Thread(target=wait, args=(name, item)))
        threads[-1].start()
        queued(lock, count)
    accepted = []

    def wanted(item) -> bool:  # at most two, as --parallel 3 with the holder's own row would
        if item == "batchable" and len(accepted) < 2:
            accepted.append(item)
            return True
        return False

    assert lock.take_along(wanted) == ["batchable", "batchable"]
    assert lock.waiting == 3  # plain, b, d
    lock.release()
    for thread in threads:
        thread.join(timeout=30)
    assert outcome == {"plain": True, "a": False, "b": True, "c": False, "d": True}
    assert order == ["plain", "b", "d"]  # the ones left behind, in the order they came


def test_take_along_in_order_stops_at_the_first_waiter_it_does_not_take():
    """A batch under way takes requests oldest first and none past one that must wait on (one
    it cannot take, or one that runs alone): that one gets the lock next."""
    lock = FairLock()
    outcome: dict[str, bool] = {}
    order: list[str] = []

    def wait(name: str, item) -> None:
        outcome[name] = lock.acquire(item)
        if outcome[name]:
            order.append(name)
            lock.release()

    lock.acquire()
    threads = []
    for count, (name, item) in enumerate([("a", "batchable"), ("b", "other"), ("c", "batchable"),
                                          ("d", None), ("e", "batchable")], 1):
        threads.append(threading.Thread(target=wait, args=(name, item)))
        threads[-1].start()
        queued(lock, count)
    asked: list[str] = []

    def wanted(item) -> bool:
        asked.append(item)
        return item == "batchable"

    assert lock.take_along(wanted, in_order=True) == ["batchable"]  # a; b is refused, so c is not asked
    assert asked == ["batchable", "other"] and lock.waiting == 4
    lock.release()
    for thread in threads:
        thread.join(timeout=30)
    assert outcome == {"a": False, "b": True, "c": True, "d": True, "e": True}
    assert order == ["b", "c", "d", "e"]
