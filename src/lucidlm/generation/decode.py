"""The prefill/decode loop over the model's static KV cache.

Generation runs the model twice over:

1. prefill: the whole (left-padded) prompt in one forward pass, filling cache slots
   0..L-1 and giving the logits for the first new token;
2. decode: one token per step, written at the next slot; each step attends to the cache
   instead of recomputing the prefix, so a step costs O(1) tokens of compute.

``DecodeSession`` owns that bookkeeping (slots, padding mask, cache set-up and clean-up);
what to do with the logits (sample, beam search, stop) is the caller's business.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from lucidlm.errors import GenerationError
from lucidlm.generation.prompt_cache import CacheReuse, KeptCache, model_state, reusable_slots, take_over
from lucidlm.generation.row_joins import RowJoins
from lucidlm.model.transformer import Transformer

# model -> the session whose KV cache it holds. A model has one cache, so the last session to
# open owns it; a paused stream whose cache another generation has taken must not decode on
# (its tokens would come from the other prompt's keys), nor clear that generation's cache.
_CACHE_OWNER: "weakref.WeakKeyDictionary[Any, DecodeSession]" = weakref.WeakKeyDictionary()
# Taking the cache over (set up + owner) and handing it back happen under this lock. Only the
# owner's own thread may take it over (a paused stream, then generate): a session checks that it
# owns the cache and then steps, and a second thread setting up its cache between the two made
# the step run on the other prompt's cache, with wrong tokens and no error.
# Re-entrant: the garbage collector closes an abandoned stream held in a reference cycle at
# whatever allocation it runs, setting up a cache under this lock included, and that stream's
# session takes the lock in its ``__exit__``; a plain Lock hung the process there for good.
_OWNER_LOCK = threading.RLock()


class DecodeSession:
    """Use as a context manager: the KV cache lives exactly as long as the ``with`` block.

    rows: token ids per sequence (B rows, each non-empty, already checked against the
    vocabulary). Rows of different lengths are left-padded to the same length L, so every
    row's next token lands in the same slot, and an attention mask hides the padding
    (positions count from each row's first real token, so padding does not shift RoPE). Their
    prompts are prefilled one row at a time, each as it would run alone (``_prefill_each_row``).
    capacity: total slots to allocate, L + the most tokens that will be fed back.
    same_rows: every row is the same prompt (beam search's beams): the prompt runs once, in
    one row, whose cache slots are then copied to the others.
    joinable: new prompts may take over finished rows while it decodes (``join_row``,
    ``row_joins.py``), so the padding mask is kept even when no row is padded yet;
    ``reserve_rows``: the most rows it may grow to, for which the cache keeps room.

    The model is called through ``prefill_step`` / ``decode_step`` when it has them (a
    ``LanguageModel``, compiled or not), else through ``Transformer.step``: the unchecked
    forward pass. A decode step passes tensors of the same shapes every time (the slot is a
    device tensor bumped in place, the mask covers the whole cache) and reads nothing back.
    """

    def __init__(self, model: Transformer, rows: Sequence[Sequence[int]], capacity: int,
                 pad_id: int = 0, steady: bool = False, reuse: Optional[CacheReuse] = None,
                 same_rows: bool = False, joinable: bool = False, reserve_rows: int = 0) -> None:
        self.model = model
        if same_rows and any(list(row) != list(rows[0]) for row in rows):
            raise GenerationError("DecodeSession(same_rows=True) needs every row to be the same prompt.")
        self.same_rows = same_rows
        # reuse: start from the cache the model kept from its last generation where the prompt
        # begins with what it holds, and keep this one for the next (``keep``); prompt_cache.py
        self.reuse = reuse if len(rows) == 1 else None
        self._row = list(rows[0]) if self.reuse is not None else []
        self._state: Optional[tuple] = None  # the model's state at the start (prompt_cache.model_state)
        self._kept_ids: Optional[list[int]] = None  # set by keep(): the ids in the cache's first slots
        # steady: the caller runs no code of its own between steps (``sample_rows``' lookahead or steady),
        # so the model may keep what its decode step looks up (``Transformer.steady_decode``)
        self._steady = model.steady_decode() if steady and hasattr(model, "steady_decode") else None
        self.batch_size = len(rows)
        self.row_lengths = [len(r) for r in rows]
        self._prompts = [tuple(row) for row in rows]  # on the host: which rows hold the same prompt
        self.prompt_len = max(self.row_lengths)
        self.capacity = capacity
        _check_capacity(model, self.prompt_len, capacity)
        device = model.device
        padded = torch.full((self.batch_size, self.prompt_len), pad_id, dtype=torch.long)
        mask = torch.ones((self.batch_size, capacity), dtype=torch.bool)  # decoded slots are real for every row
        for i, row in enumerate(rows):
            padded[i, self.prompt_len - len(row):] = torch.tensor(list(row), dtype=torch.long)
            mask[i, :self.prompt_len - len(row)] = False
        self.prompt_ids = padded.to(device)  # (B, L)
        # With no padding, the cache's causal mask alone is exact: skip the padding mask.
        has_padding = any(len(row) < self.prompt_len for row in rows)
        self.has_padding = has_padding
        self.reserve_rows = reserve_rows if joinable else 0
        if joinable and getattr(model, "compiled", False):
            raise GenerationError("a compiled model's batch cannot take new rows while it decodes (its prompt graph is "
                                  "traced for a new cache); run the batch without joins")
        self.joinable = joinable
        # (B, capacity), or None
        self.attention_mask: Optional[torch.Tensor] = mask.to(device) if has_padding or joinable else None
        self._prefill = getattr(model, "prefill_step", None) or model.step
        self._decode = getattr(model, "decode_step", None) or model.step
        self.input_pos = torch.tensor([self.prompt_len], device=device)  # (1,) the slot of the next token
        self.next_slot = 0
        self.caches: Any = None  # the model's KV cache once this session has set it up

    # Each call enters inference mode itself: a ``with`` around a generator's yields would
    # leak the mode into the caller's code between steps.
    @torch.inference_mode()
    def __enter__(self) -> "DecodeSession":
        self.thread = threading.get_ident()
        owner = _CACHE_OWNER.get(self.model)
        if owner is not None and owner.thread != self.thread:
            # Perhaps a stream another thread dropped inside a reference cycle (a notebook's
            # traceback keeps one): only the collector closes it, so collect once before refusing.
            gc.collect()
        with _OWNER_LOCK:
            owner = _CACHE_OWNER.get(self.model)
            if owner is not None and owner.thread != self.thread:
                raise GenerationError(
                    "another thread is generating on this model (or holds a stream it has not finished or "
                    "closed): the model has one KV cache, so one generation runs on it at a time. Wait for "
                    "the other thread (a lock around generate), or give each thread its own model "
                    "(copy.deepcopy(model)).")
            # Owner before the set-up: a stream of this model the collector closes during it (see
            # _OWNER_LOCK) then sees the cache is no longer its own and leaves the new one alone.
            # A set-up that fails still ends the paused stream, as one that succeeds would.
            _CACHE_OWNER[self.model] = self
            if owner is not None:  # a paused stream of this thread: its steady run ends with its cache
                owner._end_steady()
            # every set-up forgets what the last generation kept (its buffers may be set up again)
            kept = getattr(self.model, "kept_kv_cache", None)
            try:
                self.model.setup_kv_cache(self.batch_size, max_seq_len=self.capacity,
                                          **({"reserve_rows": self.reserve_rows} if self.reserve_rows else {}))
                if self.reuse is not None:
                    self._take_over(kept)
            except BaseException:
                self._release()
                raise
        if self._steady is not None:
            self._steady.__enter__()
        # the cache this session decodes on: set up anew by hand meanwhile, it is another's (_check_owner)
        self.caches = caches = getattr(self.model, "kv_caches", None)
        if self.attention_mask is not None and caches is not None:
            # The model may round its cache up (a compiled one does): the mask covers all of
            # it, so the step's shapes depend on the cache alone, not on this prompt.
            extra = caches[0].max_seq_len - self.attention_mask.shape[1]
            self.attention_mask = F.pad(self.attention_mask, (0, max(extra, 0)), value=True)
        return self

    def _take_over(self, kept: Optional[KeptCache]) -> None:
        """Take the kept cache's slots that this prompt shares (``prompt_cache.py``)."""
        self._state = model_state(self.model)
        caches = getattr(self.model, "kv_caches", None)
        slots = reusable_slots(kept, self._state, self._row, caches)
        if slots:
            take_over(kept, caches, slots)
        self.reuse.cached_tokens = slots

    def keep(self, ids: torch.Tensor) -> None:
        """The generation ended normally and the cache's first slots hold ``ids`` (T,): keep the
        cache for the next generation that asks to reuse it (read back once, at the end)."""
        if self.reuse is not None and self._state is not None:
            self._kept_ids = ids.tolist()

    def __exit__(self, *exc: Any) -> None:
        # A stream left unfinished is closed as the interpreter exits, when torch's classes may
        # already be gone: there is nothing left to free then.
        if sys.is_finalizing():
            return
        self._end_steady()
        self._release()

    def _end_steady(self) -> None:
        """Forget the operands this session's steady run kept. Also when another generation takes
        the cache over from this paused one: a plain stream after it ran on its kept operands, and
        a torch hook its caller attached between tokens was never called."""
        steady, self._steady = self._steady, None
        if steady is not None:
            steady.__exit__(None, None, None)

    def _release(self) -> None:
        with _OWNER_LOCK:
            if _CACHE_OWNER.get(self.model) is self:  # else the cache is another session's now: leave it
                del _CACHE_OWNER[self.model]
                if getattr(self.model, "kv_caches", None) is self.caches:  # not one set up by hand since
                    self.model.clear_kv_cache()
                    if self._kept_ids is not None and model_state(self.model) == self._state:
                        self.model.kept_kv_cache = KeptCache(self.caches, self._kept_ids, self._state)

    def _check_owner(self) -> None:
        if _CACHE_OWNER.get(self.model) is not self:
            raise GenerationError(
                "another generation ran on this model while this one was paused (a stream read part-way, "
                "then generate() or another stream): the model has one KV cache and it now holds the other "
                "prompt. Finish or close a stream before generating again on the same model, or load a "
                "second model.")
        if getattr(self.model, "kv_caches", None) is not self.caches:
            raise GenerationError(
                "the model's KV cache was set up anew or cleared while this generation was paused "
                "(model.setup_kv_cache / clear_kv_cache, e.g. for run_with_cache(input_pos=...)): it no longer "
                "holds this prompt, so the generation cannot go on. Finish or close a stream before using the "
                "cache by hand, or load a second model.")

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """Run the prompt; logits (B, V) for the first new token."""
        self._check_owner()
        start = self.reuse.cached_tokens if self.reuse is not None else 0  # slots taken over from the kept cache
        slots = torch.arange(start, self.prompt_len, device=self.prompt_ids.device)  # (L - start,)
        # From slot 0 the cache was just set up (new_cache); after kept slots the rest of the
        # prompt attends over the whole cache, with the mask from its slots, as a decode step
        # does. That pass runs eagerly: a compiled model's prompt graph is traced for a new
        # cache, and a second one for a continued cache would cost another compile (a minute on
        # 2 cores) at a chat's second turn, for a pass of a message's few tokens.
        # rows of different lengths, each prefilled alone; not for a compiled model, whose prompt graph
        # for one row against a cache of B rows would be one more graph to compile (a minute on 2 cores)
        if start == 0 and not self.same_rows and self.has_padding and not getattr(self.model, "compiled", False):
            return self._prefill_each_row()
        run = self._prefill if start == 0 else self.model.step
        once = self.same_rows and start == 0 and self.batch_size > 1  # one row's pass, then its slots copied
        # no padding (a joinable session keeps an all-real mask): SDPA's causal path, as without one
        mask = self.attention_mask if self.has_padding else None
        logits = run(self.prompt_ids[:1 if once else self.batch_size, start:], input_pos=slots,
                     attention_mask=mask, last_token_only=True, new_cache=start == 0)
        if once:  # the prompt's slots of row 0 to every row: beam search's n beams ran it n times before
            rows = torch.zeros(self.batch_size, dtype=torch.long, device=self.prompt_ids.device)
            self.model.reorder_kv_cache(rows, self.prompt_len)
            logits = logits.expand(self.batch_size, -1, -1)
        self.next_slot = self.prompt_len
        return logits[:, -1].float()  # (B, V)

    def _prefill_each_row(self) -> torch.Tensor:
        """Prompts of different lengths: each row's prompt runs alone, as ``generate`` runs it
        (its own slots 0..n-1, no padding), and moves to where its left-padded row keeps it.
        One padded pass over all rows computes the attention with a padding mask, which rounds
        differently: SmolLM2's int4 default, log-probs ~1e-3 off the row's alone, and greedy
        tokens swapped at near-ties (16 prompts x 48 tokens: one). Run so, a row of a batch
        gets exactly its alone's bits: the decode steps' attention starts at a row's first
        real slot (``kernels/decode_attention.c``), so padding changes nothing after the prompt.
        Logits (B, V) for the first new tokens."""
        L = self.prompt_len
        rows_of: dict[tuple[int, ...], list[int]] = {}  # a prompt -> the rows that hold it (n choices: n rows)
        for row in range(self.batch_size):
            rows_of.setdefault(self._prompts[row], []).append(row)
        last: list[Any] = [None] * self.batch_size
        # row 0's prompt last: the others pass through its slots; within it, row 0 placed last too
        for rows in sorted(rows_of.values(), key=lambda rows: rows[0] == 0):
            n = self.row_lengths[rows[0]]
            slots = torch.arange(n, device=self.prompt_ids.device)  # (n,)
            logits = self._prefill(self.prompt_ids[rows[0]:rows[0] + 1, L - n:], input_pos=slots,
                                   attention_mask=None, last_token_only=True, new_cache=True)  # in cache row 0
            for row in reversed(rows):  # (1, 1, V) logits, once a prompt
                self.model.place_kv_row(row, n, L - n)
                last[row] = logits[:, -1]
        self.next_slot = L
        return torch.cat(last).float()  # (B, V)

    @torch.inference_mode()
    def join_row(self, row: int, ids: Sequence[int]) -> torch.Tensor:
        """A new prompt ``ids`` (n tokens, checked) takes over row ``row``, whose generation has
        ended, or is a new row (``row`` = ``batch_size``: every layer's cache grows by one row):
        it runs alone, as ``_prefill_each_row`` runs a prompt, in cache row 0 (whose first n
        slots are put back after), moves to the n slots before the next free one, and the row's
        mask hides every slot before it. Logits (V,) for the row's first new token; the next
        ``step`` feeds it at ``next_slot`` with the others (``row_joins.py``)."""
        n, end = len(ids), self.next_slot
        if not self.joinable or self.next_slot == 0:
            raise GenerationError("DecodeSession.join_row() needs a session opened with joinable=True and its "
                                  "prompt run (prefill)")
        if not 0 < n <= end or not 0 <= row <= self.batch_size:
            raise GenerationError(f"DecodeSession.join_row(): a {n}-token prompt cannot join row {row} with "
                                  f"{end} slots before the next one ({self.batch_size} rows)")
        self._check_owner()
        if row == self.batch_size:  # a new row, all masked until its prompt is placed
            self.model.add_kv_rows(1, end)
            self.attention_mask = torch.cat([self.attention_mask, self.attention_mask[:1]])  # (B + 1, S)
            self.batch_size += 1
        kept = self.model.copy_kv_slots(0, n) if row != 0 else None  # row 0's own slots, overwritten by the pass
        prompt = torch.tensor([list(ids)], dtype=torch.long, device=self.prompt_ids.device)  # (1, n)
        logits = self._prefill(prompt, input_pos=torch.arange(n, device=prompt.device), attention_mask=None,
                               last_token_only=True, new_cache=True)  # (1, 1, V)
        self.model.place_kv_row(row, n, end - n)
        if kept is not None:
            self.model.write_kv_slots(0, kept)
        self.attention_mask[row, :end - n] = False  # the row's earlier generation and what came before it
        self.attention_mask[row, end - n:] = True
        return logits[0, -1].float()  # (V,)

    def keep_rows(self, count: int) -> None:
        """Decode only the first ``count`` rows from now on (the others have ended); ``join_row``
        may add rows again."""
        if not self.joinable or not 1 <= count <= self.batch_size:
            raise GenerationError(f"DecodeSession.keep_rows({count}): needs a joinable session and 1 to "
                                  f"{self.batch_size} rows")
        self._check_owner()
        self.model.keep_kv_rows(count)
        self.attention_mask = self.attention_mask[:count]
        self.batch_size = count

    @torch.inference_mode()
    def slide(self, shift: int) -> None:
        """Move every row's slots ``shift`` to the left (``row_joins.py``: no row that goes on
        reads the slots before ``shift``, and a prompt joining needs room at the end), with their
        mask: positions count a row's real slots, so a row that goes on keeps its own. The
        freed slots at the end are real, as decoded slots are; the next token goes ``shift``
        slots earlier. A row whose real slots began earlier has ended: what it reads no longer
        matters."""
        if not self.joinable or not 0 < shift < self.next_slot:
            raise GenerationError(f"DecodeSession.slide({shift}): needs a joinable session and 0 < shift < "
                                  f"{self.next_slot} (the next free slot)")
        self._check_owner()
        self.model.shift_kv_slots(shift, self.next_slot)
        mask = self.attention_mask  # (B, S)
        mask[:, :-shift] = mask[:, shift:].clone()
        mask[:, -shift:] = True
        self.next_slot -= shift
        self.input_pos -= shift  # on the device, as step() bumps it
        self.prompt_len = max(self.prompt_len - shift, 0)  # step() bumps input_pos once past it

    @torch.inference_mode()
    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """Feed one new token per row (B,); logits (B, V) for the token after it."""
        # Python-side counts only: nothing is read back from the device. Past the end, a
        # compiled step would fail deep inside its kernels and an eager one on index_copy_.
        if self.next_slot == 0:
            raise GenerationError("DecodeSession.step() before prefill(): run the prompt first, "
                               "its logits give the first new token")
        self._check_owner()
        if self.next_slot >= self.capacity:
            raise GenerationError(f"the session's KV cache is full: it holds {self.capacity} tokens (prompt "
                               f"{self.prompt_len} + {self.capacity - self.prompt_len} fed back); open the "
                               f"DecodeSession with a larger capacity")
        if self.next_slot > self.prompt_len:
            self.input_pos += 1  # on the device: no new tensor, no host round trip
        logits = self._decode(next_ids.view(self.batch_size, 1), input_pos=self.input_pos,
                              attention_mask=self.attention_mask, last_token_only=True)
        self.next_slot += 1
        return logits[:, -1].float()  # (B, V)

    @torch.inference_mode()
    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed T tokens per row (B, T) at the next T slots in one pass; logits (B, T, V) for the
        token after each (speculative decoding checks its drafted tokens so, ``speculative.py``).
        The ordinary forward pass over the kept cache, as ``prefill`` runs a continued prompt
        (on lucidlm's CPU kernels, a few tokens take the one-call decode step: the plain
        step's stream to the bit, and its logits where the unembedding is quantized too, ~3x
        faster than the modules' pass; model/decode_block.py):
        each query sees the slots up to its own, so slots past it that hold rejected drafts
        of an earlier round are hidden, then overwritten."""
        if self.next_slot == 0:
            raise GenerationError("DecodeSession.feed() before prefill(): run the prompt first")
        self._check_owner()
        T = ids.shape[1]
        if self.next_slot + T > self.capacity:
            raise GenerationError(f"the session's KV cache is full: it holds {self.capacity} tokens, and {T} more "
                                  f"from slot {self.next_slot} do not fit; open the DecodeSession with a larger "
                                  f"capacity")
        slots = torch.arange(self.next_slot, self.next_slot + T, device=self.input_pos.device)  # (T,)
        logits = self.model.step(ids, input_pos=slots, attention_mask=self.attention_mask)
        self.next_slot += T
        self.input_pos.fill_(self.next_slot - 1)  # the last slot written, as after a step
        return logits.float()  # (B, T, V)

    def rewind(self, slot: int) -> None:
        """Forget slots ``slot``.. (drafted tokens the model rejected): the next token fed is
        written at ``slot``. Nothing is erased: the mask hides slots past a query's own."""
        if not self.prompt_len <= slot <= self.next_slot:
            raise GenerationError(f"DecodeSession.rewind({slot}): the slot must lie between the prompt's end "
                                  f"({self.prompt_len}) and the next free slot ({self.next_slot})")
        self.next_slot = slot
        # step() bumps input_pos before writing past the prompt: leave it one slot behind
        self.input_pos.fill_(max(slot - 1, self.prompt_len))

    @torch.inference_mode()
    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Keep cache rows ``beam_idx`` (B,), in that order (beam search)."""
        self._check_owner()
        self.model.reorder_kv_cache(beam_idx, self.next_slot)  # the slots written so far


def _check_capacity(model: Any, prompt_len: int, capacity: int) -> None:
    """The cache cannot hold more than the context (``setup_kv_cache`` would shrink it, and the
    step past its end would fail inside torch) nor less than the prompt."""
    context = getattr(getattr(model, "config", None), "max_seq_len", None)
    if context is not None and capacity > context:
        raise GenerationError(f"DecodeSession capacity={capacity} is more than the model's context of {context} "
                              f"tokens (max_seq_len); open it with at most {context} (prompt {prompt_len} + "
                              f"{context - prompt_len} fed back).")
    if capacity < prompt_len:
        raise GenerationError(f"DecodeSession capacity={capacity} cannot hold the {prompt_len}-token prompt; open it "
                              f"with at least {prompt_len} (prompt + the tokens to feed back).")


def sample_rows(model: Any, rows: Sequence[Sequence[int]], max_new_tokens: int, settings: Any,
                generator: Optional[torch.Generator], finished: torch.Tensor, pad_id: int = 0,
                min_new_tokens: int = 0, eos_ids: Sequence[int] = (),
                lookahead: bool = False, steady: bool = False, recorder: Any = None,
                reuse: Optional[CacheReuse] = None, joins: Optional[RowJoins] = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every row (B,) for up to ``max_new_tokens`` steps; the
    ``eos_ids`` cannot be chosen in a row's first ``min_new_tokens`` steps. ``recorder`` (a
    ``LogprobRecorder``) keeps each step's log-probs on the device.

    ``finished`` (B,) bool is owned by the caller, who sets a row when it ends (EOS, stop
    string); the loop stops early once every row has. Finished rows keep decoding in
    lockstep (cheaper than reshaping the cache); their tokens are simply ignored.
    Close the generator (or exhaust it) to free the cache.

    ``lookahead``: queue the step that feeds a token back *before* yielding the token. On a
    GPU the caller's read of the token then overlaps the next step instead of leaving the
    device idle while Python handles it (``TokenReadback``: the read waits for the token's own
    copy, not for the step queued behind it); the tokens are the same, and a row that ends
    wastes one step. Queueing two steps ahead was measured and gained nothing (H100,
    2026-11-26: 679 against 683 tok/s). Only for callers whose code between tokens cannot
    change the model (``generate``, not ``stream``, whose loop body may attach hooks); for the
    same reason the model may keep what its decode step looks up (``DecodeSession``'s ``steady``).
    ``steady`` alone makes the second promise without the first (``stream(..., steady=True)``:
    on a CPU, queueing the next step before yielding a token would only delay the token).

    ``reuse``: start from the cache the model kept from its last generation, and keep this one
    when the run ends normally: every step done, or the caller closing the generator after
    setting every row's ``finished`` (EOS, a stop string); a caller that stops reading for any
    other reason (Ctrl-C) leaves nothing kept (``prompt_cache.py``).

    ``joins``: new prompts may take over finished rows, or add rows, between steps (continuous
    batching, ``row_joins.py``): the caller queues them while it holds a step's tokens and
    clears their rows' ``finished``; the loop then runs until the last joined row's budget too,
    within the cache's ``joins.capacity`` slots. The caller may also have the last rows, ended,
    dropped (``joins.rows``): the yielded ids then have fewer rows. Not with ``lookahead``,
    ``recorder`` or ``reuse``.
    """
    from lucidlm.generation.sampling import sample_next

    if max_new_tokens <= 0:
        return
    if joins is not None and (lookahead or recorder is not None or reuse is not None):
        raise GenerationError("sample_rows(joins=...) takes no lookahead, recorder or reuse: they are one batch's")
    B, L = len(rows), max(len(r) for r in rows)
    capacity = L + max_new_tokens - 1 if joins is None else joins.capacity
    if capacity < L + max_new_tokens - 1:
        raise GenerationError(f"sample_rows: {joins.capacity} cache slots cannot hold a {L}-token prompt and "
                              f"{max_new_tokens} new tokens")
    # Every token seen so far, per row and by slot (column L + t holds step t's), for the processors that
    # look back (repetition penalty, n-grams). Padding slots repeat the row's first token: penalising a
    # token twice is the same as once; the n-gram ban skips them (``padding``).
    seen = torch.empty((B, capacity + 1), dtype=torch.long)
    for i, row in enumerate(rows):
        seen[i, :L] = torch.tensor([row[0]] * (L - len(row)) + list(row), dtype=torch.long)
    seen = seen.to(model.device)
    # each row's padding columns, its first real slot: n-grams and sequences the processors match must not
    # span them (padding (B, 1) on the device); on the host, the joins' slack
    starts = [L - len(row) for row in rows]
    padding = torch.tensor([[start] for start in starts], device=model.device) if any(starts) or joins is not None \
        else None
    readback = TokenReadback(seen.device, B, capacity + 1 - L)
    born = [0] * B  # the step of each row's first token (a joined row's: the step it joined at)
    limit = max_new_tokens  # steps to run: the furthest a row's budget reaches
    moved = 0  # slots the batch has slid left (joins): step t's token goes to slot L + t - moved
    with DecodeSession(model, rows, capacity=capacity, pad_id=pad_id, steady=lookahead or steady, reuse=reuse,
                       joinable=joins is not None, reserve_rows=joins.max_rows if joins is not None else 0) as session:
        logits = session.prefill()
        t = 0
        while True:
            with torch.inference_mode():
                if t < max(born) + min_new_tokens:
                    logits = suppress(logits, eos_ids, [i for i in range(B) if t < born[i] + min_new_tokens])
                next_ids = sample_next(logits, settings, seen[:, :L + t - moved], generator, recorder, padding,
                                       max(L - moved, 0))  # (B,)
                seen[:, L + t - moved] = next_ids
            sent = readback.send(t, next_ids)  # before the next step is queued behind the ids
            last = t + 1 == limit  # the last token is never fed back: no forward pass for it
            if lookahead and not last:
                logits = session.step(next_ids)  # queued on the device; the caller's read overlaps it
            if joins is not None:
                joins.slot = L + t + 1 - moved  # a row joining now gets its first token at the next step
                going_on = [start for start, done in zip(starts, finished[:B].tolist()) if not done]
                joins.slack = min(going_on, default=joins.slot)
            try:
                yield readback.receive(*sent)
            except GeneratorExit:
                if reuse is not None and bool(finished.all()):  # the caller ended the row: a normal end
                    session.keep(seen[0, :session.next_slot])
                raise
            joined, keep, shift = joins.take() if joins is not None else ([], None, 0)
            if keep is not None and keep < B:  # the last rows have ended: decode the others only
                B = keep
                session.keep_rows(B)
                next_ids, seen, born, starts = next_ids[:B], seen[:B], born[:B], starts[:B]
            if joined:
                limit = max(limit, t + 1 + max(join.max_new_tokens for join in joined))
            elif last or bool(finished.all()):
                if reuse is not None:
                    session.keep(seen[0, :session.next_slot])
                return
            if not lookahead:
                logits = session.step(next_ids)
            t += 1
            if shift:  # the joins need room at the cache's end: every row's slots move left (row_joins.py)
                session.slide(shift)
                moved += shift
                with torch.inference_mode():
                    seen[:, :-shift] = seen[:, shift:].clone()
                starts = [max(start - shift, 0) for start in starts]  # a row that began earlier has ended
            for join in sorted(joined, key=lambda join: join.row):  # new rows in order, at the end
                # after the step, which wrote slot L + t - moved - 1 of every row, the row taken over too
                with torch.inference_mode():
                    row_logits = session.join_row(join.row, join.ids)  # (V,)
                    n, end = len(join.ids), L + t - moved
                    row_seen = torch.tensor([join.ids[0]] * (end - n) + join.ids, device=seen.device)  # (end,)
                    if join.row == B:  # a new row
                        logits = torch.cat([logits, row_logits[None]])
                        seen = torch.cat([seen, seen[:1]])
                        born.append(t)
                        starts.append(0)
                        B += 1
                        readback.make_room(B)
                    logits[join.row] = row_logits
                    seen[join.row, :end] = row_seen
                born[join.row] = t
                starts[join.row] = end - n
            if joins is not None and (joined or shift or keep is not None):
                padding = torch.tensor([[start] for start in starts], device=model.device)  # (B, 1)


class TokenReadback:
    """Sampled token ids on their way to the host, for ``sample_rows``.

    On CUDA, each step's ids are copied into pinned host memory as soon as they are sampled,
    and an event marks the copy; handing them out waits for that event only. A plain
    ``.tolist()`` waits for everything queued on the stream: with the next step already
    queued behind the ids (``lookahead``) it waited for that whole step too, and the host
    queued the step after it only once the device had gone idle. H100, the 1B-shaped GPU
    benchmark, 2026-11-26: 1.78 ms a token with every token read against 1.46 with none read;
    with this, 1.465 (``benchmarks/bench_generation_gpu.py --diagnose``). On a CPU, where the
    work is done when the call returns, the ids pass through.
    """

    def __init__(self, device: torch.device, batch_size: int, steps: int) -> None:
        # One row per step, never reused: a copy still in flight cannot be overwritten.
        self.host = (torch.empty((steps, batch_size), dtype=torch.long, pin_memory=True)
                     if device.type == "cuda" else None)  # (steps, B)

    def make_room(self, rows: int) -> None:
        """Room for ``rows`` ids a step (rows joined the batch; every copy so far was received)."""
        if self.host is not None and rows > self.host.shape[1]:
            self.host = torch.empty((self.host.shape[0], rows), dtype=torch.long, pin_memory=True)

    def send(self, t: int, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start moving step ``t``'s ids (B,) to the host; what ``receive`` takes."""
        if self.host is None:
            return ids, None
        # a batch that slides (continuous batching) runs past its steps: the rows come round again, each
        # copy received before the next is sent; one whose last rows ended has fewer ids
        row = self.host[t % self.host.shape[0], :ids.shape[0]]
        row.copy_(ids, non_blocking=True)  # queued on the ids' device's current stream
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(ids.device))  # that stream, also when another GPU is current
        return row, copied

    @staticmethod
    def receive(ids: torch.Tensor, copied: Any) -> torch.Tensor:
        """The ids (B,): on the host once their copy is done (CUDA), else as they were."""
        if copied is not None:
            copied.synchronize()
        return ids


def suppress(logits: torch.Tensor, token_ids: Sequence[int], rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """logits (B, V) with ``token_ids`` made impossible in ``rows`` (None: all; min_new_tokens
    keeps EOS away)."""
    if not token_ids:
        return logits
    logits = logits.clone()
    if rows is None or len(rows) == logits.shape[0]:
        logits[:, list(token_ids)] = float("-inf")
    else:
        logits[torch.tensor(list(rows), device=logits.device)[:, None], list(token_ids)] = float("-inf")
    return logits
