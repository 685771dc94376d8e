"""The seeds' generation options: ``min_new_tokens`` (seed 004's min_length) against
transformers' generate, and ``context_overflow="crop"`` (seed 003) against seed 003's own
loop - predict from the last max_seq_len tokens, no cache - for RoPE, learned and
sinusoidal positions."""

from __future__ import annotations

import pytest
import torch
from generation_toys import byte_tokenizer, one_torch_thread, toy_model  # noqa: F401 (autouse fixture)

import lucidlm
from lucidlm.errors import GenerationError
from lucidlm.generation import generate, generate_batch, stream

EOS = 256  # byte_tokenizer's <|endoftext|>


def hf_llama_with_early_eos(tmp_path):
    """A tiny random transformers LLaMA whose EOS row copies the unembedding row of the token
    greedy decoding picks second (scaled up a little), so it wants to end after one token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(40.0)
        prompt = torch.tensor([[72, 105, 33]])
        second = hf.generate(prompt, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)[0, -1]
        hf.lm_head.weight[EOS] = hf.lm_head.weight[second] * 1.05
    hf.save_pretrained(tmp_path)
    ours = lucidlm.load(tmp_path)
    ours.tokenizer = byte_tokenizer()
    return hf, ours, prompt


def test_min_new_tokens_matches_transformers(tmp_path):
    hf, ours, prompt = hf_llama_with_early_eos(tmp_path)
    plain = generate(ours, prompt[0].tolist(), max_new_tokens=12, temperature=0)
    assert plain.finish_reason == "eos" and len(plain.token_ids) <= 2  # EOS comes at once
    for min_new in (1, 5, 12):
        with torch.no_grad():
            expected = hf.generate(prompt, max_new_tokens=12, min_new_tokens=min_new, do_sample=False,
                                   eos_token_id=EOS, pad_token_id=0)[0, prompt.shape[1]:].tolist()
        result = generate(ours, prompt[0].tolist(), max_new_tokens=12, temperature=0, min_new_tokens=min_new)
        assert result.token_ids == expected
        assert EOS not in result.token_ids[:min_new]
        batch = generate_batch(ours, [prompt[0].tolist()], max_new_tokens=12, temperature=0, min_new_tokens=min_new)
        assert batch[0].token_ids == expected


def seed003_generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Seed 003 / nanoGPT: crop to the last block_size tokens, run the model, take the argmax."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = torch.tensor([ids[-model.config.max_seq_len:]])
            ids.append(int(model(window)[0, -1].argmax()))
    return ids


@pytest.mark.parametrize("positions", ["rope", "learned", "sinusoidal"])
def test_crop_generates_past_the_context_like_seed003(positions):
    model = toy_model(seed=3, max_seq_len=16, positions=positions)
    prompt = list(b"To be, or not")  # 13 tokens: 3 fit before the window starts to slide
    stopped = generate(model, prompt, max_new_tokens=30, temperature=0, stop_on_eos=False)
    assert len(stopped.token_ids) == 3 and stopped.finish_reason == "length"
    cropped = generate(model, prompt, max_new_tokens=30, temperature=0, stop_on_eos=False, context_overflow="crop")
    expected = seed003_generate(model, prompt, 30)[len(prompt):]
    assert cropped.token_ids == expected
    assert cropped.token_ids[:3] == stopped.token_ids
    streamed = "".join(stream(model, prompt, max_new_tokens=30, temperature=0, stop_on_eos=False,
                              context_overflow="crop"))
    assert streamed == cropped.text


def test_crop_takes_a_prompt_longer_than_the_context():
    model = toy_model(seed=4, max_seq_len=16)
    prompt = list(b"a prompt of more than sixteen bytes")
    with pytest.raises(GenerationError, match="longer than the model's context"):
        generate(model, prompt, max_new_tokens=4, temperature=0)
    result = generate(model, prompt, max_new_tokens=6, temperature=0, stop_on_eos=False, context_overflow="crop")
    assert result.token_ids == seed003_generate(model, prompt, 6)[len(prompt):]
    assert result.prompt_ids == prompt


@pytest.mark.parametrize("options,message", [
    (dict(context_overflow="wrap"), "context_overflow='wrap' is unknown; use one of stop, crop"),
    (dict(context_overflow="crop", num_beams=2), "not beam search"),
    (dict(min_new_tokens=-1), "min_new_tokens=-1 is invalid"),
])
def test_bad_options_are_generation_errors(options, message):
    model = toy_model(seed=5, max_seq_len=16)
    with pytest.raises(GenerationError, match=message):
        generate(model, [1, 2, 3], max_new_tokens=4, **options)
