"""Ctrl-C during training: the first one finishes the current step, saves a checkpoint and
returns (stopping between steps keeps the checkpoint consistent, so --resume stays exact);
a second one aborts at once. A single-process run treats SIGTERM (``kill``, a scheduler's
preemption) the same way; under torchrun the launcher's SIGTERM keeps its default, since it
follows a failed rank and a step's collectives could not finish."""

from __future__ import annotations

import signal
import threading
from typing import Any, Optional


def install_interrupt_handler(trainer: Any) -> Optional[dict[int, Any]]:
    """Route SIGINT (and SIGTERM in a single-process run) to ``trainer.request_stop()``; returns
    the previous handlers by signal, for ``restore_handlers`` (None when not on the main thread,
    where Python allows no signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_signal(signum: int, frame: Any) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if trainer._stop_requested:
            raise KeyboardInterrupt
        trainer.request_stop()
        if trainer.ctx.is_main:
            print(f"\n{name}: stopping after this step and saving a checkpoint ({name} again to abort).", flush=True)

    signums = [signal.SIGINT] + ([signal.SIGTERM] if trainer.ctx.world_size == 1 else [])
    return {signum: signal.signal(signum, on_signal) for signum in signums}


def restore_handlers(previous: Optional[dict[int, Any]]) -> None:
    """Put back the handlers ``install_interrupt_handler`` replaced."""
    for signum, handler in (previous or {}).items():
        signal.signal(signum, handler)
