"""A generation request, checked: every option ``generate``, ``stream`` and ``generate_batch``
take is validated here (with the closest known name for a typo) before anything runs, and
the prompt is turned into token ids the model can read.

``check_options`` runs the same checks before a model is even loaded (the CLI does).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.chat_template import encode_chat
from lucidlm.generation.logprobs import logprobs_count
from lucidlm.generation.prompt_limits import refuse_past_context
from lucidlm.generation.sampling import SamplingSettings
from lucidlm.suggest import did_you_mean
from lucidlm.validation import check_allocation, check_float, check_seed
from lucidlm.weights.hf_generation_config import end_token_ids

# The sampler's options are SamplingSettings' fields, so a new sampler's field is a generation
# option of its own, checked by SamplingSettings, with no second list to keep in step.
SAMPLER_OPTIONS = tuple(f.name for f in fields(SamplingSettings))
CONTEXT_OVERFLOW = ("stop", "crop")  # what happens when prompt + output fill max_seq_len
# Beam scores divide by length ** length_penalty in Python floats: with lengths up to
# MAX_CONTEXT (2**24), 2**(24 * 40) is still finite, 2**(24 * 43) overflows.
MAX_LENGTH_PENALTY = 40.0


@dataclass
class Request:
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
    logprobs: Optional[int] = None  # None: off; N: the chosen token's log-prob and N alternatives
    reuse_cache: bool = False  # start from the model's kept KV cache where the prompt allows (prompt_cache.py)
    draft: Any = None  # speculative decoding's guesser: None (off), "prompt" or a draft model (speculative.py)
    draft_tokens: int = 0  # tokens drafted per round (with a draft)

    def use_model(self, model: Any) -> None:
        """Stop on the model's end tokens: its tokenizer's, else those its files declare; the
        token ids the sampling options name must be the model's."""
        self.eos_ids = end_token_ids(model) if self.stop_on_eos else []
        self.settings.check_token_ids(model.config.vocab_size, self.eos_ids, self.min_new_tokens)



def check_options(**kwargs: Any) -> None:
    """Raise GenerationError for bad generation options, before any model is loaded (the CLI
    checks its flags with it); returns None when they are all valid. The options are
    ``generate``'s, with the same defaults and checks:

        max_new_tokens=64      whole number >= 0
        temperature=None       >= 0; 0 is greedy (None: generate uses the model's default)
        top_k=None             whole number >= 0 (0 or None: no top-k)
        top_p=None             in (0, 1]
        min_p=None             in [0, 1]
        repetition_penalty=None  > 0 (1.0: off)
        typical_p=None         in (0, 1] (1 or None: off)
        epsilon_cutoff=None    in [0, 1) (0 or None: off)
        eta_cutoff=None        in [0, 1) (0 or None: off)
        no_repeat_ngram_size=None  whole number >= 0: no n-gram of that many tokens twice
                               (0 or None: off; beam search uses it too)
        suppress_tokens=None   token ids that are never generated
        bad_words_ids=None     a list of token id lists: never generate any of them (a
                               longer one is banned at its last token once the rest is there)
        sequence_bias=None     [[ids, bias], ...] or {(ids): bias}: bias added to the last
                               token's logit where the rest is there (-inf bans)
        logit_bias=None        {token_id: bias} added to those logits (OpenAI's; -inf bans)
        presence_penalty=None  a finite number subtracted from each generated token's logit
        frequency_penalty=None a finite number times each token's count in the output,
                               subtracted from its logit (OpenAI's; 0 or None: off)
        seed=None              whole number, for reproducible sampling
        stop=None              a string or a list of strings that end generation
        stop_on_eos=True       end at the tokenizer's EOS token
        num_beams=1            beam search when > 1; it ignores temperature, top_k, top_p,
                               min_p, typical_p, epsilon_cutoff, eta_cutoff and seed (it
                               scores, it does not sample)
        length_penalty=1.0     beam score = sum of log-probs / length ** length_penalty, in
                               [-40, 40]; only with num_beams > 1
        min_new_tokens=0       EOS cannot end generation before this many tokens
        context_overflow="stop"  or "crop": keep going from the last max_seq_len tokens
        logprobs=None          True: each generated token's log-prob (GenerationResult.logprobs);
                               N >= 0: also the N most likely tokens (top_logprobs);
                               None or False: off (see generation/logprobs.py)
        reuse_cache=False      True: keep the KV cache after generating, and start from the
                               kept one where the prompt begins with its ids (one prompt)
        draft=None             speculative decoding (one prompt, no beams, no crop): "prompt"
                               (prompt lookup) or a draft model with the same vocabulary;
                               the same tokens (greedy) or distribution (sampling), faster
        draft_tokens=None      tokens drafted per round, >= 1 (5 by default); only with draft
        chat=False             accepted (it concerns the prompt, not sampling)

    A name outside this list is refused with the closest one ("did you mean")."""
    kwargs.pop("chat", None)
    make_request(kwargs)


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


def make_request(kwargs: dict[str, Any]) -> Request:
    max_new = kwargs.get("max_new_tokens", 64)
    if not is_int(max_new) or max_new < 0:
        raise GenerationError(f"max_new_tokens={max_new!r} is invalid: use a whole number >= 0.")
    num_beams = kwargs.get("num_beams", 1)
    if not is_int(num_beams) or num_beams < 1:
        raise GenerationError(f"num_beams={num_beams!r} is invalid: use 1 (no beam search) or more.")
    known = {"max_new_tokens", *SAMPLER_OPTIONS, "seed", "stop", "stop_on_eos", "num_beams", "length_penalty",
             "min_new_tokens", "context_overflow", "logprobs", "reuse_cache", "draft", "draft_tokens"}
    unknown = set(kwargs) - known
    if unknown:
        name = sorted(unknown)[0]
        raise GenerationError(f"unknown generation option {name!r}; known: {', '.join(sorted(known | {'chat'}))}"
                              f"{did_you_mean(name, known | {'chat'}) or '.'}")
    sampler = {name: kwargs.get(name) for name in SAMPLER_OPTIONS}
    if sampler["temperature"] is None:
        sampler["temperature"] = 1.0
    settings = SamplingSettings(**sampler)
    stop = stop_strings(kwargs.get("stop"))
    min_new = kwargs.get("min_new_tokens", 0)
    if not is_int(min_new) or min_new < 0:
        raise GenerationError(f"min_new_tokens={min_new!r} is invalid: use a whole number >= 0 (EOS cannot end "
                              f"generation before that many new tokens).")
    overflow = kwargs.get("context_overflow", "stop")
    if not isinstance(overflow, str) or overflow not in CONTEXT_OVERFLOW:
        raise GenerationError(f"context_overflow={overflow!r} is unknown; use one of {', '.join(CONTEXT_OVERFLOW)} "
                              f"(stop: end at the context window; crop: keep going from its last max_seq_len tokens).")
    seed = kwargs.get("seed")
    if seed is not None:
        check_seed(seed, "seed", GenerationError)
    length_penalty = check_float(kwargs.get("length_penalty", 1.0), "length_penalty", GenerationError,
                                 low=-MAX_LENGTH_PENALTY, high=MAX_LENGTH_PENALTY,
                                 fix="the beam score is sum of log-probs / length ** length_penalty; -2 to 2 is usual")
    if length_penalty != 1.0 and num_beams == 1:
        raise GenerationError(f"length_penalty={length_penalty:g} scores beam search's hypotheses; add num_beams=N "
                              f"(N > 1), or drop length_penalty.")
    reuse = kwargs.get("reuse_cache", False)
    if not isinstance(reuse, bool):
        raise GenerationError(f"reuse_cache must be True or False, got {reuse!r}.")
    draft, draft_tokens = draft_options(kwargs.get("draft"), kwargs.get("draft_tokens"))
    return Request(settings, max_new, stop, [], seed, num_beams, length_penalty,
                   bool(kwargs.get("stop_on_eos", True)), min_new, overflow, logprobs_count(kwargs.get("logprobs")),
                   reuse, draft, draft_tokens)


def draft_options(draft: Any, draft_tokens: Any) -> tuple[Any, int]:
    """``draft`` and ``draft_tokens`` checked (a draft model's vocabulary is checked against the
    model's by ``speculative.check_draft``); draft_tokens defaults to ``DEFAULT_DRAFT_TOKENS``."""
    from lucidlm.generation.speculative import DEFAULT_DRAFT_TOKENS

    if isinstance(draft, str) and draft != "prompt":
        raise GenerationError(f"draft={draft!r} is invalid: use 'prompt' (prompt lookup: drafts copied from the text "
                              f"so far), a loaded draft model (lucidlm.load(...)), or None (off).")
    if draft_tokens is not None and (not is_int(draft_tokens) or draft_tokens < 1):
        raise GenerationError(f"draft_tokens={draft_tokens!r} is invalid: use a whole number >= 1 (tokens drafted "
                              f"per round; 3 to 10 is usual).")
    if draft is None:
        if draft_tokens is not None:
            raise GenerationError(f"draft_tokens={draft_tokens} needs a draft: add draft='prompt' or draft=<a model>.")
        return None, 0
    return draft, DEFAULT_DRAFT_TOKENS if draft_tokens is None else int(draft_tokens)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def stop_strings(stop: Any) -> list[str]:
    """``stop`` as a list of non-empty strings (one string is a list of one)."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, (list, tuple)) else None
    if stop is None:
        return []
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise GenerationError(f"stop={stop!r} is invalid: give a non-empty string or a list of non-empty strings "
                              f"(the texts that end generation).")
    return list(stops)


def prompt_ids(model: Any, prompt: Any, chat: bool, within_context: bool = True) -> list[int]:
    """``prompt`` as token ids; ``within_context``: a text that cannot fit the context is
    refused before it is tokenized (not with context_overflow="crop", which takes any length)."""
    tokenizer = model.tokenizer
    context = model.config.max_seq_len if within_context else None
    if chat:
        if not isinstance(prompt, str):
            raise GenerationError("chat=True needs a text prompt (the user's message), not token ids.")
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}], context=context)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GenerationError("this model has no tokenizer (model.tokenizer is None): pass token ids, not text.")
        if context is not None:
            refuse_past_context(tokenizer, prompt, context)
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise GenerationError(f"a prompt tensor holds token ids, so it needs an integer dtype, not {prompt.dtype}; "
                                  f"use ids.long().")
        ids = [int(i) for i in prompt.reshape(-1).tolist()]
    elif isinstance(prompt, (list, tuple)) and all(is_int(i) for i in prompt):
        ids = [int(i) for i in prompt]
    else:
        raise GenerationError(f"prompt={shown(prompt)} is invalid: give text, a list of token ids (ints), a 1-D "
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


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_beams(model: Any, num_beams: int, capacity: int) -> None:
    """Refuse a beam count no model could use (more beams than tokens) or whose KV cache and
    (beams, vocab) score tables would not fit in memory, before anything is allocated."""
    config = model.config
    if num_beams > config.vocab_size:
        raise GenerationError(f"num_beams={num_beams} is more than this model's {config.vocab_size} tokens; beams "
                              f"must be distinct sequences, so use at most {config.vocab_size} (4 to 8 is usual).")
    kv = 2 * config.n_layers * config.n_kv_heads * config.head_dim * capacity * model.dtype.itemsize
    check_allocation(num_beams * (kv + 4 * 4 * config.vocab_size), f"beam search with num_beams={num_beams}",
                     GenerationError, "use fewer beams (4 to 8 is usual)")


def fit_to_context(model: Any, rows: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """max_new_tokens, cut so prompt + output fit the context; error if the prompt cannot."""
    limit = model.config.max_seq_len
    longest = max(len(r) for r in rows)
    if longest > limit:
        raise GenerationError(f"the prompt is {longest} tokens, longer than the model's context of {limit} tokens "
                              f"(max_seq_len); shorten the prompt.")
    return min(max_new_tokens, limit - longest)


def padding_id(tokenizer: Any) -> int:
    for name in ("pad_id", "eos_id", "bos_id"):  # any valid id will do: padding is masked out
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    return 0


def private_generator(model: Any, seed: Optional[int]) -> torch.Generator:
    generator = torch.Generator(device=model.device)
    if seed is None:
        generator.seed()  # fresh entropy, without touching the global RNG
    else:
        generator.manual_seed(int(seed))
    return generator
