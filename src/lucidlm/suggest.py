""""Did you mean ...?" for names a user typed: commands, flags, model and preset names."""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``""`` when none is close."""
    choices = [str(c) for c in choices]
    matches = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    if not matches:  # a prefix typed short ("smollm2") is close to nothing by ratio but is a clear hint
        matches = [c for c in choices if c.startswith(value) and len(value) >= 3][:1]
    return f"; did you mean {matches[0]!r}?" if matches else ""
