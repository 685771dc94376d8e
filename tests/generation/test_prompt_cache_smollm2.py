"""Prompt caching on the embedded SmolLM2 as ``lucidlm.load()`` gives it (int4 kernels): a
five-turn chat answers the same with the kept cache as with a fresh prefill of the whole
conversation every turn, and the first new token's logits agree closely."""

from __future__ import annotations

import pytest
import torch
from generation_toys import first_token_logits, one_torch_thread  # noqa: F401 (autouse fixture)

from lucidlm.chat import Conversation, encode_chat

pytestmark = pytest.mark.slow

QUESTIONS = ["Hi! Who are you?", "What is the capital of France?", "And of Germany?", "Name three colours.",
             "Thanks!"]
NEW = 24
# The prompt's new tokens run in a second, shorter pass, whose matmuls block the rows otherwise:
# measured 0.011 at most over these turns (logits of size ~20); a near-tie is not expected here.
ATOL = 0.05


def _answers(model, reuse):
    convo, turns = Conversation(), []
    for question in QUESTIONS:
        convo.add_user(question)
        "".join(convo.reply(model, temperature=0, max_new_tokens=NEW, reuse_cache=reuse))
        turns.append(convo.last_result)
    return convo, turns


def test_a_smollm2_chat_is_the_same_with_the_kept_cache(smollm2_default):
    model = smollm2_default
    try:
        convo, fresh = _answers(model, reuse=False)
        _, reused = _answers(model, reuse=True)
        assert [r.token_ids for r in reused] == [r.token_ids for r in fresh]
        assert all(r.cached_tokens > len(prev.prompt_ids) for prev, r in zip(reused, reused[1:]))
        for turn in range(1, len(QUESTIONS)):
            kept_prompt = encode_chat(model.tokenizer, convo.messages[:2 * turn - 1])
            next_prompt = encode_chat(model.tokenizer, convo.messages[:2 * turn + 1])
            logits, expected, cached = first_token_logits(model, kept_prompt, fresh[turn - 1].token_ids, next_prompt)
            assert cached == reused[turn].cached_tokens
            torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
            assert logits.argmax() == expected.argmax()
    finally:
        model.clear_kv_cache()  # a session fixture: leave nothing kept
