"""``generation.prompt_logprobs``: each prompt token's log-prob against transformers' float32
SmolLM2 (reading the same GGUF file) and its tokenizer, and, on the 4-bit default, against the
log-probs ``generate`` reports for the same tokens when it produces them greedily."""

from __future__ import annotations

import re

import pytest
import torch

from lucidlm.errors import GenerationError
from lucidlm.generation import generate
from lucidlm.generation.prompt_logprobs import CHUNK_ELEMENTS, prompt_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "Question: What is the capital of France?\nAnswer: Paris, a city on the Seine."


def test_float32_log_probs_and_alternatives_are_transformers(smollm2, hf_smollm2):
    hf, tokenizer = hf_smollm2
    text = " ".join([TEXT] * 10)  # ~210 tokens: the log-softmax's chunks of 85 positions (49,152 tokens) meet
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 2 * (CHUNK_ELEMENTS // smollm2.config.vocab_size)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)  # (T-1, V)
    scores = prompt_logprobs(smollm2, text, top=5)
    assert scores.token_ids == ids  # the text read as transformers' tokenizer reads it
    assert scores.logprobs[0] is None and scores.top_logprobs[0] is None  # no context for the first token
    reference = expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(scores.logprobs[1:], dtype=torch.double), reference, atol=2e-4, rtol=0)
    values, indices = expected.topk(6, dim=-1)
    for t, top in enumerate(scores.top_logprobs[1:]):
        assert len(top) == 5 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        for rank, (token, value) in enumerate(top):
            assert value == pytest.approx(float(values[t, rank]), abs=2e-4)
            if values[t, rank] - values[t, rank + 1] > 1e-3 and (rank == 0 or values[t, rank - 1] - values[t, rank]
                                                                   > 1e-3):
                assert token == int(indices[t, rank])  # the same token wherever its rank is not a near tie


def test_the_default_models_scores_match_what_greedy_generation_reported(smollm2_default):
    result = generate(smollm2_default, TEXT, max_new_tokens=12, temperature=0, logprobs=3, stop_on_eos=False)
    scores = prompt_logprobs(smollm2_default, result.prompt_ids + result.token_ids, top=3)
    generated = slice(len(result.prompt_ids), None)
    # the same weights and kernels, one pass over every token against a KV-cached decode step each:
    # the int8 codes of the activations differ in the last bits
    assert scores.logprobs[generated] == pytest.approx(result.logprobs, abs=5e-3)
    for top, reported in zip(scores.top_logprobs[generated], result.top_logprobs):
        assert top[0][0] == reported[0][0]  # greedy's token is the likeliest in both
        assert [v for _, v in top] == pytest.approx([v for _, v in reported], abs=5e-3)


def test_options_and_refusals(smollm2_default):
    model = smollm2_default
    plain = prompt_logprobs(model, TEXT)
    assert plain.top_logprobs[1:] == [[] for _ in plain.token_ids[1:]]
    assert prompt_logprobs(model, plain.token_ids).logprobs == plain.logprobs  # ids or text: the same pass
    chat = prompt_logprobs(model, "Hi", chat=True)
    assert chat.token_ids == generate(model, "Hi", chat=True, max_new_tokens=0).prompt_ids
    single = prompt_logprobs(model, [42])
    assert single.logprobs == [None] and single.top_logprobs == [None]
    for top in (-1, 1.5, True):
        with pytest.raises(GenerationError, match=re.escape(f"top={top!r} is invalid")):
            prompt_logprobs(model, TEXT, top=top)
    with pytest.raises(GenerationError, match="prompt token id 99999 is outside this model's vocabulary"):
        prompt_logprobs(model, [1, 99999])
    context = model.config.max_seq_len
    with pytest.raises(GenerationError, match=f"the prompt is {context + 1} tokens, longer than the model's context"):
        prompt_logprobs(model, [1] * (context + 1))
