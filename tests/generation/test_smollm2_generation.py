"""The embedded SmolLM2-135M-Instruct: greedy generation and chat templates match
transformers loading the same GGUF (dequantized to fp32)."""

from __future__ import annotations


import pytest
import torch

from generation_toys import one_torch_thread  # noqa: F401 (autouse fixture)

from lucidlm.chat import encode_chat, render_chat_for
from lucidlm.generation import generate, generate_batch, stream

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
TIE_MARGIN = 1e-4  # top-2 logit gap below which fp32 rounding may legitimately pick either
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "List of planets: Mercury, Venus,",
]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Who wrote Romeo and Juliet?"]


@pytest.fixture(scope="module")
def ours(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def hf(hf_smollm2):
    return hf_smollm2


def hf_greedy(hf_model, prompt_ids):
    """HF's greedy tokens and, per step, the gap between its two best logits."""
    out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=2, pad_token_id=2, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    margins = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


def compare_greedy(ours, hf_model, prompts_ids):
    """Identical up to the first near-tie in HF's logits (if any); returns how many
    sequences diverged at a near-tie."""
    tie_divergences = 0
    for prompt_ids in prompts_ids:
        expected, margins = hf_greedy(hf_model, prompt_ids)
        got = generate(ours, prompt_ids, max_new_tokens=NEW_TOKENS, temperature=0).token_ids
        first_diff = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if first_diff is None:
            assert got == expected
            continue
        assert margins[first_diff] < TIE_MARGIN, (
            f"diverged at step {first_diff} where HF's top-2 gap is {margins[first_diff]:.2e}: "
            f"ours {got[first_diff]} vs HF {expected[first_diff]}")
        tie_divergences += 1
    return tie_divergences


def test_greedy_continuations_match_hf(ours, hf):
    hf_model, hf_tok = hf
    prompts_ids = [ours.tokenizer.encode(p) for p in PROMPTS]
    assert prompts_ids == [hf_tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert compare_greedy(ours, hf_model, prompts_ids) <= 1  # near-ties are rare


def test_chat_greedy_answers_match_hf(ours, hf):
    hf_model, hf_tok = hf
    prompts_ids = []
    for question in CHAT_PROMPTS:
        messages = [{"role": "user", "content": question}]
        ids = encode_chat(ours.tokenizer, messages)
        assert ids == list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
        prompts_ids.append(ids)
    assert compare_greedy(ours, hf_model, prompts_ids) <= 1


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Arr!"}, {"role": "user", "content": "Où est Paris? 🗼"}],
])
def test_chat_template_renders_like_transformers(ours, hf, messages):
    _, hf_tok = hf
    for add_generation_prompt in (True, False):
        expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert render_chat_for(ours.tokenizer, messages, add_generation_prompt) == expected


def test_chat_knows_the_capital_of_france(ours):
    result = generate(ours, "What is the capital of France?", chat=True, temperature=0, max_new_tokens=30)
    assert "Paris" in result.text
    assert result.finish_reason in ("eos", "length")


def test_streaming_and_batching_on_the_real_model(ours):
    kwargs = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=4)
    prompt = "Emoji story: 🐉🔥"
    pieces = list(stream(ours, prompt, **kwargs))
    assert "".join(pieces) == generate(ours, prompt, **kwargs).text
    prompts = PROMPTS[:3]  # different lengths: left padding
    batched = generate_batch(ours, prompts, max_new_tokens=12, temperature=0)
    singles = [generate(ours, p, max_new_tokens=12, temperature=0) for p in prompts]
    assert [r.token_ids for r in batched] == [r.token_ids for r in singles]
