"""What a command says while it loads a model: one line at once, a spinner if it takes a while.

Printed to stderr so that stdout stays the generated text (or JSON) alone.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any, Iterable, Iterator, Optional, TextIO


class LoadingStatus:
    """``with LoadingStatus("loading smollm2-135m"):`` prints the line now; on a terminal, a
    spinner turns after ``delay`` seconds; at the end the line says how long it took."""

    FRAMES = "|/-\\"

    def __init__(self, text: str, stream: Optional[TextIO] = None, delay: float = 1.0, enabled: bool = True) -> None:
        self.text = text
        self.stream = stream if stream is not None else sys.stderr
        self.delay = delay
        self.enabled = enabled
        self.tty = enabled and _isatty(self.stream)
        self.start = 0.0
        self.seconds = 0.0
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "LoadingStatus":
        self.start = time.perf_counter()
        if self.enabled:
            self._say(f"{self.text} ..." + ("" if self.tty else "\n"))
        if self.tty:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.tty:
            end = f"done in {self.seconds:.1f} s" if exc_type is None else "failed"
            self._say(f"\r{self.text} ... {end}\n")

    def _spin(self) -> None:
        if self._done.wait(self.delay):
            return
        for frame in itertools.cycle(self.FRAMES):
            self._say(f"\r{self.text} ... {frame} {time.perf_counter() - self.start:.0f} s")
            if self._done.wait(0.1):
                return

    def _say(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:  # stderr closed (`2>&-`) or full: the status is not worth failing the command
            pass


COMPILING = "compiling the generation steps (torch.compile: the first answer waits, later ones are faster)"


def first_piece_announced(pieces: Iterable[str], text: str = COMPILING, enabled: bool = True,
                          stream: Optional[TextIO] = None) -> Iterator[str]:
    """``pieces`` as they come, with ``text`` (and a spinner on a terminal) on stderr while the
    compiler works: a compiled model's first answer waits ~17 s (SmolLM2, inductor cache warm)
    to ~4 min (cache empty) on torch.compile, which would otherwise look like a hang after the
    loading line. The prompt pass is compiled before the first piece and the decode step before
    the second, so the first piece is held until the second arrives (the spinner's line and
    streamed text would share the terminal)."""
    iterator = iter(pieces)
    with LoadingStatus(text, stream=stream, enabled=enabled):
        held = list(itertools.islice(iterator, 2))
    yield from held
    yield from iterator


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
