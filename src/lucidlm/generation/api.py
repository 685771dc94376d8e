"""Text generation: KV-cached sampling, streaming, batches and beam search.

>>> result = generate(model, "Once upon a time", max_new_tokens=20, temperature=0)
>>> result.text, result.token_ids, result.finish_reason
>>> for piece in stream(model, "Hello", chat=True): print(piece, end="", flush=True)

Rules every entry point follows:

- ``prompt`` is text (encoded with ``model.tokenizer``) or a list of token ids. An empty
  prompt starts from the tokenizer's BOS token; with no BOS token it is an error.
- With ``context_overflow="stop"`` (the default) the prompt must fit the context window
  (``config.max_seq_len``) and generation stops with ``finish_reason="length"`` after
  ``max_new_tokens`` or when prompt + output fill the context, whichever comes first. With
  ``"crop"`` it goes on, each token predicted from the last ``max_seq_len`` tokens (seed
  003; what that means for the KV cache is in ``sliding.py``).
- ``min_new_tokens``: EOS cannot be chosen before that many new tokens (HF's rule).
- ``finish_reason`` is ``"eos"`` (the model ended; the EOS id is the last of ``token_ids``
  but not part of ``text``), ``"stop"`` (a stop string appeared: ``text`` ends just before
  it; ``token_ids`` still hold every generated token, the last one completing the stop
  string) or ``"length"``.
- ``text`` is what the output adds to the prompt: ``tokenizer.decode(prompt + token_ids)``
  minus the prompt's text, for every tokenizer (a word-level one puts a space before each
  word; a character split between the prompt and the output belongs to the output).
- Sampling options left at ``None`` come from the model (``generation/defaults.py``: its
  file, a per-model table, else temperature 1), the same in Python and on the command line.
- ``temperature=0`` is greedy. ``seed`` seeds a private generator: same seed, same
  output, and the global torch RNG is left alone.
"""

from __future__ import annotations

import time
from contextlib import closing
from functools import partial
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.batch_run import BatchRun
from lucidlm.generation.beam_search import beam_search
from lucidlm.generation.decode import sample_rows
from lucidlm.generation.defaults import apply_sampling_defaults
from lucidlm.generation.logprobs import LogprobRecorder
from lucidlm.generation.prompt_cache import CacheReuse
from lucidlm.generation.sampling import LogitBias, SequenceBias
from lucidlm.generation.result import GenerationResult, attach_tokenizer
from lucidlm.generation.request import (batch_rows, check_beams, fit_to_context, make_request, padding_id,
                                        private_generator, prompt_ids)
from lucidlm.generation.sliding import sample_with_crop
from lucidlm.generation.speculative import SpeculationStats, check_draft, speculative_rows
from lucidlm.generation.streaming import TextAssembler
from lucidlm.model.transformer import Transformer
from lucidlm.suggest import keywords_checked


Prompt = Union[str, Sequence[int], torch.Tensor]
Prompts = Union[Prompt, Sequence[str], Sequence[Sequence[int]]]


def generate(model: Transformer, prompt: Prompts, *, max_new_tokens: int = 64,
             temperature: Optional[float] = None,
             top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
             repetition_penalty: Optional[float] = None, typical_p: Optional[float] = None,
             epsilon_cutoff: Optional[float] = None, eta_cutoff: Optional[float] = None, seed: Optional[int] = None,
             no_repeat_ngram_size: Optional[int] = None, suppress_tokens: Optional[Sequence[int]] = None,
             bad_words_ids: Optional[Sequence[Sequence[int]]] = None, sequence_bias: Optional[SequenceBias] = None,
             logit_bias: Optional[LogitBias] = None, presence_penalty: Optional[float] = None,
             frequency_penalty: Optional[float] = None,
             stop: Optional[str | Sequence[str]] = None, stop_on_eos: bool = True, num_beams: int = 1,
             length_penalty: float = 1.0, min_new_tokens: int = 0, context_overflow: str = "stop",
             logprobs: Union[bool, int, None] = None, chat: bool = False, reuse_cache: bool = False,
             draft: Optional[Union[str, Transformer]] = None, draft_tokens: Optional[int] = None,
             **unknown: Any) -> Union[GenerationResult, list[GenerationResult]]:
    """Continue ``prompt``; see the module docstring for the rules. ``chat=True`` wraps a
    text prompt as one user message in the model's chat template.

    One prompt (text, a list of ids, a 1-D tensor) gives one ``GenerationResult``; a batch (a
    list of texts, a list of id lists, a 2-D tensor of shape (B, T)) gives a list of B results,
    one per row, generated together (see ``generate_batch``).

    ``num_beams > 1`` runs beam search (one prompt at a time): it keeps the likeliest sequences
    and samples nothing, so it ignores ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff`` and ``seed``; it uses
    ``repetition_penalty``, ``no_repeat_ngram_size``, ``suppress_tokens``, ``bad_words_ids``,
    ``sequence_bias``, ``logit_bias``, ``presence_penalty``, ``frequency_penalty``,
    ``length_penalty``, ``stop`` and ``stop_on_eos`` (a beam that
    writes a stop string ends there, as with EOS: HF's ``stop_strings``).
    ``length_penalty`` needs ``num_beams > 1``.

    ``logprobs=True`` fills ``GenerationResult.logprobs`` (each generated token's log-prob),
    ``logprobs=N`` also ``top_logprobs`` (the N most likely tokens at each step); see
    ``GenerationResult`` for the distribution they come from.

    ``reuse_cache=True`` (prompt caching, ``prompt_cache.py``; ``Conversation`` turns it on):
    the model keeps this generation's KV cache when it ends normally, and a later one with
    ``reuse_cache=True`` whose prompt begins with the ids it holds (the prompt and answer
    before: a chat's next turn) runs only the rest of its prompt. Only where nothing changed
    the model in between (weights, adapters, hooks, another generation); else, and with beams
    or ``context_overflow="crop"``, the whole prompt runs. Greedy tokens are the same either
    way (the prompt's later tokens are computed in a second pass, which may round differently
    in low precision). The kept cache stays in memory until the next generation or
    ``model.clear_kv_cache()``.

    Beams, ``reuse_cache``, ``draft`` and ``context_overflow="crop"`` take one prompt at a time;
    a batch of one row (a (1, T) tensor, as transformers users pass one prompt) is that
    prompt, its result still a list of one.

    ``draft`` turns on speculative decoding (``speculative.py``; one prompt, no beams, no
    ``context_overflow="crop"``): ``"prompt"`` drafts by prompt lookup (the tokens that followed
    the text's last few tokens earlier on: fast when the answer copies the prompt), a model with
    the same vocabulary (e.g. an int4 copy of this one) drafts with that model. Each round the
    model checks ``draft_tokens`` drafts (5 by default) in one pass. The tokens are greedy
    decoding's, or when sampling have exactly plain sampling's distribution; only the speed
    differs (``GenerationResult.speculation`` says how many drafts were kept)."""
    options = {k: v for k, v in locals().items() if k not in ("model", "prompt", "unknown")}
    if unknown:
        # refuses them by name, with the closest known option
        make_request({k: v for k, v in {**options, **unknown}.items() if k != "chat"})
        options.update(unknown)  # options make_request knows beyond this signature (a new sampler's field)
    rows = batch_rows(prompt)
    one_prompt_only = num_beams > 1 or context_overflow != "stop" or reuse_cache or draft is not None \
        or draft_tokens is not None
    if rows is not None and len(rows) == 1 and one_prompt_only:
        # a (1, T) tensor, as transformers users pass one prompt (model.generate(input_ids,
        # num_beams=4)): run as that prompt, answered as a batch is, a list of one result
        return [_generate_one(model, rows[0], options)]
    if rows is not None:
        if num_beams > 1:
            raise GenerationError(f"beam search takes one prompt at a time, not a batch of {len(rows)}; "
                                  f"loop over the prompts or use num_beams=1.")
        if context_overflow != "stop":
            raise GenerationError(f"context_overflow={context_overflow!r} works one prompt at a time, not with a batch "
                                  f"of {len(rows)}; loop over the prompts.")
        make_request({k: v for k, v in options.items() if k != "chat"})  # e.g. length_penalty without beams
        if options.pop("reuse_cache"):
            raise GenerationError(f"reuse_cache=True works one prompt at a time (a chat's turns), not with a batch "
                                  f"of {len(rows)}; leave it out for a batch.")
        if options.pop("draft") is not None or options.pop("draft_tokens") is not None:
            raise GenerationError(f"speculative decoding (draft=...) works one prompt at a time, not with a batch of "
                                  f"{len(rows)}; loop over the prompts, or leave draft out for a batch.")
        options.pop("num_beams"), options.pop("length_penalty"), options.pop("context_overflow")
        return generate_batch(model, rows, **options)
    return _generate_one(model, prompt, options)


def _generate_one(model: Transformer, prompt: Prompt, options: dict[str, Any]) -> GenerationResult:
    runner = _Run(model, prompt, options, lookahead=True)  # no caller code between the tokens
    for _ in runner.pieces():
        pass
    return runner.result


def stream(model: Transformer, prompt: Prompt, *, steady: bool = False, max_new_tokens: int = 64,
           temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
           min_p: Optional[float] = None, repetition_penalty: Optional[float] = None,
           typical_p: Optional[float] = None, epsilon_cutoff: Optional[float] = None,
           eta_cutoff: Optional[float] = None, seed: Optional[int] = None, stop: Optional[str | Sequence[str]] = None,
           no_repeat_ngram_size: Optional[int] = None, suppress_tokens: Optional[Sequence[int]] = None,
           bad_words_ids: Optional[Sequence[Sequence[int]]] = None, sequence_bias: Optional[SequenceBias] = None,
           logit_bias: Optional[LogitBias] = None, presence_penalty: Optional[float] = None,
           frequency_penalty: Optional[float] = None,
           stop_on_eos: bool = True, num_beams: int = 1, length_penalty: float = 1.0, min_new_tokens: int = 0,
           context_overflow: str = "stop", logprobs: Union[bool, int, None] = None, chat: bool = False,
           reuse_cache: bool = False, draft: Optional[Union[str, Transformer]] = None,
           draft_tokens: Optional[int] = None,
           **unknown: Any) -> "TextStream":
    """Like ``generate`` but yields text pieces as they are decoded. The pieces join to
    exactly ``generate(...).text``: never half a UTF-8 character, never a stop string.
    With ``num_beams > 1`` the whole text comes as one piece at the end, and the sampling
    options (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``epsilon_cutoff``,
    ``eta_cutoff``, ``seed``) are ignored, as in
    ``generate``. Once the pieces
    run out, ``.result`` holds the ``GenerationResult`` (ids, finish reason).

    A model has one KV cache, so one generation runs on it at a time: a stream paused while
    ``generate`` or another stream runs on the same model raises ``GenerationError`` when read
    again (its cache holds the other prompt by then). Finish or close it first.

    ``steady=True`` promises that the code reading the pieces changes nothing in the model
    while they come (attaches or removes no hook, swaps no layer, replaces no weight): the
    decode steps may then keep what they look up, as ``generate``'s do (``DecodeSession``; on
    2 CPU cores ~0.9 ms of SmolLM2's ~6 ms token). ``lucidlm generate`` and ``chat`` pass it.

    The other options are ``generate``'s, named here so that help() and shift-tab show them;
    a name it does not know (``**unknown``) is refused with the closest known one."""
    # (first: locals() must hold the arguments alone)
    options = {k: v for k, v in locals().items() if k not in ("model", "prompt", "steady", "unknown")}
    options.update(unknown)  # refused by make_request, by name (or a new sampler's field it knows)
    if not isinstance(steady, bool):
        raise GenerationError(f"steady must be True or False, got {steady!r}.")
    rows = batch_rows(prompt)
    if rows is not None and len(rows) > 1:
        raise GenerationError(f"stream takes one prompt, not a batch of {len(rows)}; use generate() for a batch.")
    prompt = rows[0] if rows is not None else prompt  # a (1, T) tensor: its one row
    if getattr(model, "tokenizer", None) is None:  # without one every piece is "": a silent empty stream
        raise GenerationError("stream yields text, and this model has no tokenizer to decode its ids "
                              "(model.tokenizer is None); use generate(ids).token_ids, or set model.tokenizer.")
    return TextStream(_Run(model, prompt, options, steady=steady))  # validate now, not at the first next()


class TextStream(Iterator[str]):
    """The text pieces of one generation; ``result`` is set when they run out."""

    def __init__(self, runner: "_Run") -> None:
        self._runner = runner
        self._pieces = runner.pieces()

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()

    @property
    def result(self) -> Optional[GenerationResult]:
        return self._runner.result


@keywords_checked(GenerationError)
def generate_batch(model: Transformer, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int = 64,
                   temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   min_p: Optional[float] = None, repetition_penalty: Optional[float] = None,
                   typical_p: Optional[float] = None, epsilon_cutoff: Optional[float] = None,
                   eta_cutoff: Optional[float] = None, seed: Optional[int] = None,
                   no_repeat_ngram_size: Optional[int] = None, suppress_tokens: Optional[Sequence[int]] = None,
                   bad_words_ids: Optional[Sequence[Sequence[int]]] = None,
                   sequence_bias: Optional[SequenceBias] = None,
                   logit_bias: Optional[LogitBias] = None, presence_penalty: Optional[float] = None,
                   frequency_penalty: Optional[float] = None,
                   stop: Optional[str | Sequence[str]] = None, stop_on_eos: bool = True,
                   min_new_tokens: int = 0, logprobs: Union[bool, int, None] = None,
                   chat: bool = False) -> list[GenerationResult]:
    """Generate for several prompts in one batch (left-padded, one KV cache). Each row
    stops on its own. On lucidlm's CPU kernels (quantized models) each row is bit for bit
    one-prompt-at-a-time ``generate``'s, log-probs included (each prompt is prefilled on its own,
    ``DecodeSession``); on torch's attention (float models, a GPU) the decode steps over the
    padded cache round differently (~5e-5 in SmolLM2's float32 logits), so a greedy near-tie that
    close may go the other way. Up to the context: the rows share the cache's ``max_seq_len``
    slots, so every row gets at most
    ``max_seq_len`` minus the *longest* prompt's length new tokens (finish reason "length"),
    where a short prompt alone could go on further. There is no beam search here (no
    ``num_beams``, ``length_penalty``): beams search one prompt at a time, with ``generate``,
    and ignore the sampling options (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``,
    ``epsilon_cutoff``, ``eta_cutoff``, ``seed``). With ``logprobs``, each row's log-probs cover
    its own tokens only (none for the steps after it ended)."""
    if isinstance(prompts, str) or len(prompts) == 0:
        raise GenerationError("generate_batch takes a non-empty list of prompts; use generate() for one prompt.")
    kwargs = {k: v for k, v in locals().items() if k not in ("model", "prompts", "chat")}
    request = make_request(apply_sampling_defaults(model, kwargs))
    request.use_model(model)
    rows = [prompt_ids(model, p.tolist() if isinstance(p, torch.Tensor) else p, chat) for p in prompts]
    run = BatchRun(model, rows, request, [request.max_new_tokens] * len(rows), [request.stop] * len(rows),
                   lookahead=True)
    for _ in run.pieces():  # the text comes whole in the results
        pass
    return run.results


class _Run:
    """One generation, driven by iterating ``pieces()``; ``result`` is set at the end."""

    def __init__(self, model: Any, prompt: Any, kwargs: dict[str, Any], lookahead: bool = False,
                 steady: bool = False) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("model", "prompt")}
        self.lookahead = lookahead  # see sample_rows: only where no caller code runs between tokens
        self.steady = steady or lookahead  # the same promise, made by a stream's caller
        chat = bool(kwargs.pop("chat", False))
        self.model = model
        self.request = make_request(apply_sampling_defaults(model, kwargs))
        self.request.use_model(model)
        self.crop = self.request.context_overflow == "crop"
        self.prompt_ids = prompt_ids(model, prompt, chat, within_context=not self.crop)
        if self.crop and self.request.num_beams > 1:
            raise GenerationError("context_overflow='crop' works with sampling and greedy decoding, not beam search; "
                                  "use num_beams=1 or context_overflow='stop'.")
        if self.request.draft is not None and (self.crop or self.request.num_beams > 1):
            raise GenerationError(f"speculative decoding (draft=...) does not work with "
                                  f"{'beam search' if self.request.num_beams > 1 else 'context_overflow=crop'}; "
                                  f"leave draft out, or use num_beams=1 and context_overflow='stop'.")
        check_draft(model, self.request.draft)
        self.max_new = self.request.max_new_tokens if self.crop else \
            fit_to_context(model, [self.prompt_ids], self.request.max_new_tokens)
        if self.request.num_beams > 1:
            check_beams(model, self.request.num_beams, len(self.prompt_ids) + self.max_new)
        tokenizer = model.tokenizer
        if tokenizer is None and self.request.stop:
            raise GenerationError("stop strings need a tokenizer to decode text, but model.tokenizer is None.")
        self.assembler = (TextAssembler(tokenizer, self.request.stop, self.request.eos_ids, self.prompt_ids)
                          if tokenizer is not None else None)
        self.result: Optional[GenerationResult] = None

    def pieces(self) -> Iterator[str]:
        """The text pieces; the clock (``GenerationResult.seconds``) runs from the first
        ``next()`` and stops while a piece is with the caller."""
        token_ids: list[int] = []
        reason = "length"
        assembler = self.assembler
        start = time.perf_counter()
        first: Optional[float] = None
        away = 0.0  # time the caller held the pieces

        def elapsed() -> float:
            return time.perf_counter() - start - away

        recorder = None if self.request.logprobs is None else LogprobRecorder(self.request.logprobs)
        if self.request.num_beams > 1:
            token_ids, _ = beam_search(self.model, self.prompt_ids, num_beams=self.request.num_beams,
                                       max_new_tokens=self.max_new, eos_ids=self.request.eos_ids,
                                       length_penalty=self.request.length_penalty,
                                       settings=self.request.settings,
                                       stop=self.request.stop, min_new_tokens=self.request.min_new_tokens,
                                       recorder=recorder)
            if token_ids and token_ids[-1] in self.request.eos_ids:
                reason = "eos"
            text = ""
            if assembler is not None:
                for count, token in enumerate(token_ids, 1):
                    text += assembler.add(token)
                    if assembler.stopped:  # as greedy: the last id is the one completing the stop string
                        token_ids, reason = token_ids[:count], "stop"
                        break
                text += assembler.finish()
            self.result = attach_tokenizer(GenerationResult(token_ids, text, list(self.prompt_ids), reason,
                                                            seconds=elapsed(), **_scores(recorder, token_ids)),
                                           self.model.tokenizer)
            if text:
                yield text
            return

        finished = torch.zeros(1, dtype=torch.bool)
        reuse = CacheReuse() if self.request.reuse_cache else None
        speculation = SpeculationStats() if self.request.draft is not None else None
        sampler = sample_with_crop if self.crop else \
            lambda model, prompt, *rest, **options: sample_rows(model, [prompt], *rest, lookahead=self.lookahead,
                                                                steady=self.steady, reuse=reuse, **options)
        if speculation is not None:
            sampler = partial(speculative_rows, draft=self.request.draft, draft_tokens=self.request.draft_tokens,
                              steady=self.steady, reuse=reuse, stats=speculation)
        steps = sampler(self.model, self.prompt_ids, self.max_new, self.request.settings,
                        private_generator(self.model, self.request.seed), finished, padding_id(self.model.tokenizer),
                        self.request.min_new_tokens, self.request.eos_ids, recorder=recorder)
        with closing(steps):
            for next_ids in steps:
                token = int(next_ids[0])
                token_ids.append(token)
                if first is None:
                    first = elapsed()
                if token in self.request.eos_ids:
                    reason = "eos"
                    finished[0] = True
                    break
                if assembler is not None:
                    piece = assembler.add(token)
                    if piece:
                        paused = time.perf_counter()
                        yield piece
                        away += time.perf_counter() - paused
                    if assembler.stopped:
                        reason = "stop"
                        finished[0] = True  # an end as EOS is: sample_rows may keep the cache
                        break
        seconds = elapsed()
        text = ""
        if assembler is not None:
            piece = assembler.finish()
            if piece:
                yield piece
            text = assembler.text
        self.result = attach_tokenizer(GenerationResult(token_ids, text, list(self.prompt_ids), reason,
                                                        prompt_seconds=first, seconds=seconds,
                                                        cached_tokens=reuse.cached_tokens if reuse else 0,
                                                        speculation=speculation, **_scores(recorder, token_ids)),
                                       self.model.tokenizer)


def _scores(recorder: Optional[LogprobRecorder], token_ids: list[int]) -> dict[str, Any]:
    """A one-row result's ``logprobs`` and ``top_logprobs`` (none without a recorder)."""
    if recorder is None:
        return {}
    chosen, tops = recorder.rows([len(token_ids)])[0]
    return {"logprobs": chosen, "top_logprobs": tops}
