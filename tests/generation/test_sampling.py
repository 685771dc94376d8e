"""Logit processors against hand-made logits and against HF's own processors."""

from __future__ import annotations

import math

import pytest
import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.sampling import (SamplingSettings, apply_repetition_penalty, min_p_filter, sample_next,
                                         top_k_filter, top_p_filter)

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,  # noqa: E402
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, -2.0, 4.0]])
    assert kept(top_k_filter(logits, 1)) == {1}
    assert kept(top_k_filter(logits, 3)) == {1, 4, 2}
    assert kept(top_k_filter(logits, 99)) == {0, 1, 2, 3, 4}  # k above the vocabulary keeps all


def test_top_p_keeps_smallest_set_reaching_p():
    logits = logits_from_probs([0.05, 0.5, 0.3, 0.15])
    assert kept(top_p_filter(logits, 0.5)) == {1}  # 0.5 alone reaches 0.5
    assert kept(top_p_filter(logits, 0.51)) == {1, 2}
    assert kept(top_p_filter(logits, 0.8)) == {1, 2}
    assert kept(top_p_filter(logits, 0.81)) == {1, 2, 3}
    assert kept(top_p_filter(logits, 1.0)) == {0, 1, 2, 3}
    assert kept(top_p_filter(logits, 1e-9)) == {1}  # always at least the top token


def test_min_p_keeps_tokens_relative_to_the_top():
    logits = logits_from_probs([0.05, 0.5, 0.3, 0.15])
    assert kept(min_p_filter(logits, 0.5)) == {1, 2}  # threshold 0.25
    assert kept(min_p_filter(logits, 0.3)) == {1, 2, 3}  # threshold 0.15 keeps 0.15
    assert kept(min_p_filter(logits, 1.0)) == {1}
    assert kept(min_p_filter(logits, 0.0)) == {0, 1, 2, 3}


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    seen = torch.randint(0, 50, (3, 12), generator=gen)  # with repeats
    ours = apply_repetition_penalty(logits, seen, penalty)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("seed", range(5))
def test_filters_match_hf_warpers_on_random_logits(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 200, generator=gen) * 2
    ids = torch.zeros(4, 1, dtype=torch.long)
    for k in (1, 5, 40):
        assert torch.equal(torch.isinf(top_k_filter(logits, k)), torch.isinf(TopKLogitsWarper(k)(ids, logits.clone())))
    for p in (0.1, 0.5, 0.9, 0.99):
        assert torch.equal(torch.isinf(top_p_filter(logits, p)), torch.isinf(TopPLogitsWarper(p)(ids, logits.clone())))
    for m in (0.01, 0.1, 0.5):
        assert torch.equal(torch.isinf(min_p_filter(logits, m)), torch.isinf(MinPLogitsWarper(m)(ids, logits.clone())))
    for t in (0.5, 2.0):
        settings = SamplingSettings(temperature=t)
        from lucidlm.generation.sampling import process_logits
        torch.testing.assert_close(process_logits(logits, settings), TemperatureLogitsWarper(t)(ids, logits.clone()))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_frequencies_match_softmax(temperature):
    """20,000 draws: each token's frequency is within 0.015 of softmax(logits / T). The
    standard error of a frequency is at most sqrt(0.25 / 20000) = 0.0035, so the bound is
    over 4 standard errors (a false failure has probability well under 1e-3 per token)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20_000
    settings = SamplingSettings(temperature=temperature)
    gen = torch.Generator().manual_seed(123)
    draws = sample_next(logits.expand(n, -1), settings, generator=gen)  # n rows, one draw each
    freq = torch.bincount(draws, minlength=5).double() / n
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    assert float((freq - expected).abs().max()) < 0.015


def test_greedy_is_argmax_after_penalty():
    logits = torch.tensor([[3.0, 2.9, -1.0]])
    settings = SamplingSettings(temperature=0, repetition_penalty=2.0)
    assert sample_next(logits, settings).tolist() == [0]
    # token 0 seen: 3.0 / 2 = 1.5 < 2.9
    assert sample_next(logits, settings, seen_ids=torch.tensor([[0]])).tolist() == [1]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature=-0.1), "temperature=-0.1"),
    (dict(temperature=math.nan), "temperature=nan"),
    (dict(top_p=0.0), "top_p=0.0 is invalid: it must be in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1 is invalid"),
    (dict(top_k=2.5), "top_k=2.5"),
    (dict(min_p=-0.1), "min_p=-0.1 is invalid: it must be in [0, 1]"),
    (dict(min_p=1.1), "min_p=1.1"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 is invalid: it must be > 0"),
])
def test_invalid_settings_are_named(kwargs, fragment):
    with pytest.raises(GenerationError) as info:
        SamplingSettings(**kwargs)
    assert fragment in str(info.value)
