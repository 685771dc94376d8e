"""Continuous batching: a new prompt takes over a finished row of a batch under way.

The rows of a batch share one clock: every step writes every row's next token at the same
cache slot. A prompt of n tokens that joins when the next token goes to slot s runs alone (its
own slots 0..n-1, as ``generate`` runs it), moves to slots s-n..s-1 of the finished row, and the
row's mask hides everything before s-n (``DecodeSession.join_row``). Positions count from a
row's first real slot and the decode step's attention starts there, so on lucidlm's CPU kernels
the joined row decodes exactly what it would alone, as a left-padded row does.

Hence what may join, and when:

- its prompt must fit before the clock (n <= s): a long prompt waits until the batch has run
  that far;
- its tokens must fit the batch's cache, whose size (``capacity``) was chosen when the batch
  began: a prompt that joins late gets fewer slots than one that joins early.

``sample_rows`` sets the clock before it hands out each step's tokens and takes the joins
queued meanwhile before its next step; the caller (``BatchRun.join``) asks ``room`` and queues
with ``add`` in between, from the thread that runs the batch. The caller may also drop the
last rows once they have ended (``rows``): the batch then decodes fewer rows, and a prompt
that joins later adds a row again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Join:
    row: int  # the finished row it takes over
    ids: list[int]  # its prompt, checked
    max_new_tokens: int  # at most room(len(ids)) when it was queued


class RowJoins:
    def __init__(self, capacity: int, max_rows: int = 0) -> None:
        self.capacity = capacity  # the batch's cache slots
        self.max_rows = max_rows  # the most rows it may grow to: its cache reserves room for them
        self.slot: Optional[int] = None  # where a row joining now gets its first new token; None: not yet running
        self._pending: list[Join] = []
        self.rows: Optional[int] = None  # set by the caller: decode only the first this many rows from the next step

    def room(self, prompt_len: int) -> int:
        """How many new tokens a prompt of ``prompt_len`` tokens joining now can have: 0 when
        it cannot join now (the batch has not started, or not run as far as its length, or is
        full). Its last token is never fed back, so tokens reach one slot past the cache."""
        if self.slot is None or not 0 < prompt_len <= self.slot:
            return 0
        return max(self.capacity + 1 - self.slot, 0)

    def add(self, row: int, ids: list[int], max_new_tokens: int) -> None:
        if not 0 < max_new_tokens <= self.room(len(ids)):
            raise ValueError(f"a {len(ids)}-token prompt with {max_new_tokens} new tokens cannot join at slot "
                             f"{self.slot} of a {self.capacity}-slot batch (room: {self.room(len(ids))})")
        if any(join.row == row for join in self._pending):
            raise ValueError(f"row {row} already has a prompt waiting to join")
        self._pending.append(Join(row, list(ids), max_new_tokens))

    def take(self) -> tuple[list[Join], Optional[int]]:
        """The joins queued since the last step and the rows to keep before them (None: all),
        for ``sample_rows`` to run."""
        pending, self._pending = self._pending, []
        rows, self.rows = self.rows, None
        return pending, rows
