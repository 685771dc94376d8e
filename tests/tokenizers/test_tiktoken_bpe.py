"""The tiktoken-format BPE (Llama 3's ``tokenizer.model``: ranks of byte strings) against
tiktoken itself, here on GPT-2's ranks written in that format: long single chunks (a base64
blob, DNA, a digit run) take the O(n log n) heap merge and give tiktoken's ids, and special
tokens allowed one by one are found even inside a longer special that is not allowed."""

from __future__ import annotations

import base64
import random

import pytest

from lucidlm.tokenizers import tiktoken_bpe
from lucidlm.tokenizers.bpe import BPETokenizer
from lucidlm.tokenizers.gpt2_files import read_gpt2_files
from lucidlm.tokenizers.tiktoken_bpe import TiktokenTokenizer
from test_bpe import gpt2_tiktoken  # noqa: E402  (tests/tokenizers is on sys.path)
from tokenizer_assets import shared_file  # noqa: E402

tiktoken = pytest.importorskip("tiktoken")


@pytest.fixture(scope="module")
def tok_and_reference(tmp_path_factory):
    reference = gpt2_tiktoken()
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    with path.open("wb") as f:  # tiktoken's file format: base64 bytes, a space, the rank
        for token, rank in sorted(reference._mergeable_ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    ranks = tiktoken_bpe.read_tiktoken_file(path)
    return TiktokenTokenizer(ranks, [], reference._pat_str), reference


def long_chunks() -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choice("abcdefgh") for _ in range(3000)),
            "".join(rng.choice("ACGT") for _ in range(5000)),
            base64.b64encode(rng.randbytes(3000)).decode("ascii"),
            "7" * 1000 + "".join(rng.choice("0123456789") for _ in range(2000)),
            "é" * 400 + "日本" * 150]


@pytest.mark.parametrize("index", range(5))
def test_long_chunks_give_tiktokens_ids(tok_and_reference, index):
    tok, reference = tok_and_reference
    text = long_chunks()[index]
    ids = tok.encode(text)
    assert ids == reference.encode_ordinary(text)
    assert tok.decode(ids) == text


def test_heap_merge_equals_the_simple_loop(tok_and_reference, monkeypatch):
    tok, _ = tok_and_reference
    text = long_chunks()[0][:1200] + long_chunks()[2][:1200]
    fast = tok.encode(text)
    monkeypatch.setattr(tiktoken_bpe, "_LONG_CHUNK", 10**9)  # force the rescanning loop
    assert tok.encode(text) == fast


def test_an_allowed_special_inside_a_longer_disallowed_one():
    """With ``<|a|>`` allowed and ``<|a|>2`` not, ``<|a|>2`` in the text is the special ``<|a|>``
    then "2": what tiktoken gives when the allowed names are its only specials. (tiktoken's own
    answer with both defined depends on its hash order: its regex tries them in that order.)
    A regex over every special, longest first, matched the disallowed name and hid the other."""
    merges, _, order = read_gpt2_files(shared_file("gpt2", "encoder.json"), shared_file("gpt2", "vocab.bpe"))
    names = {"<|endoftext|>": 50256, "<|a|>": 50257, "<|a|>2": 50258}
    ours = BPETokenizer(merges, names, byte_order=order)
    base = gpt2_tiktoken()
    for allowed in ({"<|a|>"}, {"<|a|>2"}, {"<|a|>", "<|endoftext|>"}):
        reference = tiktoken.Encoding(name="allowed", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
                                      special_tokens={name: names[name] for name in allowed})
        for text in ["hi <|a|>2", "<|a|>2<|a|><|a|>22 <|endoftext|>"]:
            expected = reference.encode(text, allowed_special="all")
            assert ours.encode(text, allowed_special=allowed) == expected
    assert ours.encode("hi <|a|>2") == base.encode_ordinary("hi ") + [50258]  # all allowed: the longest name wins
