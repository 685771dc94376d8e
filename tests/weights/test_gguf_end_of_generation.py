"""A GGUF's end-of-generation tokens stop generation as they stop llama.cpp.

llama.cpp's rule (``llama_vocab_is_eog``, used by every llama.cpp generation loop): generation
ends at the first token that is the EOS (``tokenizer.ggml.eos_token_id``), the end-of-turn
(``tokenizer.ggml.eot_token_id``, Llama 3's ``<|eot_id|>``) or the end-of-message
(``tokenizer.ggml.eom_token_id``, ``<|eom_id|>``) token. The files are written by the ``gguf``
package; the reference is transformers' greedy ``generate`` on the same file (its GGUF loader),
told to stop on those ids, which is that rule. (llama.cpp also ends on tokens it knows by their
text, ``<|im_end|>``, ``<end_of_turn>``...; lucidlm does too, tested in
``tests/generation/test_sampling_edges.py``.)
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Optional

import gguf
import pytest
from test_gguf import VOCAB, tiny_weights, to_gguf_layout, write_llama_gguf

import lucidlm
from lucidlm.errors import TokenizerError
from lucidlm.generation import generate
from lucidlm.tokenizers.base import load_tokenizer
from lucidlm.weights.checkpoint import save_model

PROMPT = [72, 101, 108, 108, 111]  # greedy from here does not reach the EOS (id 0) for 16 tokens
NEW = 16


def write_gguf(path: Path, eot: Optional[int] = None, eom: Optional[int] = None) -> Path:
    """The tiny 2-layer LLaMA of test_gguf.py (EOS id 0) with the given end-of-turn /
    end-of-message ids."""
    def extra(writer: gguf.GGUFWriter) -> None:
        if eot is not None:
            writer.add_eot_token_id(eot)
        if eom is not None:
            writer.add_eom_token_id(eom)

    tensors = {name: to_gguf_layout(name, weight) for name, weight in tiny_weights(2).items()}
    return write_llama_gguf(path, tensors, 2, extra=extra)


def reference_greedy(path: Path, prompt: list[int], max_new: int, end_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of the same file, ending with the first of ``end_ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    os.environ["HF_HUB_OFFLINE"] = "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=end_ids,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def free_run(tmp_path_factory) -> list[int]:
    """The greedy continuation of PROMPT with no end token reached (EOS 0 never comes up)."""
    path = write_gguf(tmp_path_factory.mktemp("eog") / "plain.gguf")
    tokens = generate(lucidlm.load(path), PROMPT, temperature=0, max_new_tokens=NEW).token_ids
    assert len(tokens) == NEW and 0 not in tokens and len(set(tokens[3:7])) == 4  # distinct, so a stop is visible
    assert tokens == reference_greedy(path, PROMPT, NEW, [0])  # same model, same greedy tokens
    return tokens


@pytest.mark.parametrize("key", ["eot", "eom"])
def test_generation_stops_where_llama_cpp_does(tmp_path, free_run, key):
    end = free_run[5]  # a token greedy decoding reaches: declare it the end of the turn (message)
    path = write_gguf(tmp_path / f"{key}.gguf", **{key: end})
    expected = reference_greedy(path, PROMPT, NEW, [0, end])
    assert expected == free_run[:6]  # the rule stops at it
    model = lucidlm.load(path)
    assert model.tokenizer.eos_ids == [0, end]  # EOS first
    result = generate(model, PROMPT, temperature=0, max_new_tokens=NEW)
    assert result.token_ids == expected and result.finish_reason == "eos"
    stream = model.stream(PROMPT, temperature=0, max_new_tokens=NEW)
    list(stream)
    assert stream.result.token_ids == expected  # streaming stops there too


def test_eos_eot_and_eom_are_distinct_ids_eos_first(tmp_path, free_run):
    path = write_gguf(tmp_path / "both.gguf", eot=free_run[6], eom=free_run[4])
    assert lucidlm.load(path).tokenizer.eos_ids == [0, free_run[6], free_run[4]]
    assert reference_greedy(path, PROMPT, NEW, [0, free_run[6], free_run[4]]) == free_run[:5]  # the eom comes first
    assert generate(lucidlm.load(path), PROMPT, temperature=0, max_new_tokens=NEW).token_ids == free_run[:5]
    same = write_gguf(tmp_path / "same.gguf", eot=0)  # an eot that is the EOS is listed once
    assert lucidlm.load(same).tokenizer.eos_ids == [0]


def test_end_ids_survive_saving_the_model(tmp_path, free_run):
    model = lucidlm.load(write_gguf(tmp_path / "eot.gguf", eot=free_run[5]))
    model.tokenizer.save(tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path / "tokenizer.json").eos_ids == [0, free_run[5]]
    save_model(model, tmp_path / "saved")
    reloaded = lucidlm.load(tmp_path / "saved")
    assert reloaded.tokenizer.eos_ids == [0, free_run[5]]
    assert generate(reloaded, PROMPT, temperature=0, max_new_tokens=NEW).token_ids == free_run[:6]


def test_an_end_id_outside_the_vocabulary_is_named(tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", eot=VOCAB + 5)
    with pytest.raises(TokenizerError) as caught:
        lucidlm.load(path)
    message = str(caught.value)
    assert "tokenizer.ggml.eot_token_id=266" in message and f"vocabulary of {VOCAB} tokens" in message
    assert "\n" not in message


def test_a_saved_tokenizer_with_damaged_end_ids_is_refused(tmp_path, free_run):
    model = lucidlm.load(write_gguf(tmp_path / "eot.gguf", eot=free_run[5]))
    model.tokenizer.save(tmp_path / "tokenizer.json")
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    for bad, expected in ((["x"], "field 'eos_ids' is ['x']; expected a list of ints"),
                          ([0, 999], "eos_ids hold 999, outside its vocabulary of 261 tokens")):
        data["eos_ids"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(data))
        with pytest.raises(TokenizerError) as caught:
            load_tokenizer(tmp_path / "bad.json")
        assert expected in str(caught.value) and "\n" not in str(caught.value)
