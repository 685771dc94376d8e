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

import numbers
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.beam_search import beam_search
from lucidlm.generation.chat_template import encode_chat
from lucidlm.generation.decode import DecodeSession, sample_rows
from lucidlm.generation.defaults import apply_sampling_defaults
from lucidlm.generation.sampling import SamplingSettings, process_logits, sample_next
from lucidlm.generation.sliding import sample_with_crop
from lucidlm.generation.streaming import TextAssembler
from lucidlm.suggest import did_you_mean
from lucidlm.validation import check_allocation, check_float, check_seed

CONTEXT_OVERFLOW = ("stop", "crop")  # what happens when prompt + output fill max_seq_len

__all__ = ["GenerationResult", "TextStream", "generate", "stream", "generate_batch", "check_options", "beam_search",
           "SamplingSettings", "DecodeSession", "process_logits", "sample_next", "TextAssembler"]


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only
    text: str  # their text (no EOS, cut before a stop string)
    prompt_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "eos" | "stop" | "length"


@dataclass
class _Request:
    """Everything ``generate`` was asked to do, validated."""

    settings: SamplingSettings
    max_new_tokens: int
    stop: list[str]
    eos_ids: list[int]
    seed: Optional[int]
    num_beams: int
    length_penalty: float
    stop_on_eos: bool
    min_new_tokens: int = 0
    context_overflow: str = "stop"

    def use_tokenizer(self, tokenizer: Any) -> None:
        self.eos_ids = _eos_ids(tokenizer) if self.stop_on_eos else []


Prompt = Union[str, Sequence[int], torch.Tensor]
Prompts = Union[Prompt, Sequence[str], Sequence[Sequence[int]]]


def generate(model: Any, prompt: Prompts, *, max_new_tokens: int = 64,
             temperature: Optional[float] = None,
             top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
             repetition_penalty: Optional[float] = None, seed: Optional[int] = None,
             stop: Optional[str | Sequence[str]] = None, stop_on_eos: bool = True, num_beams: int = 1,
             length_penalty: float = 1.0, min_new_tokens: int = 0, context_overflow: str = "stop",
             chat: bool = False, **unknown: Any) -> Union[GenerationResult, list[GenerationResult]]:
    """Continue ``prompt``; see the module docstring for the rules. ``chat=True`` wraps a
    text prompt as one user message in the model's chat template.

    One prompt (text, a list of ids, a 1-D tensor) gives one ``GenerationResult``; a batch (a
    list of texts, a list of id lists, a 2-D tensor of shape (B, T)) gives a list of B results,
    one per row, generated together (see ``generate_batch``)."""
    options = {k: v for k, v in locals().items() if k not in ("model", "prompt", "unknown")}
    if unknown:
        _make_request({k: v for k, v in {**options, **unknown}.items() if k != "chat"})  # refuses them by name, with the closest known option
    rows = batch_rows(prompt)
    if rows is not None:
        if num_beams > 1:
            raise GenerationError(f"beam search takes one prompt at a time, not a batch of {len(rows)}; "
                                  f"loop over the prompts or use num_beams=1.")
        if context_overflow != "stop":
            raise GenerationError(f"context_overflow={context_overflow!r} works one prompt at a time, not with a batch "
                                  f"of {len(rows)}; loop over the prompts.")
        options.pop("num_beams"), options.pop("length_penalty"), options.pop("context_overflow")
        return generate_batch(model, rows, **options)
    runner = _Run(model, prompt, options)
    for _ in runner.pieces():
        pass
    return runner.result


def batch_rows(prompt: Any) -> Optional[list[Any]]:
    """The rows of a batch of prompts, or None for a single prompt."""
    if isinstance(prompt, torch.Tensor):
        if prompt.ndim > 2:
            raise GenerationError(f"a prompt tensor has shape (T,) or (B, T), not {tuple(prompt.shape)}.")
        return [row.tolist() for row in prompt] if prompt.ndim == 2 else None
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or len(prompt) == 0:
        return None
    kinds = {"text" if isinstance(p, str) else "ids" if isinstance(p, (Sequence, torch.Tensor)) else "id"
             for p in prompt}
    if kinds == {"id"}:
        return None
    if len(kinds) > 1:
        raise GenerationError("a prompt list mixes token ids with texts or lists; give one prompt (text or a list "
                              "of ids) or a batch (a list of texts, or a list of id lists).")
    return list(prompt)


def stream(model: Any, prompt: Prompt, **kwargs: Any) -> "TextStream":
    """Like ``generate`` but yields text pieces as they are decoded. The pieces join to
    exactly ``generate(...).text``: never half a UTF-8 character, never a stop string.
    With ``num_beams > 1`` the whole text comes as one piece at the end. Once the pieces
    run out, ``.result`` holds the ``GenerationResult`` (ids, finish reason)."""
    rows = batch_rows(prompt)
    if rows is not None:
        raise GenerationError(f"stream takes one prompt, not a batch of {len(rows)}; use generate() for a batch.")
    return TextStream(_Run(model, prompt, kwargs))  # validate now, not at the first next()


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


def generate_batch(model: Any, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int = 64,
                   temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   min_p: Optional[float] = None, repetition_penalty: Optional[float] = None,
                   seed: Optional[int] = None, stop: Optional[str | Sequence[str]] = None,
                   stop_on_eos: bool = True, min_new_tokens: int = 0, chat: bool = False) -> list[GenerationResult]:
    """Generate for several prompts in one batch (left-padded, one KV cache). Each row
    stops on its own; greedy results equal one-prompt-at-a-time ``generate``."""
    if isinstance(prompts, str) or len(prompts) == 0:
        raise GenerationError("generate_batch takes a non-empty list of prompts; use generate() for one prompt.")
    kwargs = {k: v for k, v in locals().items() if k not in ("model", "prompts", "chat")}
    request = _make_request(apply_sampling_defaults(model, kwargs))
    request.use_tokenizer(model.tokenizer)
    rows = [_prompt_ids(model, p.tolist() if isinstance(p, torch.Tensor) else p, chat) for p in prompts]
    max_new = _fit_to_context(model, rows, request.max_new_tokens)
    tokenizer = model.tokenizer
    assemblers = [TextAssembler(tokenizer, request.stop, request.eos_ids, row) if tokenizer is not None else None
                  for row in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    reasons = ["length"] * len(rows)
    finished = torch.zeros(len(rows), dtype=torch.bool)
    pad_id = _pad_id(tokenizer)
    with closing(sample_rows(model, rows, max_new, request.settings, _generator(model, request.seed),
                             finished, pad_id, request.min_new_tokens, request.eos_ids)) as steps:
        for next_ids in steps:
            for i, token in enumerate(next_ids.tolist()):
                if finished[i]:
                    continue
                outputs[i].append(token)
                if assemblers[i] is not None:
                    assemblers[i].add(token)
                    if assemblers[i].stopped:
                        reasons[i], finished[i] = "stop", True
                if token in request.eos_ids:
                    reasons[i], finished[i] = "eos", True
    results = []
    for row, out, reason, assembler in zip(rows, outputs, reasons, assemblers):
        if assembler is not None:
            assembler.finish()
        results.append(GenerationResult(out, assembler.text if assembler else "", list(row), reason))
    return results


class _Run:
    """One generation, driven by iterating ``pieces()``; ``result`` is set at the end."""

    def __init__(self, model: Any, prompt: Any, kwargs: dict[str, Any]) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("model", "prompt")}
        chat = bool(kwargs.pop("chat", False))
        self.model = model
        self.request = _make_request(apply_sampling_defaults(model, kwargs))
        self.request.use_tokenizer(model.tokenizer)
        self.prompt_ids = _prompt_ids(model, prompt, chat)
        self.crop = self.request.context_overflow == "crop"
        if self.crop and self.request.num_beams > 1:
            raise GenerationError("context_overflow='crop' works with sampling and greedy decoding, not beam search; "
                                  "use num_beams=1 or context_overflow='stop'.")
        self.max_new = self.request.max_new_tokens if self.crop else \
            _fit_to_context(model, [self.prompt_ids], self.request.max_new_tokens)
        if self.request.num_beams > 1:
            _check_beams(model, self.request.num_beams, len(self.prompt_ids) + self.max_new)
        tokenizer = model.tokenizer
        if tokenizer is None and self.request.stop:
            raise GenerationError("stop strings need a tokenizer to decode text, but model.tokenizer is None.")
        self.assembler = (TextAssembler(tokenizer, self.request.stop, self.request.eos_ids, self.prompt_ids)
                          if tokenizer is not None else None)
        self.result: Optional[GenerationResult] = None

    def pieces(self) -> Iterator[str]:
        token_ids: list[int] = []
        reason = "length"
        assembler = self.assembler
        if self.request.num_beams > 1:
            token_ids, _ = beam_search(self.model, self.prompt_ids, num_beams=self.request.num_beams,
                                       max_new_tokens=self.max_new, eos_ids=self.request.eos_ids,
                                       length_penalty=self.request.length_penalty,
                                       repetition_penalty=self.request.settings.repetition_penalty)
            if token_ids and token_ids[-1] in self.request.eos_ids:
                reason = "eos"
            text = ""
            if assembler is not None:
                text = "".join(assembler.add(t) for t in token_ids) + assembler.finish()
                reason = "stop" if assembler.stopped else reason
            self.result = GenerationResult(token_ids, text, list(self.prompt_ids), reason)
            if text:
                yield text
            return

        finished = torch.zeros(1, dtype=torch.bool)
        sampler = sample_with_crop if self.crop else lambda model, prompt, *rest: sample_rows(model, [prompt], *rest)
        steps = sampler(self.model, self.prompt_ids, self.max_new, self.request.settings,
                        _generator(self.model, self.request.seed), finished, _pad_id(self.model.tokenizer),
                        self.request.min_new_tokens, self.request.eos_ids)
        with closing(steps):
            for next_ids in steps:
                token = int(next_ids[0])
                token_ids.append(token)
                if token in self.request.eos_ids:
                    reason = "eos"
                    finished[0] = True
                    break
                if assembler is not None:
                    piece = assembler.add(token)
                    if piece:
                        yield piece
                    if assembler.stopped:
                        reason = "stop"
                        break
        text = ""
        if assembler is not None:
            piece = assembler.finish()
            if piece:
                yield piece
            text = assembler.text
        self.result = GenerationResult(token_ids, text, list(self.prompt_ids), reason)


def check_options(**kwargs: Any) -> None:
    """Raise GenerationError for bad generation options, before any model is loaded."""
    kwargs.pop("chat", None)
    _make_request(kwargs)


# ---------------------------------------------------------------------- helpers
def _make_request(kwargs: dict[str, Any]) -> _Request:
    max_new = kwargs.get("max_new_tokens", 64)
    if not _is_int(max_new) or max_new < 0:
        raise GenerationError(f"max_new_tokens={max_new!r} is invalid: use a whole number >= 0.")
    num_beams = kwargs.get("num_beams", 1)
    if not _is_int(num_beams) or num_beams < 1:
        raise GenerationError(f"num_beams={num_beams!r} is invalid: use 1 (no beam search) or more.")
    known = {"max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop",
             "stop_on_eos", "num_beams", "length_penalty", "min_new_tokens", "context_overflow"}
    unknown = set(kwargs) - known
    if unknown:
        name = sorted(unknown)[0]
        raise GenerationError(f"unknown generation option {name!r}; known: {', '.join(sorted(known | {'chat'}))}"
                              f"{did_you_mean(name, known | {'chat'}) or '.'}")
    temperature = kwargs.get("temperature")
    settings = SamplingSettings(temperature=1.0 if temperature is None else temperature, top_k=kwargs.get("top_k"),
                                top_p=kwargs.get("top_p"), min_p=kwargs.get("min_p"),
                                repetition_penalty=kwargs.get("repetition_penalty"))
    stop = _stop_strings(kwargs.get("stop"))
    min_new = kwargs.get("min_new_tokens", 0)
    if not _is_int(min_new) or min_new < 0:
        raise GenerationError(f"min_new_tokens={min_new!r} is invalid: use a whole number >= 0 (EOS cannot end "
                              f"generation before that many new tokens).")
    if min_new > 0 and num_beams > 1:
        raise GenerationError("min_new_tokens works with sampling and greedy decoding, not beam search (num_beams > 1).")
    overflow = kwargs.get("context_overflow", "stop")
    if not isinstance(overflow, str) or overflow not in CONTEXT_OVERFLOW:
        raise GenerationError(f"context_overflow={overflow!r} is unknown; use one of {', '.join(CONTEXT_OVERFLOW)} "
                              f"(stop: end at the context window; crop: keep going from its last max_seq_len tokens).")
    seed = kwargs.get("seed")
    if seed is not None:
        check_seed(seed, "seed", GenerationError)
    length_penalty = check_float(kwargs.get("length_penalty", 1.0), "length_penalty", GenerationError,
                                 fix="the beam score is sum of log-probs / length ** length_penalty")
    return _Request(settings, max_new, stop, [], seed, num_beams, length_penalty,
                    bool(kwargs.get("stop_on_eos", True)), min_new, overflow)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _stop_strings(stop: Any) -> list[str]:
    """``stop`` as a list of non-empty strings (one string is a list of one)."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, (list, tuple)) else None
    if stop is None:
        return []
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise GenerationError(f"stop={stop!r} is invalid: give a non-empty string or a list of non-empty strings "
                              f"(the texts that end generation).")
    return list(stops)


def _prompt_ids(model: Any, prompt: Any, chat: bool) -> list[int]:
    tokenizer = model.tokenizer
    if chat:
        if not isinstance(prompt, str):
            raise GenerationError("chat=True needs a text prompt (the user's message), not token ids.")
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GenerationError("this model has no tokenizer (model.tokenizer is None): pass token ids, not text.")
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise GenerationError(f"a prompt tensor holds token ids, so it needs an integer dtype, not {prompt.dtype}; "
                                  f"use ids.long().")
        ids = [int(i) for i in prompt.reshape(-1).tolist()]
    elif isinstance(prompt, (list, tuple)) and all(_is_int(i) for i in prompt):
        ids = [int(i) for i in prompt]
    else:
        raise GenerationError(f"prompt={_shown(prompt)} is invalid: give text, a list of token ids (ints), a 1-D "
                              f"integer tensor, or a batch of those.")
    if not ids:
        bos = getattr(tokenizer, "bos_id", None) if tokenizer is not None else None
        if bos is None:
            raise GenerationError("the prompt is empty and the tokenizer has no BOS token to start from; "
                                  "give at least one token of prompt.")
        ids = [bos]
    vocab = model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise GenerationError(f"prompt token id {bad[0]} is outside this model's vocabulary 0..{vocab - 1}.")
    return ids


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_beams(model: Any, num_beams: int, capacity: int) -> None:
    """Refuse a beam count no model could use (more beams than tokens) or whose KV cache and
    (beams, vocab) score tables would not fit in memory, before anything is allocated."""
    config = model.config
    if num_beams > config.vocab_size:
        raise GenerationError(f"num_beams={num_beams} is more than this model's {config.vocab_size} tokens; beams "
                              f"must be distinct sequences, so use at most {config.vocab_size} (4 to 8 is usual).")
    kv = 2 * config.n_layers * config.n_kv_heads * config.head_dim * capacity * model.dtype.itemsize
    check_allocation(num_beams * (kv + 4 * 4 * config.vocab_size), f"beam search with num_beams={num_beams}",
                     GenerationError, "use fewer beams (4 to 8 is usual)")


def _fit_to_context(model: Any, rows: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """max_new_tokens, cut so prompt + output fit the context; error if the prompt cannot."""
    limit = model.config.max_seq_len
    longest = max(len(r) for r in rows)
    if longest > limit:
        raise GenerationError(f"the prompt is {longest} tokens, longer than the model's context of {limit} tokens "
                              f"(max_seq_len); shorten the prompt.")
    return min(max_new_tokens, limit - longest)


def _eos_ids(tokenizer: Any) -> list[int]:
    if tokenizer is None:
        return []
    ids = getattr(tokenizer, "eos_ids", None)  # tokenizers with several end tokens may list them all
    if ids:
        return [int(i) for i in ids]
    eos = getattr(tokenizer, "eos_id", None)
    return [] if eos is None else [int(eos)]


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_id", "eos_id", "bos_id"):  # any valid id will do: padding is masked out
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    return 0


def _generator(model: Any, seed: Optional[int]) -> torch.Generator:
    generator = torch.Generator(device=model.device)
    if seed is None:
        generator.seed()  # fresh entropy, without touching the global RNG
    else:
        generator.manual_seed(int(seed))
    return generator
