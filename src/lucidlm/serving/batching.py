"""``lucidlm serve --parallel N``: requests decode together as one batch of up to N rows.

When the model becomes free, the request at the head of the queue takes along the waiting
requests that can share its batch, up to N rows in all, and their rows decode as one
left-padded batch (``generation/batch_run.py``). While it runs, a request that arrives takes
over rows that have ended (continuous batching, as llama-server's slots; ``Joining``,
``generation/row_joins.py``), if it fits: its prompt no longer than the batch has run, its
budget within the batch's cache, which has ``JOIN_ROOM`` slots more than its first rows
need, and slides left when the rows that read its first slots have ended (so under steady
load a batch goes on taking requests). The batch takes waiting requests oldest first and
stops at the first it cannot take, which then leads the next batch: nothing waits behind
requests that came after it.
``--no-cont-batching`` turns joining off (static batching: a request that arrives while a
batch runs waits for the next one).

Each response is what the request alone would get, so only what can promise that batches:

- greedy requests (on lucidlm's CPU kernels a batched row gets exactly its alone's bits: each
  prompt is prefilled on its own, ``DecodeSession._prefill_each_row``; on torch's attention, a
  float model's or a GPU's, the decode steps over a padded cache round differently, ~5e-5 in
  SmolLM2's float32 logits, which could swap a greedy near-tie that close), and unseeded sampling
  ones (random anyway; the batch shares one generator). A seeded sampling request promises
  ``generate(seed=...)``'s answer, so it runs alone;
- not with log-probs, which on torch's attention would not be alone's to the digit; and rows
  join a batch under way only without presence or frequency penalties (they count a row's
  tokens from the batch's first step) and not on a compiled model (``BatchRun.can_take_joins``);
- not with ``cache_prompt`` or a server ``--draft``: prompt reuse and speculative decoding
  are one-row techniques;
- only rows that fit the context after the batch's longest prompt (``fits_together``); a chat
  request without ``max_tokens`` (until the end of the context) fits any batch, its end then the
  batch's shared one.

Requests share a batch when every option that is not per row is equal (the sampling settings
after the model's defaults, ``min_new_tokens``, EOS handling); per row are the prompt (chat or
completion), ``max_tokens``, ``stop``, streaming or not, and ``n`` (each choice is a row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from lucidlm.generation.batch_run import BatchRun, fits_together
from lucidlm.generation.defaults import apply_sampling_defaults
from lucidlm.generation.request import Request, make_request, stop_strings
from lucidlm.serving.fair_lock import FairLock
from lucidlm.serving.openai_protocol import GenerationJob, model_refusals
from lucidlm.serving.model_worker import ModelWorker
from lucidlm.serving.row_feed import RowFeed

PER_ROW = ("max_new_tokens", "stop")  # the options rows of one batch may differ in
# Cache slots a batch keeps past what its first rows need, for requests that join it under way
# (a joined row's prompt and answer must end within the batch's cache). SmolLM2-135M's float32
# cache: 46 KB a slot and row, so 512 slots are 24 MB a row; 4 rows (the default --parallel) 94 MB.
JOIN_ROOM = 512


class BatchMember:
    """A request that may share a batch: its rows (one per choice), their budgets and stop
    strings, the options its batch must share, and, once in a batch, one ``RowFeed`` a row."""

    def __init__(self, job: GenerationJob, rows: list[list[int]], options: dict[str, Any], request: Request,
                 open_ended: bool = False) -> None:
        self.job, self.rows, self.request = job, rows, request
        self.shared = {k: v for k, v in options.items() if k not in PER_ROW}
        self.max_new = [options["max_new_tokens"]] * len(rows)
        # open_ended: a chat request without max_tokens runs to the end of the context; in a batch, to the end of
        # the shared one, (longest prompt - its prompt) tokens sooner than alone. Held to the same fit
        # as a budget, it would batch only beside shorter prompts, which most chat clients' requests
        # (no max_tokens) never are; an answer that long is rare, and still ends as "length".
        self.fit_budgets = [0 if open_ended else n for n in self.max_new]  # what fits_together holds it to
        self.open_ended = open_ended
        self.stops = [stop_strings(options.get("stop"))] * len(rows)
        self.feeds: list[RowFeed] = []


def batch_member(job: GenerationJob, model: Any, server_options: dict[str, Any], parallel: int) -> \
        Optional[BatchMember]:
    """``job`` ready to share a batch, or None where it must run alone (see the module docstring).
    Its prompts are checked here, before it waits: a prompt the model refuses is its 400."""
    if parallel < 2:
        return None
    options = apply_sampling_defaults(model, job.options_for(model, server_options))
    alone = options.get("reuse_cache") or options.get("draft") is not None or options.get("logprobs") is not None \
        or (job.seed is not None and options.get("temperature") != 0)
    if alone or len(job.prompts) * job.n > parallel:
        return None
    rows = job.batch_rows(model)
    with model_refusals(job):  # a token id the options name past the vocabulary
        request = make_request(options)
        request.use_model(model)
    return BatchMember(job, rows, options, request, open_ended="max_new_tokens" not in job.options)


def joiner(model: Any, leader: BatchMember, parallel: int) -> Callable[[Any], bool]:
    """``FairLock.take_along``'s test for the waiters behind ``leader``: same shared options,
    room for all its rows within ``parallel``, and every row still fitting the context."""
    rows, budgets = list(leader.rows), list(leader.fit_budgets)

    def wanted(member: Any) -> bool:
        if not isinstance(member, BatchMember) or member.shared != leader.shared:
            return False
        if len(rows) + len(member.rows) > parallel or not fits_together(model, rows + member.rows,
                                                                           budgets + member.fit_budgets):
            return False
        rows.extend(member.rows)
        budgets.extend(member.fit_budgets)
        member.feeds = [RowFeed() for _ in member.rows]  # before its thread wakes and reads them
        return True

    return wanted


@dataclass
class Joining:
    """Continuous batching's link from a batch under way to the requests waiting for the model
    (``turn``, the server's queue): after each step, the batch takes the oldest that fit its
    ended rows (``take_joiners``). ``joined`` counts the requests that joined so."""

    turn: FairLock
    room: int = JOIN_ROOM
    joined: int = 0

    def take_joiners(self, run: BatchRun, leader: BatchMember, feeds: list[RowFeed]) -> list[RowFeed]:
        """Queue the waiting requests that fit ``run`` now into its free rows, oldest first, and
        point ``feeds`` (one a row) at their rows' feeds; those new feeds."""
        if not self.turn.waiting or not run.free_rows():
            return []

        def wanted(member: Any) -> bool:
            if not isinstance(member, BatchMember) or member.shared != leader.shared:
                return False
            rows = run.join(member.rows, member.max_new, member.stops, member.open_ended)
            if rows is None:
                return False
            member.feeds = [RowFeed() for _ in member.rows]  # before its thread wakes and reads them
            for row, feed in zip(rows, member.feeds):
                if row == len(feeds):  # a new row
                    feeds.append(feed)
                feeds[row] = feed
            return True

        taken = self.turn.take_along(wanted, in_order=True)
        self.joined += len(taken)
        return [feed for member in taken for feed in member.feeds]


def start_batch(model: Any, members: list[BatchMember], on_end: Callable[[], None], worker: ModelWorker,
                joining: Optional[Joining] = None, max_rows: int = 0) -> None:
    """Decode every member's rows as one batch on the server's model thread (``worker``), which
    calls ``on_end`` (the server's release of the model) when the batch is over, whatever happened;
    the members' own threads read their rows meanwhile. ``joining``: requests that wait may join
    it (continuous batching), where its settings allow, taking over its ended rows or adding
    rows up to ``max_rows``."""
    members[0].feeds = [RowFeed() for _ in members[0].rows]
    feeds = [feed for member in members for feed in member.feeds]
    try:
        done = worker.submit(_run, model, members, on_end, joining, max_rows)
    except RuntimeError as exc:  # the server is shutting down
        return _abandon(feeds, exc, on_end)
    done.add_done_callback(lambda done: _never_ran(done, feeds, on_end))


def _never_ran(done: Any, feeds: list[RowFeed], on_end: Callable[[], None]) -> None:
    """The worker's loop ended with the batch still queued and failed it unrun: no one else will
    feed its rows or let go of the model. (``_run`` ends every Exception it meets itself, so an
    Exception here is the worker's refusal.)"""
    if isinstance(done.exception(), Exception):
        _abandon(feeds, done.exception(), on_end)


def _abandon(feeds: list[RowFeed], error: BaseException, on_end: Callable[[], None]) -> None:
    for feed in feeds:
        feed.fail(error)
    on_end()


def _run(model: Any, members: list[BatchMember], on_end: Callable[[], None], joining: Optional[Joining],
         max_rows: int) -> None:
    feeds = [feed for member in members for feed in member.feeds]  # one a row; a joined request's replace ended ones
    every_feed = list(feeds)  # all it ever fed: a failure reaches each
    try:
        leader = members[0]
        if joining is not None and not BatchRun.can_take_joins(model, leader.request):
            joining = None
        run = BatchRun(model, [row for m in members for row in m.rows], leader.request,
                       [n for m in members for n in m.max_new], [s for m in members for s in m.stops],
                       join_room=joining.room if joining is not None else 0, max_rows=max_rows)
        for pieces in run.pieces():
            for piece in pieces:
                feeds[piece.row].put(piece.text, piece.result)
            for i, feed in enumerate(feeds):
                if feed.gone and run.results[i] is None:  # its client went away: end its row, the others go on
                    run.end_row(i)
            if joining is not None:
                every_feed += joining.take_joiners(run, leader, feeds)
    except BaseException as exc:  # each request's thread answers it (a bug: its 500); none waits for ever
        for feed in every_feed:
            feed.fail(exc)
        if not isinstance(exc, Exception):
            raise
    finally:
        on_end()
