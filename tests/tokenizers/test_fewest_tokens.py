"""``Tokenizer.fewest_tokens(text)``, the bound that refuses a prompt too long for the context
before it is tokenized, is never more than the tokens the reference libraries count for the
same text (Hugging Face ``tokenizers`` for SmolLM2's file, tiktoken for GPT-2): a prompt that
fits is never refused. Random texts with multibyte UTF-8, runs of one character, special-token
names and the vocabularies' own longest tokens back to back (the case where the bound is tight)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lucidlm.pretrained import find_gguf
from lucidlm.tokenizers import CharTokenizer, WordTokenizer
from lucidlm.weights.gguf import open_gguf, read_metadata, tokenizer_from_metadata

from test_bpe import gpt2_ours, gpt2_tiktoken  # noqa: E402  (tests/tokenizers is on sys.path)

PIECES = ["a", " ", "  ", "\n", "\t", "é", "日本", "🦊", "👩\u200d👩\u200d👧", "1234567", "<|endoftext|>", "<|im_start|>",
          "-" * 40, " " * 90, "\u0301", "ﬁ", "Ａ", "don't", "\r\n", "\x00"]
TEXTS = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=30)), max_size=40).map("".join)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return tokenizer_from_metadata(read_metadata(open_gguf(find_gguf("smollm2-135m"))), "smollm2")


def _check(fewest: int, counted: int, text: str) -> None:
    assert fewest <= counted, f"bound {fewest} > {counted} tokens for {text[:80]!r}"


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_smollm2_bound_is_at_most_what_tokenizers_counts(smollm2_tokenizer, text):
    text = text.encode("utf-8", "replace").decode("utf-8")  # (no lone surrogates: encode refuses them)
    counted = len(smollm2_tokenizer._backend.encode(text, add_special_tokens=False).ids)  # the Rust library
    _check(smollm2_tokenizer.fewest_tokens(text), counted, text)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_gpt2_bound_is_at_most_what_tiktoken_counts(text):
    text = text.encode("utf-8", "replace").decode("utf-8")
    _check(gpt2_ours().fewest_tokens(text), len(gpt2_tiktoken().encode(text, allowed_special="all")), text)


def test_the_longest_tokens_back_to_back(smollm2_tokenizer):
    """Text made of a vocabulary's longest tokens, where each id covers the most bytes it can."""
    vocab = smollm2_tokenizer._backend.get_vocab()
    longest = max(vocab, key=len)
    text = smollm2_tokenizer.decode([vocab[longest]]) * 50
    counted = len(smollm2_tokenizer._backend.encode(text, add_special_tokens=False).ids)
    assert 0 < smollm2_tokenizer.fewest_tokens(text) <= counted
    ours = gpt2_ours()
    text = max((ours.decode([i]) for i in range(50256)), key=lambda t: len(t.encode())) * 50
    assert 0 < ours.fewest_tokens(text) <= len(gpt2_tiktoken().encode(text))


@settings(max_examples=100, deadline=None)
@given(text=TEXTS)
def test_char_and_word_bounds_never_pass_their_counts(text):
    text = text.encode("utf-8", "replace").decode("utf-8")
    chars = CharTokenizer.train(text + "x")  # <|endoftext|> is its special token
    assert chars.fewest_tokens(text) <= len(text.replace("<|endoftext|>", "x"))  # one id a character, or a name
    words = WordTokenizer.train(text + " x")
    assert words.fewest_tokens(text) <= len(text.split())  # the oracle: one id per word


def test_a_tokenizer_that_rewrites_text_has_no_bound():
    """Whitespace dropped (words), or a normalizer that shrinks text (NFKC: 'Ａ' 3 bytes -> 'A'):
    no bound rather than a wrong one."""
    tokenizers = pytest.importorskip("tokenizers")
    from lucidlm.tokenizers import HFTokenizer

    assert WordTokenizer.train("a b").fewest_tokens(" " * 100_000) == 0
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.normalizer = tokenizers.normalizers.NFKC()
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    backend.train_from_iterator(["A b c"], tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    assert HFTokenizer(backend).fewest_tokens("Ａ" * 100_000) == 0
    backend.normalizer = None  # the same tokenizer without it spells text out
    assert HFTokenizer(backend).fewest_tokens("A" * 100_000) > 0


def test_bytes_the_vocabulary_lacks_are_not_counted(smollm2_tokenizer):
    """A byte whose byte-level character is not in the vocabulary, with no unk token, is dropped
    by the Rust library: SmolLM2 lacks 0x04, 0x13, 0xF1, ... (1,000 of "\\x04" encode to no id),
    as does a ByteLevel BPE trained without its initial alphabet. Such bytes cover no id, so the
    bound must not count them."""
    tokenizers = pytest.importorskip("tokenizers")
    from lucidlm.tokenizers import HFTokenizer

    texts = ["\x04" * 1000, "\U00040000" * 300 + "hi", "abc\x13" * 100, "z" * 120 + "hello"]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["hello world " * 10], tokenizers.trainers.BpeTrainer(vocab_size=300))
    for tokenizer in (smollm2_tokenizer, HFTokenizer(backend)):
        for text in texts:
            _check(tokenizer.fewest_tokens(text), len(tokenizer._backend.encode(text, add_special_tokens=False).ids),
                   text)
    assert smollm2_tokenizer.fewest_tokens("abc\x13" * 1000) > 0  # the other bytes still count
