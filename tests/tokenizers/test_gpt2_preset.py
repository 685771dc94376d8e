"""The gpt2 preset carries GPT-2's own BPE (the packaged MIT files), so an untrained GPT-2
encodes, generates and decodes real GPT-2 ids; checked against transformers' GPT-2 tokenizer
built from the shared copy of the same files."""

from __future__ import annotations

import json

import pytest
from tokenizer_assets import shared_file

import lucidlm
from lucidlm.tokenizers.presets import DATA

TEXTS = ["Hello world", " naïve café 日本 👋🏽", "def f(x):\n    return x  # ok\n", "<|endoftext|>The end."]


@pytest.fixture(scope="module")
def tiny_gpt2():
    return lucidlm.load("gpt2", random_init=True, n_layers=1, d_model=64, n_heads=4)


def test_packaged_files_are_gpt2s():
    for name in ("encoder.json", "vocab.bpe"):
        assert (DATA / "gpt2" / name).read_bytes() == shared_file("gpt2", name).read_bytes()
    assert "MIT License" in (DATA / "gpt2" / "LICENSE").read_text()


def test_gpt2_preset_tokenizer_matches_transformers(tiny_gpt2):
    from transformers import GPT2TokenizerFast

    vocab = json.loads(shared_file("gpt2", "encoder.json").read_text(encoding="utf-8"))
    lines = shared_file("gpt2", "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
    reference = GPT2TokenizerFast(vocab=vocab, merges=[tuple(line.split(" ")) for line in lines if line.strip()])
    tok = tiny_gpt2.tokenizer
    assert tok is not None and tok.vocab_size == 50257 == tiny_gpt2.config.vocab_size
    assert tok.eos_id == tok.bos_id == 50256
    for text in TEXTS:
        assert tok.encode(text) == reference(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_untrained_gpt2_generates_text(tiny_gpt2):
    result = tiny_gpt2.generate("Hello", max_new_tokens=5, temperature=0, stop_on_eos=False)
    assert len(result.token_ids) == 5
    assert result.text == tiny_gpt2.tokenizer.decode(tiny_gpt2.tokenizer.encode("Hello") + result.token_ids)[5:]


def test_a_resized_vocabulary_gets_no_gpt2_tokenizer():
    model = lucidlm.load("gpt2", random_init=True, n_layers=1, d_model=64, n_heads=4, vocab_size=1000)
    assert model.tokenizer is None
