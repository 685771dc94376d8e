"""CharTokenizer: seed 002's character vocabulary and nanoGPT's shakespeare-char ids."""


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers import CharTokenizer, WordTokenizer, load_tokenizer

from tokenizer_assets import shared_file  # noqa: E402  (tests/tokenizers is on sys.path)


def test_trained_alphabet_is_sorted_characters_then_eos():
    tok = CharTokenizer.train("hello")
    assert tok.chars == ["e", "h", "l", "o"]
    assert tok.vocab_size == 5
    assert tok.encode("hello") == [1, 0, 2, 2, 3]
    assert tok.eos_id == 4 and tok.special_tokens == {"<|endoftext|>": 4}
    assert tok.bos_id is None and tok.pad_id is None
    assert tok.encode("hell<|endoftext|>oh") == [1, 0, 2, 2, 4, 3, 1]
    assert tok.decode([1, 0, 2, 2, 3, 4]) == "hello<|endoftext|>"
    assert [tok.id_to_token(i) for i in range(5)] == ["e", "h", "l", "o", "<|endoftext|>"]


def test_reproduces_seed_002_tokenize():
    # seed 002: vocab = list('abcdefghijklmnopqrstuvwxyz., ') + ['<EOS>'], EOS appended.
    tok = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz., "), ("<EOS>",), eos_token="<EOS>")
    ids = tok.encode("hello , there .") + [tok.eos_id]
    assert ids == [7, 4, 11, 11, 14, 28, 27, 28, 19, 7, 4, 17, 4, 28, 26, 29]
    assert tok.decode(ids) == "hello , there .<EOS>"


def test_tinyshakespeare_matches_nanogpt_shakespeare_char():
    text = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = CharTokenizer.train(text)
    assert "".join(tok.chars) == (
        "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    )
    assert tok.vocab_size == 66  # nanoGPT's 65 characters + <|endoftext|>
    assert tok.encode("hii there") == [46, 47, 47, 1, 58, 46, 43, 56, 43]
    assert tok.decode(tok.encode(text[:5000])) == text[:5000]


def test_unknown_character_names_character_and_position():
    tok = CharTokenizer.train("hello")
    with pytest.raises(TokenizerError, match=r"character '!' \(U\+0021\) at position 5"):
        tok.encode("hello!")
    # Positions count from the caller's string, across special tokens.
    with pytest.raises(TokenizerError, match=r"'x' \(U\+0078\) at position 15"):
        tok.encode("he<|endoftext|>x")
    # Not allowed as special, the name is plain text, and '<' is not in the alphabet.
    with pytest.raises(TokenizerError, match=r"'<' \(U\+003C\) at position 0"):
        tok.encode("<|endoftext|>", allowed_special=False)


def test_out_of_range_ids_raise():
    tok = CharTokenizer.train("hello")
    with pytest.raises(TokenizerError, match=r"token id 5 is out of range .*vocab_size=5"):
        tok.decode([0, 5])
    with pytest.raises(TokenizerError, match=r"token id -1 is out of range"):
        tok.decode_bytes([-1])
    with pytest.raises(TokenizerError, match=r"token id 9 is out of range"):
        tok.id_to_token(9)


def test_bad_construction_raises():
    with pytest.raises(TokenizerError, match="empty corpus"):
        CharTokenizer.train("")
    with pytest.raises(TokenizerError, match="single characters"):
        CharTokenizer(["ab", "c"])
    with pytest.raises(TokenizerError, match=r"repeats characters \['a'\]"):
        CharTokenizer(["a", "b", "a"])
    with pytest.raises(TokenizerError, match="not special tokens of this tokenizer"):
        CharTokenizer.train("abc").encode("abc", allowed_special={"<pad>"})


def test_save_load_round_trip(tmp_path):
    tok = CharTokenizer.train("The quick brown fox, naïve café 🦊\n")
    path = tmp_path / "char.json"
    tok.save(path)
    for loaded in (CharTokenizer.load(path), load_tokenizer(path)):
        assert isinstance(loaded, CharTokenizer)
        assert loaded.chars == tok.chars and loaded.special_tokens == tok.special_tokens
        assert loaded.encode("café 🦊<|endoftext|>") == tok.encode("café 🦊<|endoftext|>")
    with pytest.raises(TokenizerError, match="holds a 'char' tokenizer, not a 'word' one"):
        WordTokenizer.load(path)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="missing.json does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"chars": []}')
    with pytest.raises(TokenizerError, match=r"bad.json has no \"type\" field"):
        load_tokenizer(bad)
    bad.write_text('{"type": "sentencepiece"}')
    with pytest.raises(TokenizerError, match="unknown tokenizer type 'sentencepiece'"):
        load_tokenizer(bad)
    bad.write_text('{"type": "char", "chars": ["a"]}')
    with pytest.raises(TokenizerError, match="bad.json: malformed 'char' tokenizer file"):
        load_tokenizer(bad)


ALPHABET = "abc xyz\n\t.éü日本🦊"


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=ALPHABET))
def test_round_trip_over_the_alphabet(text):
    tok = CharTokenizer.train(ALPHABET)
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
