"""Every piece of the server's model work on one thread: the thread that serves (``lucidlm
serve``: the main thread, which loaded the model).

Why: torch's and lucidlm's CPU kernels run their threads through OpenMP (libgomp), which keeps
a pool of worker threads for each thread that starts parallel work. While more threads sit in
those pools than the machine has cores, libgomp's workers stop spinning between parallel
regions and sleep instead, and every region then pays to wake them. A decode step runs a few
hundred regions, so a model that was loaded (or ever ran) in one thread and generates in
another decoded ~3.7x slower (SmolLM2, 2 cores: 262 tok/s in the main thread, 70 in any other;
loaded and run in one other thread, 258). The HTTP threads therefore hand the model's work here:
a request's opening of its generation, each step of its stream, a batch's whole run.

``call`` runs a function here and returns (or raises) what it did; ``stream`` wraps a
``TextStream`` so each piece is produced here; ``submit`` queues work without waiting
(a batch, which ends by letting go of the model itself). ``run`` is the loop: the serving
thread runs it for as long as the server answers.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Optional


class ModelWorker:
    def __init__(self) -> None:
        self._tasks: "queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future]]" = queue.SimpleQueue()
        self._thread: Optional[int] = None  # the ident of the thread in run(), while it runs
        self._closed = False  # run() has ended: work queued now would wait for ever
        self._closing = threading.Lock()  # a submit's check and put, or the loop's end and its last sweep

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` for the worker thread; its future holds the result or the error."""
        done: Future = Future()
        with self._closing:  # else the loop could end and sweep between the check and the put
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._tasks.put((fn, args, done))
        return done

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the worker thread (directly, when called there), its result or its error."""
        if threading.get_ident() == self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def stream(self, pieces: Any) -> "WorkerStream":
        return WorkerStream(self, pieces)

    def run(self, keep_going: Callable[[], bool], poll_interval: float = 0.2) -> None:
        """Do the queued work, in order, while ``keep_going()``; an error goes to the caller that
        queued it. Ctrl-C here fails the task it stopped (its caller gets the interrupt) and ends
        the loop."""
        self._thread, self._closed = threading.get_ident(), False
        try:
            while keep_going():
                try:
                    fn, args, done = self._tasks.get(timeout=poll_interval)
                except queue.Empty:
                    continue
                if not done.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args)
                except BaseException as exc:  # noqa: BLE001 - the caller's to handle; Ctrl-C also ends the loop
                    done.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                else:
                    done.set_result(result)
        finally:
            with self._closing:
                self._thread, self._closed = None, True
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        """Work queued after the loop ended gets an error rather than a wait for ever."""
        while True:
            try:
                _, _, done = self._tasks.get_nowait()
            except queue.Empty:
                return
            if done.set_running_or_notify_cancel():
                done.set_exception(RuntimeError("the server is shutting down"))


class WorkerStream(Iterator[str]):
    """A ``TextStream`` whose pieces (and close) are produced on the worker thread; ``result``
    as the stream's."""

    def __init__(self, worker: ModelWorker, pieces: Any) -> None:
        self._worker, self._pieces = worker, pieces

    def __next__(self) -> str:
        return self._worker.call(next, self._pieces)  # StopIteration comes back as it is raised

    def close(self) -> None:
        self._worker.call(self._pieces.close)

    @property
    def result(self) -> Any:
        return self._pieces.result
