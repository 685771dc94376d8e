"""The embedded SmolLM2-135M-Instruct, loaded by lucidlm (GGUF -> dequantize -> cache), gives
the logits transformers gives for the same GGUF file, and answers a chat prompt sensibly."""

from __future__ import annotations


import pytest
import torch

import lucidlm

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    # long enough (> 100 tokens) that a RoPE layout error could not hide
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning a stranger arrived "
    "with a pocket watch that ran backwards, and asked the clockmaker to make it run forwards "
    "again. The clockmaker turned the watch over in his hands, opened its case, and saw",
    "日本の首都は東京です。🇯🇵 1234567",
]


@pytest.fixture(scope="module")
def ours(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def reference(hf_smollm2):
    return hf_smollm2


def test_config_is_the_smollm2_preset(ours):
    expected = lucidlm.config.preset("smollm2-135m")
    got = ours.config
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_mlp",
                  "max_seq_len", "rope_theta", "rope_variant", "mlp", "norm", "tie_embeddings"):
        assert getattr(got, field) == getattr(expected, field), field
    assert ours.num_parameters() == 134_515_008


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_last_position_logits_match_transformers(ours, reference, prompt):
    hf_model, hf_tokenizer = reference
    ids = ours.tokenizer.encode(prompt)
    assert ids == hf_tokenizer(prompt)["input_ids"]
    batch = torch.tensor([ids])
    with torch.no_grad():
        expected = hf_model(batch).logits[0, -1]
        got = ours(batch, last_token_only=True)[0, -1]
    assert (got - expected).abs().max().item() < 1e-3
    assert got.argmax() == expected.argmax()


def test_greedy_chat_answer(ours):
    tok = ours.tokenizer
    ids = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(ours(torch.tensor([ids]), last_token_only=True)[0, -1].argmax()))
    assert "Paris" in tok.decode(ids[-8:])
