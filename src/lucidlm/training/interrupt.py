"""Ctrl-C during training: the first one finishes the current step, saves a checkpoint and
returns (stopping between steps keeps the checkpoint consistent, so --resume stays exact);
a second one aborts at once."""

from __future__ import annotations

import signal
import threading
from typing import Any


def install_interrupt_handler(trainer: Any) -> Any:
    """Route SIGINT to ``trainer.request_stop()``; returns the previous handler (None when
    not on the main thread, where Python allows no signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_sigint(signum: int, frame: Any) -> None:
        if trainer._stop_requested:
            raise KeyboardInterrupt
        trainer.request_stop()
        if trainer.ctx.is_main:
            print("\nCtrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to abort).", flush=True)

    return signal.signal(signal.SIGINT, on_sigint)
