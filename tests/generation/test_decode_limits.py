"""The KV cache's size at the public entry points: a ``DecodeSession`` opened larger than the
context (or smaller than its prompt), and ``beam_search`` asked for more tokens than the context
holds. Each used to end in a raw torch IndexError deep in a step; now the session refuses with
a GenerationError naming the sizes, and ``beam_search`` stops at the context as ``generate``
does (what transformers gives with ``max_length`` equal to the context)."""

from __future__ import annotations

import pytest
import torch
from generation_toys import one_torch_thread, sharpened_llama_pair, toy_model  # noqa: F401 (autouse fixture)

from lucidlm.errors import GenerationError
from lucidlm.generation.beam_search import beam_search
from lucidlm.generation.decode import DecodeSession


def test_a_session_larger_than_the_context_is_refused_by_name():
    model = toy_model(max_seq_len=16)
    with pytest.raises(GenerationError, match=r"capacity=40 is more than the model's context of 16 tokens"):
        DecodeSession(model, [[5, 6, 7]], capacity=40)
    with pytest.raises(GenerationError, match=r"capacity=2 cannot hold the 3-token prompt"):
        DecodeSession(model, [[5, 6, 7]], capacity=2)
    with DecodeSession(model, [[5, 6, 7]], capacity=16) as session:  # exactly the context is fine
        next_ids = session.prefill().argmax(-1)
        for _ in range(13):
            next_ids = session.step(next_ids).argmax(-1)
        with pytest.raises(GenerationError, match="KV cache is full"):
            session.step(next_ids)


def test_beam_search_stops_at_the_context_like_transformers(tmp_path):
    hf, ours = sharpened_llama_pair(tmp_path)  # context 128
    prompt = [(7 * i + 3) % 250 for i in range(120)]
    expected = hf.generate(torch.tensor([prompt]), do_sample=False, num_beams=2, max_length=128,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ids, _ = beam_search(ours, prompt, num_beams=2, max_new_tokens=30)
    assert len(expected) == 8 and ids == expected
    with pytest.raises(GenerationError, match="longer than the model's context of 128"):
        beam_search(ours, prompt * 2, num_beams=2, max_new_tokens=4)
