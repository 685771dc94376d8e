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
  began. When they do not fit after the clock, the batch slides: every row's slots move left
  by as many as no row still decoding reads (``slack``: the first real slot of the earliest
  such row), and the clock with them (``DecodeSession.slide``). So a batch under steady load
  goes on taking prompts instead of running into its cache's end; only a row that runs as long
  as the cache holds keeps new prompts out (a joined prompt must still fit before the clock,
  so the slide is at most ``slot - n``).

``sample_rows`` sets the clock and the slack before it hands out each step's tokens and takes
the joins queued meanwhile, with the slide they need, before its next step; the caller
(``BatchRun.join``) asks ``room`` and queues with ``add`` in between, from the thread that
runs the batch. The caller may also drop the last rows once they have ended (``rows``): the
batch then decodes fewer rows, and a prompt that joins later adds a row again.
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
    slides = True  # False: never slide (benchmarks/bench_serve.py measures what slides give)

    def __init__(self, capacity: int, max_rows: int = 0) -> None:
        self.capacity = capacity  # the batch's cache slots
        self.max_rows = max_rows  # the most rows it may grow to: its cache reserves room for them
        self.slot: Optional[int] = None  # where a row joining now gets its first new token; None: not yet running
        self.slack = 0  # slots the batch may slide left by: none before the first real one of a row that goes on
        self._pending: list[Join] = []
        self._most = 0  # the slide the pending joins allow: at most slot - n for each (its prompt before the clock)
        self._least = 0  # ... and the one they need (their tokens within the cache)
        self.rows: Optional[int] = None  # set by the caller: decode only the first this many rows from the next step

    def room(self, prompt_len: int) -> int:
        """How many new tokens a prompt of ``prompt_len`` tokens joining now can have, after the
        furthest slide the batch and the prompts queued before it allow: 0 when it cannot join
        now (the batch has not started, or not run as far as its length, or is full, or its
        prompt would not leave a queued one the slide it needs). Its last token is never fed
        back, so tokens reach one slot past the cache."""
        if self.slot is None or not 0 < prompt_len <= self.slot:
            return 0
        if self.slot > self.capacity:  # the step that takes a join would feed a row's token past the cache's
            return 0  # end, before any slide: a row's last token is there, every row ends now
        if not self.slides:
            return max(self.capacity + 1 - self.slot, 0)
        shift = self._slide_with(prompt_len)
        if shift < self._least:
            return 0
        return max(self.capacity + 1 - self.slot + shift, 0)

    def _slide_with(self, prompt_len: int) -> int:
        """The furthest slide allowed with a prompt of ``prompt_len`` tokens queued too: the
        slack, the prompts queued before, and its own prompt before the clock after it."""
        return min(self.slack, self.slot - prompt_len, self._most if self._pending else self.slack)

    def add(self, row: int, ids: list[int], max_new_tokens: int) -> None:
        if not 0 < max_new_tokens <= self.room(len(ids)):
            raise ValueError(f"a {len(ids)}-token prompt with {max_new_tokens} new tokens cannot join at slot "
                             f"{self.slot} of a {self.capacity}-slot batch (room: {self.room(len(ids))})")
        if any(join.row == row for join in self._pending):
            raise ValueError(f"row {row} already has a prompt waiting to join")
        self._most = self._slide_with(len(ids))
        self._least = max(self._least, self.slot + max_new_tokens - 1 - self.capacity)
        self._pending.append(Join(row, list(ids), max_new_tokens))

    def save(self) -> tuple:
        """What ``restore`` puts back: the queue as it is (a request whose rows do not all fit
        takes none)."""
        return list(self._pending), self._most, self._least

    def restore(self, saved: tuple) -> None:
        self._pending, self._most, self._least = list(saved[0]), saved[1], saved[2]

    def take(self) -> tuple[list[Join], Optional[int], int]:
        """The joins queued since the last step, the rows to keep before them (None: all) and
        the slide to make first (0: none needed; else as far as they allow, so that slides stay
        rare), for ``sample_rows`` to run."""
        pending, self._pending = self._pending, []
        rows, self.rows = self.rows, None
        shift = self._most if self._least > 0 else 0
        self._most = self._least = 0
        return pending, rows, shift
