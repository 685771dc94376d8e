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
    assert ours.decode(ids, skip_special_tokens=True) == hf_gemma3_tokenizer.decode(expected, skip_special_tokens=True)


def test_roles_and_round_trip(ours, tmp_path):
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert ours.vocab_size == 262144
    ours.save(tmp_path / "tok.json")
    again = load_tokenizer(tmp_path / "tok.json")
    assert again.encode(TEXTS[2]) == ours.encode(TEXTS[2])


def test_not_special_added_tokens_stay_whole_when_specials_are_not_allowed(ours, hf_gemma3_tokenizer):
    """Gemma's 135 added tokens that are not special (``<h1>``, ``[multimodal]``, runs of new
    lines) are how the model writes that text: ``allowed_special=False`` (a training corpus)
    only turns the special ones into plain text, as transformers' split_special_tokens does."""
    for text in ["<h1>Title</h1>\n\n\n[multimodal]", "<start_of_turn>user<h1> <eos>x"]:
        expected = hf_gemma3_tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        assert ours.encode(text, allowed_special=False) == expected
        ids = hf_gemma3_tokenizer(text, add_special_tokens=True)["input_ids"]  # <bos>, <start_of_turn>, <eos> whole
        # skipped: the special ones; kept: <h1>, [multimodal], the runs of new lines
        assert ours.decode(ids, skip_special_tokens=True) == hf_gemma3_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.encode(text, allowed_special=False) != ours.encode(text)  # <start_of_turn>, <eos>: plain here


# A Gemma-3-it-style template: it writes <bos> itself (and reads the pad and unk tokens).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content | trim }}"
                 "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
                 "{{ pad_token }}{{ unk_token }}")


def test_chat_prompt_ids_equal_apply_chat_template(ours, hf_gemma3_tokenizer):
    """The tokenizer adds <bos> and the template writes it: one <bos>, as in transformers (it
    encodes the rendered chat with add_special_tokens=False); pad and unk reach the template."""
    from lucidlm.chat import encode_chat

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Name a colour."}]
    theirs = hf_gemma3_tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=True,
                                                     add_generation_prompt=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    ours.chat_template = CHAT_TEMPLATE
    try:
        ids = encode_chat(ours, messages)
    finally:
        ours.chat_template = None
    assert ids == theirs
    assert ids.count(ours.bos_id) == 1 and ids[-2:] == [ours.pad_id, ours.special_tokens["<unk>"]]


def test_prompt_completion_example_has_one_bos(ours, hf_gemma3_tokenizer, tmp_path):
    """A completion continues its prompt: no <bos> between them (TRL's prompt-completion
    encoding: the prompt with special tokens, the completion without, then EOS)."""
    from lucidlm.training.examples import encode_example

    record = {"prompt": "Question: 2+2?", "completion": " Answer: 4"}
    ids, prompt_length = encode_example(tmp_path / "x.jsonl", 1, record, "prompt_completion", ours)
    prompt = hf_gemma3_tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
    completion = hf_gemma3_tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
    assert ids == prompt + completion + [hf_gemma3_tokenizer.eos_token_id]
    assert prompt_length == len(prompt)
