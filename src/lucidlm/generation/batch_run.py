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
    away), from any thread; ``results`` holds every row's ``GenerationResult`` at the end."""

    def __init__(self, model: Any, rows: Sequence[Sequence[int]], request: Request,
                 max_new_tokens: Sequence[int], stops: Sequence[Sequence[str]], lookahead: bool = False) -> None:
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
        self.finished = torch.zeros(len(self.rows), dtype=torch.bool)  # (B,) sample_rows reads it every step
        self.results: list[Any] = [None] * len(self.rows)
        self.recorder = None if request.logprobs is None else LogprobRecorder(request.logprobs)

    def end_row(self, row: int) -> None:
        """Stop generating for ``row`` (its result is what it had, finish reason "length");
        the others go on, and the batch stops once no row is left."""
        self.finished[row] = True

    def pieces(self) -> Iterator[list[RowPiece]]:
        """Per step, the rows whose text grew or that ended."""
        start = time.perf_counter()
        first: Optional[float] = None  # the first step gives every row its first token
        ended = [self._ended(i, None, 0.0) for i, n in enumerate(self.max_new) if n == 0]
        for piece in ended:  # ended for sample_rows too: else its tokens would go on into the result handed out
            self.finished[piece.row] = True
        if ended:
            yield ended
        eos_ids = self.request.eos_ids
        steps = sample_rows(self.model, self.rows, max(self.max_new), self.request.settings,
                            private_generator(self.model, self.request.seed), self.finished,
                            padding_id(self.model.tokenizer), self.request.min_new_tokens, eos_ids,
                            lookahead=self.lookahead, steady=True, recorder=self.recorder)
        with closing(steps):
            for next_ids in steps:
                now = time.perf_counter() - start
                first = now if first is None else first
                grown = []
                done = self.finished.tolist()  # one read a step: indexing the tensor per row costs more
                for i, token in enumerate(next_ids.tolist()):
                    if done[i]:
                        if self.results[i] is None:  # ended from outside (end_row) since the last step
                            grown.append(self._ended(i, first, now))
                        continue
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
                    grown.append(self._ended(i, first, now, piece))
                if grown:
                    yield grown
        now = time.perf_counter() - start
        ended = [self._ended(i, first, now) for i in range(len(self.rows)) if self.results[i] is None]
        if ended:
            yield ended

    def _ended(self, row: int, first: Optional[float], now: float, piece: str = "") -> RowPiece:
        """Row ``row``'s last piece (``piece`` and what its assembler held back) and its result."""
        assembler = self.assemblers[row]
        if assembler is not None:
            piece += assembler.finish()
        out = self.outputs[row]
        scores: dict[str, Any] = {}
        if self.recorder is not None:  # read back now: this row's steps are all recorded
            chosen, tops = self.recorder.rows([len(tokens) for tokens in self.outputs])[row]
            scores = {"logprobs": chosen, "top_logprobs": tops}
        result = GenerationResult(out, assembler.text if assembler else "", list(self.rows[row]), self.reasons[row],
                                  prompt_seconds=first if out else None, seconds=now, **scores)
        self.results[row] = attach_tokenizer(result, self.model.tokenizer)
        return RowPiece(row, piece, self.results[row])
