"""A long text goes through a pretrained tokenizer's backend in pieces (``tokenizers/long_text.py``):
its ids must be the ones one call over the whole text gives, which transformers' tokenizer of the
same GGUF file (and, for the other pre-tokenizer regexes, the Rust backend's own whole-text
encode) says; and the backends for which cutting would change the ids must encode whole."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers

from lucidlm.pretrained import find_gguf
from lucidlm.tokenizers import HFTokenizer, long_text
from lucidlm.weights.gguf import open_gguf, read_metadata, tokenizer_from_metadata

from tokenizer_assets import shared_file

# The pre-tokenizer names whose regexes long_text.py vouches for: GPT-2's (smollm) and VOUCHED_SPLITS.
SPLIT_NAMES = ["smollm", *long_text.VOUCHED_SPLITS]
# Fragments for random texts: every kind of whitespace run, newlines after and before every kind of
# character, contractions, digits, marks, special-token text.
FRAGMENTS = ["\n", "\n\n", "\r\n", "\r", " ", "  ", "\t", " \n", "a", "Hello", "B", "z.", "x,", "1", "234", "'s", "'LL",
             "é", "e\u0301", "日本", "🤗", "\u00a0", "\u2028", "/", "./", "-", "<|endoftext|>", "<|im_start|>", "_",
             "\x85", "\x1c", "Ω", "ǅ", ".\nThe", "d\nA", "7\nz", ")\nb", "'\nI"]  # the last five: cuts


@pytest.fixture(scope="module")
def metadata():
    return read_metadata(open_gguf(find_gguf("smollm2-135m")))


@pytest.fixture(scope="module")
def smollm2_tokenizer(metadata) -> HFTokenizer:
    return tokenizer_from_metadata(metadata, "smollm2")


@pytest.fixture(scope="module")
def shakespeare() -> str:
    """tinyshakespeare (1.1 MB) with special-token text in it, longer than LONG_TEXT_CHARS."""
    text = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    lines = text.split("\n")
    for i in range(5, len(lines), 997):  # at a line's start, where pieces are cut, and inside one
        lines[i] = ("<|endoftext|>" if i % 2 else "<|im_start|>user") + lines[i]
        lines[i + 1] = lines[i + 1] + "<|im_end|>" + lines[i + 1]
    text = "\n".join(lines)
    assert len(text) > long_text.LONG_TEXT_CHARS
    return text


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(n))


def test_a_long_text_gives_transformers_ids(smollm2_tokenizer, hf_smollm2, shakespeare):
    reference = hf_smollm2[1]
    assert long_text.cuts_safely(smollm2_tokenizer.backend)
    assert len(long_text.pieces(shakespeare, long_text.PIECE_CHARS)) > 10  # cut, many times
    # special tokens allowed (read as their ids) and not (read as text: the backend's switch)
    assert smollm2_tokenizer.encode(shakespeare) == reference(shakespeare, add_special_tokens=True)["input_ids"]
    assert smollm2_tokenizer.encode(shakespeare, allowed_special=False) == \
        reference(shakespeare, add_special_tokens=True, split_special_tokens=True)["input_ids"]


def test_a_subset_of_special_tokens_allowed_gives_the_same_ids_in_pieces(smollm2_tokenizer, shakespeare, monkeypatch):
    """The third way through: a copy of the backend without the tokens not allowed. Its ids in
    pieces against the copy's own whole-text encode (the Rust backend's)."""
    want = smollm2_tokenizer.encode(shakespeare, allowed_special={"<|im_end|>"})
    monkeypatch.setattr(long_text, "LONG_TEXT_CHARS", len(shakespeare))  # now one call
    assert smollm2_tokenizer.encode(shakespeare, allowed_special={"<|im_end|>"}) == want
    assert want.count(smollm2_tokenizer.special_tokens["<|im_end|>"]) == shakespeare.count("<|im_end|>") > 30
    assert smollm2_tokenizer.special_tokens["<|endoftext|>"] not in want


@pytest.mark.parametrize("name", SPLIT_NAMES)
def test_random_texts_in_small_pieces_give_the_backends_whole_text_ids(metadata, name, monkeypatch):
    """Every regex vouched for, on random texts cut every ~12 characters where allowed: the ids
    of the backend's one call over the whole text."""
    tokenizer = tokenizer_from_metadata({**metadata, "tokenizer.ggml.pre": name}, name)
    backend = tokenizer.backend
    assert long_text.cuts_safely(backend)
    monkeypatch.setattr(long_text, "LONG_TEXT_CHARS", 64)
    monkeypatch.setattr(long_text, "PIECE_CHARS", 12)
    rng = random.Random(name)
    cuts = 0
    for _ in range(60):
        text = random_text(rng, rng.randint(40, 400))
        cuts += len(long_text.pieces(text, 12)) - 1
        for allowed in (True, False):
            want = backend.encode(text, add_special_tokens=False).ids if allowed else \
                _with_switch(backend, lambda: backend.encode(text, add_special_tokens=False).ids)
            assert tokenizer.encode(text, allowed_special=allowed) == want, (name, text)
    assert cuts > 500


def test_an_nfc_normalizer_still_cuts_and_gives_the_whole_text_ids(smollm2_tokenizer, monkeypatch):
    backend = Tokenizer.from_str(smollm2_tokenizer.backend.to_str())
    backend.normalizer = normalizers.NFC()
    tokenizer = HFTokenizer(backend)
    assert long_text.cuts_safely(backend)
    monkeypatch.setattr(long_text, "LONG_TEXT_CHARS", 64)
    monkeypatch.setattr(long_text, "PIECE_CHARS", 12)
    rng = random.Random(7)
    for _ in range(40):
        text = random_text(rng, 200)
        assert tokenizer.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_pieces_join_back_and_are_cut_after_a_newline_before_a_letter():
    rng = random.Random(3)
    text = random_text(rng, 5000)
    parts = long_text.pieces(text, 50)
    assert "".join(parts) == text and len(parts) > 20
    for left, right in zip(parts, parts[1:]):
        assert len(left) >= 50 and left[-1] == "\n" and "!" <= left[-2] <= "~" and right[0].isascii() and \
            right[0].isalpha()
    assert long_text.pieces("no newline " * 100, 10) == ["no newline " * 100]


def _variant(tokenizer: HFTokenizer, change) -> Tokenizer:
    spec = json.loads(tokenizer.backend.to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize("kind", ["prefix space", "added token with a newline", "other regex", "NFKC", "lstrip token",
                                  "dropout"])
def test_backends_whose_pieces_could_differ_encode_whole(smollm2_tokenizer, kind, monkeypatch):
    """Refused: each could give other ids in pieces. Where it certainly would (a prefix space
    before every piece, an added token across a cut), the pieces' ids are shown to differ, and
    the tokenizer still gives the whole text's."""
    text = "First line.\nSecond line.\nUser: third line.\nAnd more.\n" * 4
    if kind == "prefix space":
        backend = _variant(smollm2_tokenizer, lambda s: s["pre_tokenizer"].update(add_prefix_space=True))
    elif kind == "added token with a newline":
        backend = Tokenizer.from_str(smollm2_tokenizer.backend.to_str())
        backend.add_special_tokens([AddedToken(".\nUser", special=True)])
    elif kind == "other regex":
        backend = _variant(smollm2_tokenizer, lambda s: s.update(pre_tokenizer=json.loads(pre_tokenizers.Sequence([
            pre_tokenizers.Split(r"\n?[^\n]+", behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]).__getstate__())))
    elif kind == "NFKC":
        backend = Tokenizer.from_str(smollm2_tokenizer.backend.to_str())
        backend.normalizer = normalizers.NFKC()
    elif kind == "lstrip token":
        backend = Tokenizer.from_str(smollm2_tokenizer.backend.to_str())
        backend.add_special_tokens([AddedToken("User", special=True, lstrip=True)])
    else:
        backend = _variant(smollm2_tokenizer, lambda s: s["model"].update(dropout=0.5))
    assert not long_text.cuts_safely(backend)
    monkeypatch.setattr(long_text, "LONG_TEXT_CHARS", 64)
    monkeypatch.setattr(long_text, "PIECE_CHARS", 12)
    whole = backend.encode(text, add_special_tokens=False).ids
    if kind in ("prefix space", "added token with a newline", "lstrip token"):
        parts = long_text.pieces(text, 12)
        in_pieces = [i for part in parts for i in backend.encode(part, add_special_tokens=False).ids]
        assert in_pieces != whole
    if kind != "dropout":
        assert HFTokenizer(backend).encode(text) == whole


def test_gemmas_sentencepiece_backend_encodes_whole(gemma3_gguf, hf_gemma3_tokenizer, shakespeare):
    gemma = tokenizer_from_metadata(read_metadata(open_gguf(gemma3_gguf)), str(gemma3_gguf))
    assert not long_text.cuts_safely(gemma.backend)
    text = shakespeare[:300_000]
    assert gemma.encode(text) == hf_gemma3_tokenizer(text, add_special_tokens=True)["input_ids"]


def _with_switch(backend: Tokenizer, run):
    """``run()`` with the backend's encode_special_tokens on (special-token text read as text)."""
    backend.encode_special_tokens = True
    try:
        return run()
    finally:
        backend.encode_special_tokens = False



@pytest.mark.parametrize("token, text", [("\u212aelvin", "Temperature.\nKelvin scale.\n"),
                                         ("\u00e9t\u00e9", "Summer.\ne\u0301te\u0301 is hot.\n")])
def test_an_lstrip_token_that_nfc_matches_at_a_letter_encodes_whole(smollm2_tokenizer, token, text, monkeypatch):
    """A token flagged normalized is matched in the NFC text as its content made NFC, which can
    start at a line's first ASCII letter though its own first character is none: the Kelvin sign
    is "K"; "e" and U+0301 become "é". With lstrip it takes the newline before that letter in the
    whole text, which a piece starting at the letter has not."""
    backend = Tokenizer.from_str(smollm2_tokenizer.backend.to_str())
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(token, lstrip=True, normalized=True)])
    text *= 4
    whole = backend.encode(text, add_special_tokens=False).ids
    parts = long_text.pieces(text, 8)
    assert len(parts) > 1 and [i for part in parts for i in backend.encode(part, add_special_tokens=False).ids] != whole
    assert not long_text.cuts_safely(backend)
    monkeypatch.setattr(long_text, "LONG_TEXT_CHARS", 16)
    monkeypatch.setattr(long_text, "PIECE_CHARS", 8)
    assert HFTokenizer(backend).encode(text) == whole
