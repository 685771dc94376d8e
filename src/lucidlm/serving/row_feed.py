"""One row of a batch, as its request's thread reads it: ``TextStream``'s interface (iterate the
pieces, then ``result``; ``close``) over a queue the batch fills from the model's thread.

The queue has no bound, so a slow client holds up no one: the batch puts its pieces at its own
pace and each request's thread writes them to its client at the client's.
"""

from __future__ import annotations

import queue
from typing import Any, Iterator, Optional


class _End:
    def __init__(self, result: Any) -> None:
        self.result = result


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class RowFeed(Iterator[str]):
    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.result: Optional[Any] = None  # the row's GenerationResult, once its pieces ran out
        self.gone = False  # closed by its reader (a client gone): the batch ends the row at its next step
        self._over = False

    # the model's thread, running the batch
    def put(self, text: str, result: Any = None) -> None:
        """A piece of text, and with ``result`` the row's end."""
        if text:
            self._queue.put(text)
        if result is not None:
            self._queue.put(_End(result))

    def fail(self, error: BaseException) -> None:
        """The batch failed: the reader raises ``error`` at its next piece."""
        self._queue.put(_Failed(error))

    # the request's thread
    def __next__(self) -> str:
        if self._over:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, str):
            return item
        self._over = True
        if isinstance(item, _Failed):
            raise item.error
        self.result = item.result
        raise StopIteration

    def close(self) -> None:
        self.gone = True
