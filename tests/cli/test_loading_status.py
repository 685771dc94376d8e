"""The loading line: printed at once; on a terminal a spinner turns once a wait passes its delay."""

from __future__ import annotations

import io
import time

from lucidlm.commands.loading_status import LoadingStatus


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_at_once_and_no_spinner_when_not_a_terminal():
    out = io.StringIO()
    with LoadingStatus("loading toy", stream=out, delay=0.01):
        assert out.getvalue() == "loading toy ...\n"  # before any work is done
        time.sleep(0.1)
    assert out.getvalue() == "loading toy ...\n"


def test_spinner_after_the_delay_on_a_terminal():
    out = FakeTerminal()
    with LoadingStatus("loading toy", stream=out, delay=0.05) as status:
        assert out.getvalue() == "loading toy ..."
        time.sleep(0.5)
    text = out.getvalue()
    frames = [f for f in LoadingStatus.FRAMES if f"... {f} " in text]
    assert len(frames) >= 2  # it turned
    assert text.endswith(f"\rloading toy ... done in {status.seconds:.1f} s\n")


def test_no_spinner_for_a_quick_load():
    out = FakeTerminal()
    with LoadingStatus("loading toy", stream=out, delay=1.0):
        pass
    assert out.getvalue().startswith("loading toy ...\rloading toy ... done in 0.0 s")
