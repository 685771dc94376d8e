"""Seed 002's walk from text to tokens to the next token, one step at a time.

    to_str_tokens(model, "hi, my name is")      # ['hi', ',', ' my', ' name', ' is']
    for step in generation_steps(model, "hi, my name is", max_new_tokens=5):
        print(step.line)                         # the sequence so far, then the new token

Each step runs only the new token through the model: the prompt is prefilled into the
KV cache once, then every decoded token reads the cached keys and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional, TextIO

import torch
from torch import nn

from lucidlm.errors import GenerationError, InputError
from lucidlm.generation.decode import DecodeSession
from lucidlm.suggest import keywords_checked
from lucidlm.inspect.tokens import TextOrLooseIds, id_batch, model_tokenizer, to_str_tokens, to_tokens
from lucidlm.validation import check_int, check_seed
from lucidlm.weights.hf_generation_config import end_token_ids


_tokenizer = model_tokenizer  # the name the rest of this file uses


@dataclass
class GenerationStep:
    ids: list[int]  # the whole sequence, new token included
    str_tokens: list[str]  # the same, as text pieces
    new_id: int
    new_token: str
    prob: float  # the probability the token was picked with (after temperature and top-k)

    @property
    def line(self) -> str:
        """Seed 002's printout: the sequence before this step, a space, the new token."""
        return f"{''.join(self.str_tokens[:-1])} {self.new_token}"


@keywords_checked(GenerationError)
def generation_steps(model: nn.Module, prompt: TextOrLooseIds, max_new_tokens: int = 10, temperature: float = 0.0,
                     top_k: Optional[int] = None, seed: Optional[int] = None,
                     stop_at_eos: Optional[bool] = None, *, stop_on_eos: bool = True) -> Iterator[GenerationStep]:
    """Yield one GenerationStep per new token. temperature 0 = greedy (argmax). The arguments
    are checked now, not at the first ``next()``. ``stop_on_eos`` (generate's name; the older
    ``stop_at_eos`` still works): end at an end-of-sequence token, any of those generate
    stops on (``tokenizer.eos_ids``)."""
    stop_on_eos = _stop_on_eos(stop_on_eos, stop_at_eos)
    check_int(max_new_tokens, "max_new_tokens", GenerationError, low=0)
    if not _finite(temperature) or temperature < 0:
        raise GenerationError(f"temperature={temperature!r} must be a number >= 0 (0 means greedy).")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise GenerationError(f"top_k={top_k!r} must be a whole number >= 1 (or None for no limit).")
    if seed is not None:
        check_seed(seed, "seed", GenerationError)
    ids = id_batch(model, prompt, "generation_steps")
    if ids.shape[0] != 1:
        raise InputError(f"generation_steps follows one prompt, got a batch of {ids.shape[0]}.")
    return _steps(model, ids[0].tolist(), max_new_tokens, temperature, top_k, seed, stop_on_eos)


def _stop_on_eos(stop_on_eos: Any, stop_at_eos: Any) -> bool:
    """The one EOS switch of ``stop_on_eos`` and its older name ``stop_at_eos`` (None: not given)."""
    for name, value in (("stop_on_eos", stop_on_eos), ("stop_at_eos", stop_at_eos)):
        if not isinstance(value, bool) and (value is not None or name == "stop_on_eos"):
            raise GenerationError(f"{name}={value!r} is invalid: expected True or False.")
    return stop_on_eos and stop_at_eos is not False  # both default to on: either one False turns it off


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@torch.no_grad()
def _steps(model: nn.Module, ids: list[int], max_new_tokens: int, temperature: float, top_k: Optional[int],
           seed: Optional[int], stop_at_eos: bool) -> Iterator[GenerationStep]:
    tokenizer = getattr(model, "tokenizer", None)
    # Every end token the model declares, as generate() stops on (SmolLM2: <|im_end|> and <|endoftext|>).
    eos_ids = set(end_token_ids(model)) if stop_at_eos else set()
    generator = torch.Generator(device=model.device)
    if seed is not None:
        generator.manual_seed(seed)

    # A DecodeSession, as generate's: the cache is this walk's alone while it runs. Its own cache
    # set up beside the owner registry let a stream opened between two steps share it (each wrote
    # into the other's cache: wrong tokens, no error), and put its own back under a stream's feet.
    total = min(len(ids) + max_new_tokens, model.config.max_seq_len)
    if len(ids) >= total:
        return
    with DecodeSession(model, [ids], capacity=total - 1) as session:  # the last token is never fed back
        logits = session.prefill()[0]  # (V,)
        while True:
            new_id, prob = _pick(logits, temperature, top_k, generator)
            ids.append(new_id)
            str_tokens = to_str_tokens(model, ids) if tokenizer is not None else [str(i) for i in ids]
            yield GenerationStep(list(ids), str_tokens, new_id, str_tokens[-1], prob)
            if new_id in eos_ids or len(ids) >= total:
                return
            logits = session.step(torch.tensor([new_id], device=model.device))[0]  # (V,)


def _pick(logits: torch.Tensor, temperature: float, top_k: Optional[int],
          generator: torch.Generator) -> tuple[int, float]:
    if temperature == 0:
        probs = torch.softmax(logits, dim=-1)
        new_id = int(probs.argmax())
        return new_id, float(probs[new_id])
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    new_id = int(torch.multinomial(probs, 1, generator=generator))
    return new_id, float(probs[new_id])


@keywords_checked(GenerationError)
def print_steps(model: nn.Module, prompt: TextOrLooseIds, max_new_tokens: int = 10, file: Optional[TextIO] = None, *,
                temperature: float = 0.0, top_k: Optional[int] = None, seed: Optional[int] = None,
                stop_on_eos: bool = True, stop_at_eos: Optional[bool] = None) -> list[str]:
    """Print the sequence after every new token (seed 002's ``generate``); return the final
    tokens as text pieces. The sampling options are ``generation_steps``'s. ``file`` None is
    ``sys.stdout`` when called, as print's: a default bound at import missed redirect_stdout."""
    steps = generation_steps(model, prompt, max_new_tokens, temperature, top_k, seed, stop_at_eos,
                             stop_on_eos=stop_on_eos)  # checked before anything is printed
    final: list[str] = to_str_tokens(model, prompt) if isinstance(prompt, str) else []
    for step in steps:
        print(step.line, file=file)
        final = step.str_tokens
    return final
