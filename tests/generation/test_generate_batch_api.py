"""``generate`` takes a batch (a list of texts, a list of id lists, a (B, T) tensor) and
``model("text")`` runs on text; each checked against the one-prompt-at-a-time path."""

from __future__ import annotations

import pytest
import torch
from generation_toys import one_torch_thread, toy_model  # noqa: F401 (autouse fixture)

from lucidlm import LanguageModel
from lucidlm.errors import LucidLMError
from lucidlm.generation import GenerationResult, generate, stream


@pytest.fixture(scope="module")
def model():
    toy = toy_model(seed=0)
    lm = LanguageModel(toy.config, toy.tokenizer).eval()
    lm.load_state_dict(toy.state_dict())
    return lm


def test_a_list_of_texts_gives_one_result_per_text(model):
    prompts = ["Hello", "Hi there, friend", "A"]
    results = model.generate(prompts, temperature=0, max_new_tokens=10)
    assert isinstance(results, list) and len(results) == 3
    for prompt, result in zip(prompts, results):
        alone = model.generate(prompt, temperature=0, max_new_tokens=10)
        assert isinstance(alone, GenerationResult)
        assert (result.token_ids, result.text, result.prompt_ids) == (alone.token_ids, alone.text, alone.prompt_ids)


def test_a_two_row_tensor_is_two_prompts_not_one(model):
    ids = torch.tensor([list(b"Hello"), list(b"World")])
    results = generate(model, ids, temperature=0, max_new_tokens=8)
    assert [r.prompt_ids for r in results] == [list(b"Hello"), list(b"World")]
    for row, result in zip(ids, results):
        assert result.token_ids == generate(model, row.tolist(), temperature=0, max_new_tokens=8).token_ids
    lists = generate(model, [list(b"Hello"), list(b"World")], temperature=0, max_new_tokens=8)
    assert [r.token_ids for r in lists] == [r.token_ids for r in results]
    single = generate(model, torch.tensor(list(b"Hello")), temperature=0, max_new_tokens=8)
    assert isinstance(single, GenerationResult) and single.token_ids == results[0].token_ids


def test_a_one_row_tensor_streams_as_its_prompt(model):
    """stream(model, input_ids) with transformers' (1, T) input_ids: the pieces of that prompt."""
    row = list(b"Hello")
    pieces = list(stream(model, torch.tensor([row]), temperature=0, max_new_tokens=8))
    alone = generate(model, row, temperature=0, max_new_tokens=8)
    assert "".join(pieces) == alone.text and len(pieces) > 1


@pytest.mark.parametrize("call, fragment", [
    (lambda m: stream(m, ["a", "b"]), "stream takes one prompt"),
    (lambda m: stream(m, torch.zeros(2, 3, dtype=torch.long)), "not a batch of 2"),
    (lambda m: generate(m, ["a", "b"], num_beams=2), "beam search takes one prompt"),
    (lambda m: generate(m, ["a", [1, 2]]), "mixes"),
    (lambda m: generate(m, torch.zeros(1, 2, 3, dtype=torch.long)), "(T,) or (B, T)"),
    (lambda m: m.generate("a", temprature=0.5), "did you mean 'temperature'?"),
])
def test_batch_misuse_is_refused(model, call, fragment):
    with pytest.raises(LucidLMError, match=None) as info:
        call(model)
    assert fragment in str(info.value)


def test_model_called_on_text(model):
    ids = torch.tensor([model.tokenizer.encode("Hello")])
    torch.testing.assert_close(model("Hello"), model(ids), rtol=0, atol=0)
    batch = model(["Hello", "Hi there, friend"])  # left-padded: position -1 is each text's last token
    assert batch.shape[:2] == (2, len("Hi there, friend"))
    for row, text in enumerate(["Hello", "Hi there, friend"]):
        alone = model(torch.tensor([model.tokenizer.encode(text)]))
        torch.testing.assert_close(batch[row, -1], alone[0, -1], rtol=1e-4, atol=1e-4)


def test_model_without_tokenizer_says_how(model):
    bare = LanguageModel(model.config)
    with pytest.raises(LucidLMError) as info:
        bare("Hello")
    assert "tokenizer" in str(info.value)
