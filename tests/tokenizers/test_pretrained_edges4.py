"""Pretrained tokenizers' resources and messages (round 4): ``allowed_special=False`` uses the
backend's own switch (transformers' ``split_special_tokens=True``) instead of copying Gemma 3's
262k-token backend, strict subsets keep a bounded number of copies, and a wrong special token
name gets a one-screen message, not a list of Gemma's 6,249 names."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers import models

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers import CharTokenizer, HFTokenizer
from lucidlm.tokenizers.pretrained import SUBSET_BACKENDS_KEPT
from lucidlm.weights.gguf import open_gguf, read_metadata, tokenizer_from_metadata

GEMMA_TEXTS = [
    "<start_of_turn>user\nhi<end_of_turn> <bos>x<eos> <h1>y</h1>\n\n\n",
    "",
    "a<unused5>b <mask>",
    "<pad><unk>[multimodal] </s> <unused6241><start_of_image>",
    " <end_of_turn>\n\n<start_of_turn>model\n",
]


@pytest.fixture(scope="module")
def gemma(gemma3_gguf) -> HFTokenizer:
    return tokenizer_from_metadata(read_metadata(open_gguf(gemma3_gguf)), str(gemma3_gguf))


def test_gemma_plain_text_uses_the_backend_switch_not_a_copy(gemma, hf_gemma3_tokenizer):
    for text in GEMMA_TEXTS:
        expected = hf_gemma3_tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        assert gemma.encode(text, allowed_special=False) == expected
        assert gemma._encode_ordinary(text, 0) == expected[1:]  # (the same, less the BOS)
    assert gemma._subsets == {}  # no 80 MB copy of the backend was built or kept
    assert gemma.backend.encode_special_tokens is False  # switched back after each call
    for text in GEMMA_TEXTS:  # so special tokens are recognised again
        assert gemma.encode(text) == hf_gemma3_tokenizer(text, add_special_tokens=True)["input_ids"]


class _FailingEncode:
    """A backend whose encode fails, to check that the switch is set back even then."""

    def __init__(self, inner):
        self.__dict__["inner"] = inner

    def encode(self, *args, **kwargs):
        raise RuntimeError("encode failed")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)


# A small tokenizer: one token per character, and five added special tokens.
SPECIALS = ["<a>", "<b>", "<c>", "<d>", "<e>"]
CHARS = sorted(set("<>abcdexyz |"))


def _backend(specials, unflagged=()):
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    backend.add_tokens([AddedToken(s, special=False, normalized=False) for s in unflagged])
    return backend


def test_restores_the_switch_when_encode_fails():
    tok = HFTokenizer(_backend(SPECIALS))
    inner = tok._backend
    tok._backend = _FailingEncode(inner)
    with pytest.raises(RuntimeError, match="encode failed"):
        tok.encode("x<a>", allowed_special=False)
    assert inner.encode_special_tokens is False


def test_strict_subsets_keep_a_bounded_number_of_backends():
    tok = HFTokenizer(_backend(SPECIALS))
    text = "x<a>y<b>z<c> <d>|<e>"
    for name in SPECIALS:  # each one alone: what a backend holding only it gives
        reference = _backend([name]).encode(text, add_special_tokens=False).ids
        assert tok.encode(text, allowed_special={name}) == reference
    assert SUBSET_BACKENDS_KEPT == 2 and list(tok._subsets) == [frozenset({"<d>"}), frozenset({"<e>"})]
    assert tok.encode(text, allowed_special={"<d>"}) == _backend(["<d>"]).encode(text, add_special_tokens=False).ids
    assert list(tok._subsets) == [frozenset({"<e>"}), frozenset({"<d>"})]  # <d> is now the most recent


def test_a_role_token_added_without_the_special_flag_still_becomes_plain_text():
    """The backend's switch leaves an added token not flagged special whole; lucidlm counts a
    role token as special all the same, so that one still goes through a copy without it."""
    tok = HFTokenizer(_backend(["<a>"], unflagged=["<e>"]), eos_token="<e>")
    text = "x<e>y<a>"
    assert tok.encode(text, allowed_special=False) == _backend([]).encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == _backend(["<a>"], unflagged=["<e>"]).encode(text, add_special_tokens=False).ids


def test_a_wrong_allowed_special_name_gets_a_short_message(gemma, hf_gemma3_tokenizer):
    count = sum(t.special for t in hf_gemma3_tokenizer.added_tokens_decoder.values())
    assert count == 6249
    with pytest.raises(TokenizerError) as caught:
        gemma.encode("hi", allowed_special={"<|im_start|>"})
    message = str(caught.value)
    assert len(message) < 1000  # was 98,939 characters
    assert f"({count:,} in all)" in message and "'<bos>'" in message and "'<unused6241>'" not in message
    with pytest.raises(TokenizerError, match=r"did you mean '<end_of_turn>'\?$"):
        gemma.encode("hi", allowed_special={"<end_of_turns>"})


def test_a_wrong_role_token_gets_a_short_message():
    names = ["<|endoftext|>", *(f"<x{i}>" for i in range(500))]
    with pytest.raises(TokenizerError) as caught:
        CharTokenizer(list("ab"), names, eos_token="<endoftext>")
    message = str(caught.value)
    assert len(message) < 1000 and "(501 in all)" in message
    assert message.endswith("did you mean '<|endoftext|>'?")
