"""Gemma 3's sentencepiece tokenizer, rebuilt from the GGUF's metadata, gives transformers'
ids for the same file (and decodes them back to the same text)."""

from __future__ import annotations

import pytest

from lucidlm.tokenizers import HFTokenizer, load_tokenizer
from lucidlm.weights.gguf import open_gguf, read_metadata, tokenizer_from_metadata

TEXTS = [
    "Hello world",
    "  two  spaces\n\nnew lines\t tab   \n",
    "naïve café, Größe, Ελληνικά, русский — 日本語のテキスト、한국어",
    "emoji 🤗🚀👩‍👩‍👧‍👦 and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001F9EC",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    if x:\n\t\treturn x ** 2  # square\n    return None\n",
    "1234567 and 3.14159, 1,000,000",
    "x\u0000y\u200b z",
    "a" * 300,
]


@pytest.fixture(scope="module")
def ours(gemma3_gguf) -> HFTokenizer:
    return tokenizer_from_metadata(read_metadata(open_gguf(gemma3_gguf)), str(gemma3_gguf))


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_and_text_match_transformers(ours, hf_gemma3_tokenizer, text):
    expected = hf_gemma3_tokenizer(text, add_special_tokens=True)["input_ids"]
    ids = ours.encode(text)
    assert ids == expected
    assert ids[0] == ours.bos_id == 2  # Gemma adds <bos>
    assert ours.decode(ids[1:]) == hf_gemma3_tokenizer.decode(expected[1:]) == text


def test_roles_and_round_trip(ours, tmp_path):
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert ours.vocab_size == 262144
    ours.save(tmp_path / "tok.json")
    again = load_tokenizer(tmp_path / "tok.json")
    assert again.encode(TEXTS[2]) == ours.encode(TEXTS[2])
