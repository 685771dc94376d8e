"""Several prompts decoded together as one left-padded batch (one KV cache), each row with its
own token budget and stop strings, its text handed out as it is produced.

``generate_batch`` is this loop run to its end; ``lucidlm serve --parallel`` reads it step by
step and passes each row's pieces to that row's client. Every row follows the same rules as
``generate`` alone (``api.py``'s module docstring): it ends on EOS, on one of its stop strings or
after its ``max_new_tokens``, and its text is built by the same ``TextAssembler``. Finished rows
keep decoding in lockstep (``decode.sample_rows``); the batch ends when every row has ended.

The rows share the cache's ``max_seq_len`` slots, so each row gets at most ``max_seq_len``
minus the *longest* prompt's length new tokens (finish reason "length"): a row whose budget
reaches past that ends earlier than it would alone (``fits_together`` says whether any does).

With ``join_room``, new prompts may join while the batch runs (``join``; continuous batching,
``row_joins.py``): each takes over a row that has ended, or adds a row while the batch has fewer
than ``max_rows``. The cache gets ``join_room`` more slots than the batch's first rows need
(and slides left when a join needs room past its end), and a joined row is its own request
from then on, with its own budget, stops, text and result.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from lucidlm.generation.decode import sample_rows
from lucidlm.generation.logprobs import LogprobRecorder
from lucidlm.generation.request import Request, fit_to_context, padding_id, private_generator
from lucidlm.generation.result import GenerationResult, attach_tokenizer
from lucidlm.generation.row_joins import RowJoins
from lucidlm.generation.streaming import TextAssembler


@dataclass
class RowPiece:
    """What one step gave one row: new ``text`` (maybe ""), and ``result`` (a
    ``GenerationResult``) when the row has just ended; text and result come at most once."""

    row: int
    text: str
    result: Any = None


def fits_together(model: Any, rows: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> bool:
    """Whether every row's budget fits the context after the longest prompt, so that no row is
    cut shorter than it would be alone (left padding puts every row's tokens after it)."""
    longest = max(len(row) for row in rows)
    return all(longest + min(n, model.config.max_seq_len - len(row)) <= model.config.max_seq_len
               for row, n in zip(rows, max_new_tokens))


class BatchRun:
    """``rows``: the prompts' token ids (checked: ``request.prompt_ids``); ``request``: the
    sampling settings, EOS ids, ``min_new_tokens`` and log-probs every row shares (its own
    ``max_new_tokens`` and ``stop`` are not used: each row has its own, ``max_new_tokens[i]``
    and ``stops[i]``). Iterate ``pieces()``; ``end_row(i)`` ends a row early (its client went
    away), from any thread; ``results`` holds every row's ``GenerationResult`` at the end (a
    row taken over by ``join``: the last one's). ``join_room``: see the module docstring."""

    def __init__(self, model: Any, rows: Sequence[Sequence[int]], request: Request,
                 max_new_tokens: Sequence[int], stops: Sequence[Sequence[str]], lookahead: bool = False,
                 join_room: int = 0, max_rows: int = 0) -> None:
        if not len(rows) == len(max_new_tokens) == len(stops):
            raise ValueError(f"BatchRun needs one budget and one stop list per row: {len(rows)} rows, "
                             f"{len(max_new_tokens)} budgets, {len(stops)} stop lists.")
        self.model, self.request, self.lookahead = model, request, lookahead
        self.rows = [list(row) for row in rows]
        longest_fit = fit_to_context(model, self.rows, max(max_new_tokens))  # refuses a prompt past the context
        self.max_new = [min(n, longest_fit) for n in max_new_tokens]
        tokenizer = model.tokenizer
        self.assemblers = [TextAssembler(tokenizer, stop, request.eos_ids, row) if tokenizer is not None else None
                           for row, stop in zip(self.rows, stops)]
        self.outputs: list[list[int]] = [[] for _ in self.rows]
        self.reasons = ["length"] * len(self.rows)
        self.max_rows = max(max_rows, len(self.rows))
        self.live = len(self.rows)  # rows the batch decodes: the ended last ones are dropped (with joins)
        # (max_rows,) sample_rows stops once all are set; rows not begun yet count as ended
        self.finished = torch.arange(self.max_rows) >= len(self.rows)
        self.results: list[Any] = [None] * len(self.rows)
        self.recorder = None if request.logprobs is None else LogprobRecorder(request.logprobs)
        self.started = [0.0] * len(self.rows)  # when each row's request began, in the run's clock
        self.firsts: list[Optional[float]] = [None] * len(self.rows)  # when each row's first token came
        self.joins: Optional[RowJoins] = None
        if join_room > 0:
            if not self.can_take_joins(model, request, lookahead):
                raise ValueError("BatchRun(join_room=...): rows cannot join this batch (log-probs, presence or "
                                 "frequency penalties, lookahead, or a compiled model)")
            L = max(len(row) for row in self.rows)
            capacity = min(model.config.max_seq_len, L + max(max(self.max_new) - 1, 0) + join_room)
            self.joins = RowJoins(capacity, self.max_rows)
        self._clock = time.perf_counter()

    @staticmethod
    def can_take_joins(model: Any, request: Request, lookahead: bool = False) -> bool:
        """Whether rows may join a batch of ``request``'s settings: a joined row's log-probs and
        presence/frequency penalties would count from the batch's first step, and a compiled
        model's prompt graph is for a new cache."""
        settings = request.settings
        return not (request.logprobs is not None or lookahead or getattr(model, "compiled", False)
                    or settings.presence_penalty or settings.frequency_penalty)

    def free_rows(self) -> list[int]:
        """The rows a prompt may take now: ended (their result handed out, none queued for them),
        then new ones up to ``max_rows``."""
        if self.joins is None:
            return []
        return [i for i in range(self.live) if self.results[i] is not None] + list(range(self.live, self.max_rows))

    def join(self, rows: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stops: Sequence[Sequence[str]],
             open_ended: bool = False) -> Optional[list[int]]:
        """Queue ``rows`` (prompts' checked ids, one per row, with their budgets and stops) to take
        free rows (``free_rows``) at the next step; the rows they got, or None when they do not all
        fit now (too few free rows, a prompt longer than the batch has run, a budget past the cache). An
        ``open_ended`` request (a chat without max_tokens) fits with what is left of a cache as
        long as the context: it ends there, as in a batch it ends at the shared context end.
        Call between steps, from the thread reading ``pieces``."""
        free = self.free_rows()
        if self.joins is None or len(rows) > len(free):
            return None
        taken, budgets = free[:len(rows)], []
        context = self.model.config.max_seq_len
        saved = self.joins.save()  # each row queued as it is checked: a prompt may narrow the slide the next gets
        for i, row, n in zip(taken, rows, max_new_tokens):
            # cut to the context as alone (fit_to_context): a row's last token is never fed back, so
            # room reaches one slot past a cache as long as the context, one token more than alone gets
            n = min(n, context - len(row))
            room = self.joins.room(len(row))
            whole_context = self.joins.capacity == context
            if room == 0 or n <= 0 or (n > room and not (open_ended and whole_context)):
                self.joins.restore(saved)
                return None
            budgets.append(min(n, room))
            self.joins.add(i, list(row), budgets[-1])
        now = time.perf_counter() - self._clock
        for i, row, n, stop in zip(taken, rows, budgets, stops):
            self.live = max(self.live, i + 1)
            if i == len(self.rows):  # a new row
                for per_row in (self.rows, self.max_new, self.outputs, self.assemblers, self.reasons, self.results,
                                self.started, self.firsts):
                    per_row.append(None)
            self.rows[i], self.max_new[i], self.outputs[i] = list(row), n, []
            self.assemblers[i] = TextAssembler(self.model.tokenizer, stop, self.request.eos_ids, row) \
                if self.model.tokenizer is not None else None
            self.reasons[i], self.results[i], self.started[i], self.firsts[i] = "length", None, now, None
            self.finished[i] = False
        return taken

    def end_row(self, row: int) -> None:
        """Stop generating for ``row`` (its result is what it had, finish reason "length");
        the others go on, and the batch stops once no row is left."""
        self.finished[row] = True

    def pieces(self) -> Iterator[list[RowPiece]]:
        """Per step, the rows whose text grew or that ended."""
        self._clock = time.perf_counter()
        ended = [self._ended(i, 0.0) for i, n in enumerate(self.max_new) if n == 0]
        for piece in ended:  # ended for sample_rows too: else its tokens would go on into the result handed out
            self.finished[piece.row] = True
        if ended:
            yield ended
        eos_ids = self.request.eos_ids
        steps = sample_rows(self.model, self.rows, max(self.max_new), self.request.settings,
                            private_generator(self.model, self.request.seed), self.finished,
                            padding_id(self.model.tokenizer), self.request.min_new_tokens, eos_ids,
                            lookahead=self.lookahead, steady=True, recorder=self.recorder, joins=self.joins)
        with closing(steps):
            for next_ids in steps:
                now = time.perf_counter() - self._clock
                grown = []
                done = self.finished.tolist()  # one read a step: indexing the tensor per row costs more
                for i, token in enumerate(next_ids.tolist()):
                    if done[i]:
                        if self.results[i] is None:  # ended from outside (end_row) since the last step
                            grown.append(self._ended(i, now))
                        continue
                    if self.firsts[i] is None:
                        self.firsts[i] = now
                    self.outputs[i].append(token)
                    piece = self.assemblers[i].add(token) if self.assemblers[i] is not None else ""
                    if token in eos_ids:
                        self.reasons[i] = "eos"
                    elif self.assemblers[i] is not None and self.assemblers[i].stopped:
                        self.reasons[i] = "stop"
                    elif len(self.outputs[i]) < self.max_new[i]:
                        if piece:
                            grown.append(RowPiece(i, piece))
                        continue
                    self.finished[i] = True  # an end as EOS is: sample_rows stops once every row has one
                    grown.append(self._ended(i, now, piece))
                if self.joins is not None:
                    self._drop_ended_last_rows()
                if grown:
                    yield grown
        if self.joins is not None:
            self.joins.slot = None  # over: nothing joins any more (a queued join would never run)
        now = time.perf_counter() - self._clock
        ended = [self._ended(i, now) for i in range(len(self.rows)) if self.results[i] is None]
        if ended:
            yield ended

    def _drop_ended_last_rows(self) -> None:
        """Decode fewer rows from the next step when the last ones have ended (a long answer
        left alone after a burst then decodes at one row's pace); a join adds them back."""
        live = self.live
        while live > 1 and self.results[live - 1] is not None:
            live -= 1
        if live < self.live:
            self.live = self.joins.rows = live

    def _ended(self, row: int, now: float, piece: str = "") -> RowPiece:
        """Row ``row``'s last piece (``piece`` and what its assembler held back) and its result."""
        assembler = self.assemblers[row]
        if assembler is not None:
            piece += assembler.finish()
        out = self.outputs[row]
        scores: dict[str, Any] = {}
        if self.recorder is not None:  # read back now: this row's steps are all recorded
            chosen, tops = self.recorder.rows([len(tokens) for tokens in self.outputs])[row]
            scores = {"logprobs": chosen, "top_logprobs": tops}
        first = self.firsts[row]
        result = GenerationResult(out, assembler.text if assembler else "", list(self.rows[row]), self.reasons[row],
                                  prompt_seconds=first - self.started[row] if out and first is not None else None,
                                  seconds=now - self.started[row], **scores)
        self.results[row] = attach_tokenizer(result, self.model.tokenizer)
        return RowPiece(row, piece, self.results[row])
