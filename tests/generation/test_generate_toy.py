"""generate / generate_batch on tiny random models: KV cache, batching, seeds, limits."""

from __future__ import annotations

import pytest
import torch
from generation_toys import byte_tokenizer, toy_model, one_torch_thread  # noqa: F401 (autouse fixture)

from lucidlm.errors import GenerationError
from lucidlm.generation import generate, generate_batch, stream


@pytest.fixture(scope="module")
def model():
    return toy_model(seed=0)


def greedy_without_cache(model, prompt_ids, n):
    """The reference: rerun the whole sequence every step, no KV cache."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("prompt", ["Hello, world", "x", "The quick brown fox jumps over"])
def test_kv_cached_greedy_equals_recomputing(model, prompt):
    result = generate(model, prompt, max_new_tokens=30, temperature=0, stop_on_eos=False)
    assert result.prompt_ids == list(prompt.encode())
    assert len(result.token_ids) == 30
    assert result.token_ids == greedy_without_cache(model, result.prompt_ids, 30)
    assert result.finish_reason == "length"
    assert model.kv_caches is None  # cache freed afterwards


def test_rope_interleaved_and_learned_positions_also_cache_correctly():
    for overrides in (dict(rope_variant="interleaved"), dict(positions="learned", norm="layer", mlp="gelu")):
        m = toy_model(seed=1, **overrides)
        result = generate(m, "abc", max_new_tokens=20, temperature=0, stop_on_eos=False)
        assert result.token_ids == greedy_without_cache(m, result.prompt_ids, 20)


def test_batched_left_padded_equals_one_at_a_time(model):
    prompts = ["Hi", "A longer prompt here", "medium one"]
    singles = [generate(model, p, max_new_tokens=20, temperature=0) for p in prompts]
    batched = generate_batch(model, prompts, max_new_tokens=20, temperature=0)
    assert [r.token_ids for r in batched] == [r.token_ids for r in singles]
    assert [r.text for r in batched] == [r.text for r in singles]
    assert [r.prompt_ids for r in batched] == [r.prompt_ids for r in singles]


def test_batched_rows_stop_on_eos_independently():
    """Make EOS a token that one row generates early: that row stops, the others go on."""
    base = toy_model(seed=0)
    prompts = ["Hi", "A longer prompt here", "medium one"]
    free = generate_batch(base, prompts, max_new_tokens=20, temperature=0, stop_on_eos=False)
    eos_candidate = free[1].token_ids[5]
    # Swap byte `eos_candidate` with the EOS id (256) in the unembedding: the model now
    # emits EOS wherever it used to emit that byte.
    model = toy_model(seed=0)
    with torch.no_grad():
        w = model.unembed.weight
        w[[eos_candidate, 256]] = w[[256, eos_candidate]]
    results = generate_batch(model, prompts, max_new_tokens=20, temperature=0)
    singles = [generate(model, p, max_new_tokens=20, temperature=0) for p in prompts]
    assert [r.token_ids for r in results] == [r.token_ids for r in singles]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in singles]
    stopped = [r for r in results if r.finish_reason == "eos"]
    assert stopped and all(r.token_ids[-1] == 256 and len(r.token_ids) <= 20 for r in stopped)
    assert results[1].finish_reason == "eos" and len(results[1].token_ids) <= 6
    assert "<|endoftext|>" not in results[1].text


def test_same_seed_same_output_and_global_rng_untouched(model):
    torch.manual_seed(7)
    before = torch.rand(3)
    torch.manual_seed(7)
    a = generate(model, "Hello", max_new_tokens=25, temperature=1.0, seed=11, stop_on_eos=False)
    b = generate(model, "Hello", max_new_tokens=25, temperature=1.0, seed=11, stop_on_eos=False)
    assert torch.equal(torch.rand(3), before)  # our private generator did not consume global draws
    assert a.token_ids == b.token_ids
    others = [generate(model, "Hello", max_new_tokens=25, temperature=1.0, seed=s, stop_on_eos=False).token_ids
              for s in (12, 13)]
    assert any(o != a.token_ids for o in others)


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    greedy = generate(model, "Hello", max_new_tokens=20, temperature=0, stop_on_eos=False).token_ids
    hot = dict(max_new_tokens=20, temperature=5.0, stop_on_eos=False)
    assert generate(model, "Hello", top_k=1, seed=0, **hot).token_ids == greedy
    assert generate(model, "Hello", top_p=1e-9, seed=0, **hot).token_ids == greedy
    assert generate(model, "Hello", min_p=1.0, seed=0, **hot).token_ids == greedy
    assert generate(model, "Hello", seed=0, **hot).token_ids != greedy  # the filters did the work


def test_repetition_penalty_changes_greedy_output(model):
    plain = generate(model, "aaaa", max_new_tokens=20, temperature=0, stop_on_eos=False).token_ids
    penalised = generate(model, "aaaa", max_new_tokens=20, temperature=0, repetition_penalty=5.0,
                         stop_on_eos=False).token_ids
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


def test_prompt_as_ids_and_zero_new_tokens(model):
    ids = list(b"Hello")
    assert generate(model, ids, max_new_tokens=10, temperature=0).token_ids == \
        generate(model, "Hello", max_new_tokens=10, temperature=0).token_ids
    empty = generate(model, ids, max_new_tokens=0)
    assert (empty.token_ids, empty.text, empty.finish_reason) == ([], "", "length")


def test_stops_at_the_context_end_with_reason_length():
    m = toy_model(seed=0, max_seq_len=16)
    result = generate(m, "0123456789", max_new_tokens=50, temperature=0, stop_on_eos=False)
    assert len(result.token_ids) == 6  # 10 prompt + 6 new = the 16-token context
    assert result.finish_reason == "length"
    with pytest.raises(GenerationError, match=r"prompt is 17 tokens, longer than the model's context of 16"):
        generate(m, "x" * 17, max_new_tokens=1)


def test_empty_prompt_starts_from_bos_or_fails():
    with_bos = toy_model(seed=0, tokenizer=byte_tokenizer(with_bos=True))
    result = generate(with_bos, "", max_new_tokens=5, temperature=0, stop_on_eos=False)
    assert result.prompt_ids == [with_bos.tokenizer.bos_id]
    assert len(result.token_ids) == 5
    with pytest.raises(GenerationError, match="prompt is empty and the tokenizer has no BOS token"):
        generate(toy_model(seed=0), "", max_new_tokens=5)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(max_new_tokens=-1), "max_new_tokens=-1 is invalid"),
    (dict(num_beams=0), "num_beams=0 is invalid"),
    (dict(temperature=-1), "temperature=-1 is invalid"),
    (dict(top_p=2), "top_p=2 is invalid"),
    (dict(repetition_penalty=-1.0), "repetition_penalty=-1.0 is invalid"),
])
def test_bad_options_raise_generation_error(model, kwargs, fragment):
    with pytest.raises(GenerationError) as info:
        generate(model, "Hello", **kwargs)
    assert fragment in str(info.value)
    with pytest.raises(GenerationError):
        stream(model, "Hello", **kwargs)  # raised at the call, not at the first next()


def test_stream_rejects_unknown_options(model):
    with pytest.raises(GenerationError, match=r"unknown generation option 'top_q'; known: .*; did you mean 'top_p'\?$"):
        stream(model, "Hello", top_q=0.5)
    with pytest.raises(GenerationError, match=r"unknown generation option 'top_q'; known: .*; did you mean 'top_p'\?$"):
        generate(model, "Hello", top_q=0.5)


def test_out_of_vocab_prompt_ids_are_rejected(model):
    with pytest.raises(GenerationError, match="token id 999 is outside this model's vocabulary 0..256"):
        generate(model, [1, 999], max_new_tokens=2)
