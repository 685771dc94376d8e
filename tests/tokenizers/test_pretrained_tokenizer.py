"""SmolLM2's tokenizer built from its GGUF metadata gives the same ids as transformers'
tokenizer for the same file, on text chosen to stress byte-level BPE; and it survives
saving, loading and export to a plain tokenizer.json."""

from __future__ import annotations


import pytest

from lucidlm.pretrained import find_gguf
from lucidlm.tokenizers import HFTokenizer, load_tokenizer
from lucidlm.weights.gguf import open_gguf, read_metadata, tokenizer_from_metadata

TEXTS = [
    "",
    "Hello world",
    " Hello  world ",
    "1234567 and 3.14159, 1,000,000",
    "def f(x):\n    if x:\n\t\treturn x ** 2  # square\n    return None\n",
    "   \n\n\n   trailing spaces   \t\t",
    "naïve café, Größe, Ελληνικά, русский",
    "日本語のテキスト、中文文本，한국어",
    "emoji 🤗🚀👩‍👩‍👧‍👦 and ZWJ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "don't won't I'm you're we've they'll he'd",
    "tabs\tand\r\nwindows line endings\r\n",
    "a" * 300,
]


@pytest.fixture(scope="module")
def gguf_path():
    return find_gguf("smollm2-135m")


@pytest.fixture(scope="module")
def ours(gguf_path) -> HFTokenizer:
    return tokenizer_from_metadata(read_metadata(open_gguf(gguf_path)), str(gguf_path))


@pytest.fixture(scope="module")
def reference(hf_smollm2):
    return hf_smollm2[1]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_match_transformers(ours, reference, text):
    expected = reference(text, add_special_tokens=True)["input_ids"]
    assert ours.encode(text) == expected
    assert ours.decode(expected) == reference.decode(expected)
    assert ours.decode(ours.encode(text)) == text  # byte-level BPE loses nothing
    # <|im_start|>, <|endoftext|>, <repo_name> ... left out, as transformers does
    assert ours.decode(expected, skip_special_tokens=True) == reference.decode(expected, skip_special_tokens=True)


def test_special_tokens_match_transformers(ours, reference):
    assert ours.vocab_size == len(reference) == 49152
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == \
        (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id) == (1, 2, 2)
    assert ours.add_bos is False and ours.encode("Hi")[0] != ours.bos_id  # the GGUF says add_bos_token=False
    assert ours.special_tokens["<|im_start|>"] == reference.convert_tokens_to_ids("<|im_start|>")
    assert set(reference.all_special_tokens) <= set(ours.special_tokens)
    assert ours.chat_template == reference.chat_template and "<|im_start|>" in ours.chat_template


def test_special_strings_as_plain_text(ours, reference):
    text = "say <|im_end|> literally"
    expected = reference(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ours.encode(text, allowed_special=False) == expected
    assert 2 not in expected and len(expected) > 4


def test_decode_bytes_and_pieces(ours):
    ids = ours.encode("€")  # three UTF-8 bytes
    raw = b"".join(ours.decode_bytes([i]) for i in ids)
    assert raw == "€".encode()
    assert ours.decode_bytes(ours.encode(" Hello")) == b" Hello"
    assert ours.id_to_token(ours.encode(" Hello")[0]) == " Hello"
    assert ours.id_to_token(1) == "<|im_start|>"


def test_save_load_and_plain_tokenizer_json(ours, tmp_path):
    ours.save(tmp_path / "tok.json")
    again = load_tokenizer(tmp_path / "tok.json")
    assert isinstance(again, HFTokenizer)
    assert (again.bos_id, again.eos_id, again.pad_id, again.chat_template) == \
        (ours.bos_id, ours.eos_id, ours.pad_id, ours.chat_template)
    ours.save_hf(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", '
        '"add_bos_token": false, "chat_template": "{{ x }}"}')
    plain = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert (plain.eos_id, plain.chat_template) == (2, "{{ x }}")
    for text in TEXTS:
        assert again.encode(text) == plain.encode(text) == ours.encode(text)


def test_tokenizer_json_whose_post_processor_adds_bos(tmp_path):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    backend = Tokenizer(BPE(vocab={"<s>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4}, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.add_bos and tok.bos_id == 0
    assert tok.encode("ab a") == backend.encode("ab a").ids == [0, 3, 4, 1]
    assert tok.decode([0, 3, 4, 1]) == "<s>ab a"
