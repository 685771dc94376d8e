"""Logit processors and the sampler: how one row of logits becomes the next token.

Each processor takes logits (B, V) and returns new logits (B, V); a filtered-out token gets
-inf, so softmax gives it probability 0. They are applied in the order of the list transformers'
``GenerationMixin._get_logits_processor`` builds (transformers 5.25):

    sequence bias (and logit bias) -> repetition penalty -> presence and frequency penalties
        -> no-repeat n-gram -> bad words -> suppressed tokens
        -> temperature -> top-k -> top-p -> min-p -> typical-p -> epsilon cutoff -> eta cutoff
        -> sample (or argmax)

transformers has no presence or frequency penalty: they come right after the repetition
penalty, as in llama.cpp's penalties sampler (repeat, then frequency and presence). The
processors before temperature (``apply_processors``) also run for greedy decoding and on
beam search's log-probs; the warpers after it only when sampling. ``temperature == 0`` means
greedy decoding: the argmax after the processors.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.logprobs import LogprobRecorder
from lucidlm.quantization.blocks_kernel import argmax_rows

# What the bias options take, as transformers and OpenAI take them (SamplingSettings keeps them as tuples):
# sequence_bias [[ids, bias], ...] or {(ids): bias}; logit_bias {id: bias}, an id also as a string of digits
SequenceBias = Union[Mapping[tuple[int, ...], float], Sequence[Sequence[Union[Sequence[int], float]]]]
LogitBias = Mapping[Union[int, str], float]

_TINY_TEMPERATURE = 1e-20  # below this, logits / temperature can overflow float32
_LARGEST_TEMPERATURE = torch.finfo(torch.float32).max  # ~3.4e38; above, it is inf in float32: -inf / inf = NaN
_PENALTY_LIMIT = 1e30  # a seen logit divided or multiplied by more stays finite in float32 up to |logit| ~3e8


def _is_finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    """A whole number >= 0 (2 or 2.0, not True or 2.5)."""
    return _is_finite(value) and int(value) == value and value >= 0  # type: ignore[call-overload, operator]


@dataclass(frozen=True)
class SamplingSettings:
    """The knobs of the sampler, checked once when built."""

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    typical_p: Optional[float] = None
    epsilon_cutoff: Optional[float] = None
    eta_cutoff: Optional[float] = None
    no_repeat_ngram_size: Optional[int] = None
    suppress_tokens: Optional[tuple[int, ...]] = None  # any sequence of ids; kept as a tuple
    bad_words_ids: Optional[tuple[tuple[int, ...], ...]] = None  # any sequence of id sequences; kept as tuples
    # [[ids, bias], ...] or {(ids): bias} as transformers takes it; kept as ((ids, bias), ...)
    sequence_bias: Optional[tuple[tuple[tuple[int, ...], float], ...]] = None
    logit_bias: Optional[tuple[tuple[int, float], ...]] = None  # {id: bias} as OpenAI takes it; kept as pairs
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None

    def __post_init__(self) -> None:
        # list-valued options kept as tuples: the settings stay hashable and cannot change under a generation
        if self.suppress_tokens is not None:
            object.__setattr__(self, "suppress_tokens", _token_ids("suppress_tokens", self.suppress_tokens))
        if self.bad_words_ids is not None:
            object.__setattr__(self, "bad_words_ids", _token_sequences("bad_words_ids", self.bad_words_ids))
        if self.sequence_bias is not None:
            object.__setattr__(self, "sequence_bias", _sequence_biases(self.sequence_bias))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_biases(self.logit_bias))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "typical_p", "epsilon_cutoff",
                     "eta_cutoff", "presence_penalty", "frequency_penalty"):  # a number first, then its range
            value = getattr(self, name)
            if (value is not None or name == "temperature") and not _is_finite(value):
                raise GenerationError(f"{name}={value!r} is invalid: expected a finite number"
                                      f"{' (0 = greedy)' if name == 'temperature' else ''}.")
        if not self.temperature >= 0:
            raise GenerationError(f"temperature={self.temperature} is invalid: use 0 (greedy) or a positive number.")
        if self.temperature > _LARGEST_TEMPERATURE:
            raise GenerationError(f"temperature={self.temperature} is invalid: it must be at most 3.4e38, float32's "
                                  f"largest number (logits are divided by it in float32); a temperature of a few "
                                  f"hundred already samples almost uniformly.")
        if self.top_k is not None and not _is_count(self.top_k):
            raise GenerationError(f"top_k={self.top_k!r} is invalid: use a whole number >= 0 (0 or None = no top-k).")
        if self.no_repeat_ngram_size is not None and not _is_count(self.no_repeat_ngram_size):
            raise GenerationError(f"no_repeat_ngram_size={self.no_repeat_ngram_size!r} is invalid: use a whole number "
                                  f">= 0, the length of the n-grams that may occur only once (0 or None = off; 2 to "
                                  f"4 is usual).")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p={self.top_p} is invalid: it must be in (0, 1] (1 or None = no top-p).")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise GenerationError(f"min_p={self.min_p} is invalid: it must be in [0, 1] (0 or None = no min-p).")
        if self.typical_p is not None and not 0 < self.typical_p <= 1:
            raise GenerationError(f"typical_p={self.typical_p} is invalid: it must be in (0, 1] "
                                  f"(1 or None = no typical sampling).")
        # transformers skips a cutoff of 1 or more without a word (as it does top_p > 1): refused, as top_p > 1 is
        for name, usual in (("epsilon_cutoff", "3e-4 to 9e-4"), ("eta_cutoff", "3e-4 to 2e-3")):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise GenerationError(f"{name}={value} is invalid: it must be in [0, 1) "
                                      f"(0 or None = no {name.replace('_', ' ')}; {usual} is usual).")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise GenerationError(
                f"repetition_penalty={self.repetition_penalty} is invalid: it must be > 0 "
                f"(1 or None = no penalty; > 1 discourages repeats)."
            )
        if self.repetition_penalty is not None and not 1 / _PENALTY_LIMIT <= self.repetition_penalty <= _PENALTY_LIMIT:
            raise GenerationError(
                f"repetition_penalty={self.repetition_penalty} is invalid: it must be between 1e-30 and 1e30 "
                f"(a seen token's float32 logit is divided or multiplied by it, and overflows beyond); "
                f"1 or None = no penalty, > 1 discourages repeats, 1.1 to 1.5 is usual."
            )

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            # in float32, a penalty past ~3.4e38 is inf, and an unseen token's 0 * inf is NaN: every logit
            # NaN (garbage ids when greedy, a torch error when sampling); 1e30 times any count stays finite
            if value is not None and not -_PENALTY_LIMIT <= value <= _PENALTY_LIMIT:
                raise GenerationError(f"{name}={value} is invalid: it must be between -1e30 and 1e30 (it is "
                                      f"subtracted from float32 logits, which overflow beyond); -2 to 2 is "
                                      f"OpenAI's range, 0 or None = off.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_token_ids(self, vocab_size: int, eos_ids: Sequence[int] = (), min_new_tokens: int = 0) -> None:
        """Every token id the options name is one of the model's (an id past the logits would be
        an index error deep in a decode step, or a ban that bans nothing); a bad word that is a
        lone end token is refused, as transformers would silently drop it from its ban; and some
        token must stay possible (``min_new_tokens`` > 0 bans the end tokens too, at first)."""
        named = {"suppress_tokens": [self.suppress_tokens or ()], "bad_words_ids": self.bad_words_ids or (),
                 "sequence_bias": [ids for ids, _ in self.sequence_bias or ()],
                 "logit_bias": [[i for i, _ in self.logit_bias or ()]]}
        for name, sequences in named.items():
            for ids in sequences:
                bad = [i for i in ids if i >= vocab_size]
                if bad:
                    raise GenerationError(f"{name} names token id {bad[0]}, outside this model's vocabulary "
                                          f"0..{vocab_size - 1}; use ids below {vocab_size} (the model's "
                                          f"tokenizer.encode gives them).")
        banned = self.banned_ids() | (set(eos_ids) if min_new_tokens > 0 else set())
        if len(banned) >= vocab_size:  # every logit -inf: greedy took token 0 anyway, sampling died in multinomial
            reason = " (with the end tokens, which min_new_tokens holds back)" if min_new_tokens > 0 else ""
            raise GenerationError(f"the options ban every one of the model's {vocab_size} tokens{reason}: "
                                  f"suppress_tokens, one-token bad_words_ids and -inf logit_bias / sequence_bias "
                                  f"entries; leave at least one token possible.")
        for ids in self.bad_words_ids or ():
            if len(ids) == 1 and ids[0] in eos_ids:
                raise GenerationError(f"bad_words_ids bans the end token {ids[0]} alone, which transformers leaves "
                                      f"possible (it drops EOS from its bans); to forbid it, use "
                                      f"suppress_tokens=[{ids[0]}] (or min_new_tokens to delay it).")


    def banned_ids(self) -> set[int]:
        """The token ids no step may choose, whatever came before: suppressed, one-token bad
        words, and -inf biases of single tokens."""
        banned = set(self.suppress_tokens or ())
        banned.update(ids[0] for ids in self.bad_words_ids or () if len(ids) == 1)
        banned.update(ids[0] for ids, bias in self.sequence_bias or () if len(ids) == 1 and bias == float("-inf"))
        banned.update(i for i, bias in self.logit_bias or () if bias == float("-inf"))
        return banned


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    """``value`` (a sequence of token ids) as a tuple of ints, or a GenerationError naming it."""
    items = value.tolist() if isinstance(value, torch.Tensor) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple, set, frozenset, range)) or \
            not all(_is_count(i) for i in items):
        raise GenerationError(f"{name}={value!r} is invalid: give a list of token ids (whole numbers >= 0), "
                              f"e.g. [13, 198].")
    return tuple(int(i) for i in items)


def _bias(name: str, key: Any, value: Any) -> float:
    """A bias: a finite number, or -inf (the token or sequence banned); +inf and NaN would make
    the softmax NaN. The biases live in float32 tables: one past 1e30 is refused, as the penalties
    are (past ~3.4e38, float32 has no such number; torch refused to store it, mid-generation)."""
    if not (_is_finite(value) or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                                  and value == float("-inf"))):
        raise GenerationError(f"{name}[{key!r}]={value!r} is invalid: a bias is a finite number added to the "
                              f"logit (-100 to 100 is OpenAI's range), or -inf to ban it.")
    if math.isfinite(value) and not -_PENALTY_LIMIT <= value <= _PENALTY_LIMIT:
        raise GenerationError(f"{name}[{key!r}]={value!r} is invalid: a bias must be between -1e30 and 1e30 (it is "
                              f"added to float32 logits; -100 to 100 is OpenAI's range), or -inf to ban it.")
    return float(value)


def _sequence_biases(value: Any) -> tuple[tuple[tuple[int, ...], float], ...]:
    """transformers' sequence_bias, a list of [ids, bias] pairs or a dict {ids: bias}, as
    ((ids, bias), ...); a sequence given twice keeps its last bias, as transformers' dict does."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise GenerationError(f"sequence_bias={value!r} is invalid: give a list of [token ids, bias] pairs, e.g. "
                              f"[[[464, 3290], -5.0], [[13], 2.0]], or a dict {{(464, 3290): -5.0}}.")
    found: dict[tuple[int, ...], float] = {}
    for ids, bias in pairs:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise GenerationError(f"sequence_bias biases {ids!r}, which is not a sequence: give each as a non-empty "
                                  f"list of token ids, e.g. [[[464, 3290], -5.0]].")
        key = _token_ids("sequence_bias", ids)
        found[key] = _bias("sequence_bias", key, bias)
    return tuple(found.items())


def _logit_biases(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's and llama.cpp's logit_bias, {token id: bias} (an id may be a string of digits,
    as OpenAI's JSON writes it), as ((id, bias), ...); those pairs are taken too (``dataclasses.replace``)."""
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise GenerationError(f"logit_bias={value!r} is invalid: give a dict {{token id: bias}}, e.g. "
                              f"{{13: -100, 198: 5.0}}.")
    found: dict[int, float] = {}
    for key, bias in pairs:
        # isdecimal, not isdigit: "²" is a digit that int() refuses
        token = int(key) if isinstance(key, str) and key.strip().isdecimal() else key
        if not _is_count(token):
            raise GenerationError(f"logit_bias has key {key!r}, which is not a token id (a whole number >= 0); give "
                                  f"a dict {{token id: bias}}, e.g. {{13: -100}}.")
        found[int(token)] = _bias("logit_bias", int(token), bias)
    return tuple(found.items())


def _token_sequences(name: str, value: Any) -> tuple[tuple[int, ...], ...]:
    """``value`` (a list of token id lists) as tuples, each non-empty, or a GenerationError naming it."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or \
            not all(isinstance(ids, (list, tuple)) and ids for ids in value):
        raise GenerationError(f"{name}={value!r} is invalid: give a list of non-empty lists of token ids, one "
                              f"per banned sequence, e.g. [[13], [464, 3290]] (tokenizer.encode(' word') gives "
                              f"a word's ids).")
    return tuple(_token_ids(f"{name}[{i}]", ids) for i, ids in enumerate(value))


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019), as in HF: every token already seen in the row
    has its logit divided by ``penalty`` if positive, multiplied if negative, so a penalty
    > 1 always makes it less likely. seen_ids: (B, S); repeats are harmless."""
    seen_logits = logits.gather(1, seen_ids)  # (B, S)
    seen_logits = torch.where(seen_logits < 0, seen_logits * penalty, seen_logits / penalty)
    return logits.scatter(1, seen_ids, seen_logits)


def apply_presence_frequency_penalty(logits: torch.Tensor, generated_ids: torch.Tensor, presence: float,
                                     frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties, as its API reference writes them:
    logit[j] -= frequency * count[j] + presence * (count[j] > 0), count[j] being how often token j
    was generated so far in the row. ``generated_ids`` (B, T): the output only, as OpenAI counts
    (llama.cpp applies the same formula to its last ``penalty_last_n`` tokens, 64 by default,
    which include the prompt's). Negative values make repeats likelier."""
    counts = torch.zeros_like(logits).scatter_add_(1, generated_ids, torch.ones_like(generated_ids, dtype=logits.dtype))
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence  # (B, V)


def no_repeat_ngram_filter(logits: torch.Tensor, seen_ids: torch.Tensor, n: int,
                           padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ban every token that would complete an n-gram already in ``seen_ids`` (B, S) (prompt and
    output: fairseq's and transformers' NoRepeatNGramLogitsProcessor). Every window of n tokens
    whose first n - 1 equal the row's last n - 1 bans its own last token; all windows are
    compared at once on the device. ``padding`` (B, 1): each row's left-padding columns, whose
    windows are not the row's text."""
    S = seen_ids.shape[1]
    if S < n:  # no complete n-gram yet
        return logits
    suffix = seen_ids[:, S + 1 - n:]  # (B, n - 1): the n-gram the next token would complete begins with it
    windows = seen_ids.unfold(1, n, 1)  # (B, S - n + 1, n)
    matches = (windows[..., :-1] == suffix[:, None]).all(dim=-1)  # (B, W); n = 1: every window matches
    if padding is not None:
        matches &= torch.arange(windows.shape[1], device=seen_ids.device) >= padding  # (B, W)
    vocab = logits.shape[-1]
    # a window that does not match points at a spare column past the vocabulary, so it bans nothing
    banned = torch.zeros((logits.shape[0], vocab + 1), dtype=torch.bool, device=logits.device)
    banned.scatter_(1, torch.where(matches, windows[..., -1], vocab), True)
    return logits.masked_fill(banned[:, :vocab], float("-inf"))


def suppress_filter(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Ban ``token_ids`` (K,) in every row (transformers' SuppressTokensLogitsProcessor)."""
    return logits.index_fill(-1, token_ids, float("-inf"))


def sequence_bias_tables(biases: dict[tuple[int, ...], float], vocab: int,
                         device: torch.device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """What ``apply_sequence_bias`` adds, as tensors on the device (built once per generation):
    the single-token biases as one (V,) row, and the longer sequences grouped by prefix length P,
    each group (prefixes (G, P), last tokens (G,), biases (G,)), as transformers groups them."""
    single = torch.zeros(vocab)
    for ids, bias in biases.items():
        if len(ids) == 1:
            single[ids[0]] = bias
    by_length: dict[int, list[tuple[tuple[int, ...], float]]] = {}
    for ids, bias in biases.items():
        if len(ids) > 1:
            by_length.setdefault(len(ids) - 1, []).append((ids, bias))
    groups = [(torch.tensor([ids[:-1] for ids, _ in group], device=device),
               torch.tensor([ids[-1] for ids, _ in group], device=device),
               torch.tensor([bias for _, bias in group], dtype=torch.float32, device=device))
              for group in by_length.values()]
    return single.to(device), groups


def apply_sequence_bias(logits: torch.Tensor, seen_ids: Optional[torch.Tensor],
                        tables: tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]],
                        padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Add each biased sequence's bias to its last token's logit where the row ends with the
    rest of it (transformers' SequenceBiasLogitsProcessor; -inf bans it: NoBadWordsLogitsProcessor).
    A single token's bias always applies. tables: ``sequence_bias_tables``; seen_ids (B, S);
    padding (B, 1): a row's left padding cannot complete a prefix."""
    single, groups = tables
    bias = single.expand_as(logits).clone()  # (B, V)
    S = seen_ids.shape[1] if seen_ids is not None else 0
    for prefixes, last, values in groups:
        P = prefixes.shape[1]
        if P > S:  # longer than the text so far: it cannot match
            continue
        matches = (seen_ids[:, None, S - P:] == prefixes).all(dim=-1)  # (B, G)
        if padding is not None:
            matches &= S - P >= padding  # (B, 1): the prefix lies in the row's own tokens
        bias.index_add_(1, last, torch.where(matches, values, 0.0))
    return logits + bias


def _device_tables(settings: "SamplingSettings", name: str, logits: torch.Tensor) -> Any:
    """An option's tensors on the logits' device, made at the first step and kept with the
    settings: a decode step copies nothing from the host."""
    cache = settings.__dict__.setdefault("_device_tables", {})  # not a field: == and hash ignore it
    key = (name, logits.device, logits.shape[-1])
    if key not in cache:
        if name == "suppress_tokens":
            cache[key] = torch.tensor(settings.suppress_tokens, dtype=torch.long, device=logits.device)
        elif name == "bad_words_ids":  # a banned sequence is a bias of -inf
            biases = {ids: float("-inf") for ids in settings.bad_words_ids or ()}
            cache[key] = sequence_bias_tables(biases, logits.shape[-1], logits.device)
        else:  # a logit bias is the bias of a one-token sequence, added to a sequence_bias of that token
            biases = dict(settings.sequence_bias or ())
            for token, bias in settings.logit_bias or ():
                biases[(token,)] = biases.get((token,), 0.0) + bias
            cache[key] = sequence_bias_tables(biases, logits.shape[-1], logits.device)
    return cache[key]


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature < _TINY_TEMPERATURE:
        # logits / 1e-45 overflows float32 to inf (inf - inf = NaN in softmax). Shifting each row
        # so its largest logit is 0 changes no probability, and a divisor no smaller than the
        # least normal float32 keeps every value in [-inf, 0]: the result is (near) greedy.
        logits = logits - logits.max(dim=-1, keepdim=True).values  # (B, V), max 0
        temperature = max(temperature, torch.finfo(torch.float32).tiny)
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th)."""
    k = min(int(k), logits.shape[-1])
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2019): keep the smallest set of most likely tokens
    whose probabilities add up to at least p. The most likely token is always kept."""
    # Summed from the least likely up, as HF does: the ~1e5 tiny tail terms of a large vocabulary
    # add up first, where float32 is fine-grained. Summing from the top, 1 - (mass above) near 1.0
    # loses their rounding error and keeps hundreds of tokens too few (V = 262k, p = 0.999).
    sorted_logits, order = torch.sort(logits, dim=-1)  # (B, V), ascending
    mass_up_to = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (B, V): this token and every less likely one
    drop_sorted = mass_up_to <= 1 - p  # the tokens ranked above it already reach p
    drop_sorted[..., -1] = False  # the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Min-p sampling (Nguyen et al. 2024): keep tokens at least ``min_p`` times as likely
    as the most likely one, so the cut adapts to how confident the model is."""
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def typical_filter(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022, "Locally Typical Sampling"): keep the
    tokens whose surprisal -log p is closest to the row's entropy (its expected surprisal),
    as few as reach probability ``mass`` together. The most likely token may be dropped."""
    log_probs = logits.log_softmax(dim=-1)  # (B, V)
    # a banned token's -inf * 0 is NaN: nansum counts it as the 0 it contributes
    entropy = -(log_probs * log_probs.exp()).nansum(dim=-1, keepdim=True)  # (B, 1)
    distance = (-log_probs - entropy).abs()  # (B, V): inf for a banned token, so it sorts last
    sorted_distance, order = torch.sort(distance, dim=-1)  # (B, V), most typical first
    mass_up_to = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)  # (B, V): it and every more typical one
    # the first position whose running mass reaches `mass` (a count, not .item(): no host sync)
    last = (mass_up_to < mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # (B, 1)
    drop_sorted = sorted_distance > sorted_distance.gather(-1, last)  # tokens tied with the last kept one stay
    drop_sorted[..., 0] = False  # the most typical token
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def epsilon_filter(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Epsilon sampling (Hewitt et al. 2022, "Truncation Sampling as Language Model
    Desmoothing"): drop tokens whose probability is below ``epsilon``; the most likely token
    (and any tied with it) always stays."""
    probs = logits.softmax(dim=-1)  # (B, V)
    top = logits.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill((probs < epsilon) & (logits < top), float("-inf"))


def eta_filter(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Eta sampling (Hewitt et al. 2022, "Truncation Sampling as Language Model Desmoothing"):
    epsilon sampling whose cutoff eta = min(epsilon, sqrt(epsilon) * exp(-entropy)) shrinks as
    the row's entropy grows, so a flat distribution keeps more of its tail. The most likely
    token (and any tied with it) always stays."""
    log_probs = logits - logits.logsumexp(dim=-1, keepdim=True)  # (B, V)
    # clamped as torch's Categorical.entropy does: a banned token's -inf * 0 would be NaN
    clamped = log_probs.clamp(min=torch.finfo(logits.dtype).min)
    entropy = -(clamped * log_probs.softmax(dim=-1)).sum(dim=-1, keepdim=True)  # (B, 1)
    epsilon_t = logits.new_full((1,), epsilon)  # a fill on the device, not a copy from the host
    eta = torch.minimum(epsilon_t, epsilon_t.sqrt() * torch.exp(-entropy))  # (B, 1)
    top = logits.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill((logits.softmax(dim=-1) < eta) & (logits < top), float("-inf"))


def apply_processors(logits: torch.Tensor, settings: SamplingSettings, seen_ids: Optional[torch.Tensor] = None,
                     padding: Optional[torch.Tensor] = None, prompt_len: int = 0) -> torch.Tensor:
    """The processors that come before temperature in HF's list, which greedy decoding and beam
    search apply too (beam search to its log-probs). logits: (B, V) float; seen_ids: (B, S) the
    row's prompt and output so far (None: the ones that look at it are skipped); padding: (B, 1)
    the row's left-padding columns of seen_ids (a batch), which are not its text; prompt_len:
    seen_ids' columns before the output (presence and frequency penalties count the rest)."""
    if settings.sequence_bias or settings.logit_bias:
        logits = apply_sequence_bias(logits, seen_ids, _device_tables(settings, "sequence_bias", logits), padding)
    if seen_ids is not None and settings.repetition_penalty not in (None, 1.0):
        logits = apply_repetition_penalty(logits, seen_ids, settings.repetition_penalty)
    if seen_ids is not None and (settings.presence_penalty or settings.frequency_penalty) and \
            seen_ids.shape[1] > prompt_len:
        logits = apply_presence_frequency_penalty(logits, seen_ids[:, prompt_len:], settings.presence_penalty or 0.0,
                                                  settings.frequency_penalty or 0.0)
    if seen_ids is not None and settings.no_repeat_ngram_size:
        logits = no_repeat_ngram_filter(logits, seen_ids, int(settings.no_repeat_ngram_size), padding)
    if settings.bad_words_ids:
        logits = apply_sequence_bias(logits, seen_ids, _device_tables(settings, "bad_words_ids", logits), padding)
    if settings.suppress_tokens:
        logits = suppress_filter(logits, _device_tables(settings, "suppress_tokens", logits))
    return logits


def process_logits(logits: torch.Tensor, settings: SamplingSettings, seen_ids: Optional[torch.Tensor] = None,
                   padding: Optional[torch.Tensor] = None, prompt_len: int = 0) -> torch.Tensor:
    """Every processor the settings ask for, in HF's order. logits: (B, V) float; seen_ids,
    padding and prompt_len: see ``apply_processors``."""
    logits = apply_processors(logits, settings, seen_ids, padding, prompt_len)
    if settings.greedy:
        return logits  # the filters below cannot change the argmax
    if settings.temperature != 1.0:
        logits = apply_temperature(logits, settings.temperature)
    if settings.top_k:
        logits = top_k_filter(logits, settings.top_k)
    if settings.top_p is not None and settings.top_p < 1.0:
        logits = top_p_filter(logits, settings.top_p)
    if settings.min_p:
        logits = min_p_filter(logits, settings.min_p)
    if settings.typical_p is not None and settings.typical_p < 1.0:
        logits = typical_filter(logits, settings.typical_p)
    if settings.epsilon_cutoff:
        logits = epsilon_filter(logits, settings.epsilon_cutoff)
    if settings.eta_cutoff:
        logits = eta_filter(logits, settings.eta_cutoff)
    return logits


def sample_next(logits: torch.Tensor, settings: SamplingSettings, seen_ids: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None,
                recorder: Optional[LogprobRecorder] = None, padding: Optional[torch.Tensor] = None,
                prompt_len: int = 0) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V). ``recorder`` (a ``LogprobRecorder``) is handed the
    processed logits the ids came from, on the device; seen_ids, padding and prompt_len: see
    ``apply_processors``."""
    logits = process_logits(logits.float(), settings, seen_ids, padding, prompt_len)
    if settings.greedy:
        ids = argmax_rows(logits)  # logits.argmax(dim=-1), in C on a CPU
    else:
        probs = logits.softmax(dim=-1)
        ids = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    if recorder is not None:
        recorder.record(logits, ids)
    return ids
