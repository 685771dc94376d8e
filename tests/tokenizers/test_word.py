"""WordTokenizer: seed 004's whitespace words, made reproducible, with <pad>=0 and <unk>."""


import pytest

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers import WordTokenizer, load_tokenizer

from tokenizer_assets import shared_file  # noqa: E402  (tests/tokenizers is on sys.path)


CORPUS = "the cat sat on the mat\nthe end"


def test_ids_are_specials_then_words_by_frequency_then_alphabet():
    tok = WordTokenizer.train(CORPUS)
    # 'the' x3 first; the rest (1 each) alphabetical.
    assert tok.words == ["the", "cat", "end", "mat", "on", "sat"]
    assert (tok.pad_id, tok.unk_id, tok.eos_id, tok.bos_id) == (0, 1, 2, None)
    assert tok.vocab_size == 9
    assert tok.encode("the cat sat") == [3, 4, 8]
    assert tok.encode("the dog sat") == [3, 1, 8]  # unknown word -> <unk>
    assert tok.decode([3, 1, 8, 2]) == "the <unk> sat <|endoftext|>"
    assert tok.id_to_token(0) == "<pad>" and tok.id_to_token(5) == "end"


def test_whitespace_is_collapsed_and_decode_joins_with_one_space():
    tok = WordTokenizer.train(CORPUS)
    assert tok.encode("  the\n\tcat   on  ") == [3, 4, 7]
    assert tok.decode(tok.encode("  the\n\tcat   on  ")) == "the cat on"
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_special_tokens_split_words_when_allowed():
    tok = WordTokenizer.train(CORPUS)
    assert tok.encode("the cat<|endoftext|>the") == [3, 4, 2, 3]
    assert tok.encode("<pad> the") == [0, 3]
    # Not allowed: "cat<|endoftext|>the" is one unknown word, and a bare name is <unk>.
    assert tok.encode("the cat<|endoftext|>the", allowed_special=False) == [3, 1]
    assert tok.encode("<pad> the", allowed_special=False) == [1, 3]
    assert tok.encode("the <pad> <|endoftext|>", allowed_special={"<|endoftext|>"}) == [3, 1, 2]


def test_max_vocab_and_min_count():
    assert WordTokenizer.train(CORPUS, max_vocab=5).words == ["the", "cat"]
    assert WordTokenizer.train(CORPUS, min_count=2).words == ["the"]
    assert WordTokenizer.train(CORPUS, min_count=2).encode("the cat") == [3, 1]
    with pytest.raises(TokenizerError, match=r"max_vocab=3 leaves no room .* at least 4"):
        WordTokenizer.train(CORPUS, max_vocab=3)
    with pytest.raises(TokenizerError, match="min_count=0 must be at least 1"):
        WordTokenizer.train(CORPUS, min_count=0)
    with pytest.raises(TokenizerError, match="no words"):
        WordTokenizer.train(" \n\t ")


def test_out_of_range_ids_raise():
    tok = WordTokenizer.train(CORPUS)
    with pytest.raises(TokenizerError, match=r"token id 9 is out of range .*vocab_size=9"):
        tok.decode([3, 9])
    with pytest.raises(TokenizerError, match=r"token id -2 is out of range"):
        tok.decode([-2])


def test_tinyshakespeare_vocabulary_is_seed_004s_plus_three_specials():
    text = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = WordTokenizer.train(text)
    assert tok.vocab_size == 25670 + 3  # seed 004: VOCAB_SIZE = 25670 = len(set(words))
    assert tok.words[:5] == ["the", "I", "to", "and", "of"]
    words = text.split()[:2000]
    assert tok.decode(tok.encode(" ".join(words))) == " ".join(words)
    assert WordTokenizer.train(text).words == tok.words  # same ids every run


def test_save_load_round_trip(tmp_path):
    tok = WordTokenizer.train(CORPUS + " café 🦊")
    path = tmp_path / "word.json"
    tok.save(path)
    loaded = load_tokenizer(path)
    assert isinstance(loaded, WordTokenizer)
    assert loaded.words == tok.words
    # 'café' sorts before 'cat' ('f' < 't'); the emoji sorts after every ASCII word.
    assert loaded.encode("the café 🦊 dog") == tok.encode("the café 🦊 dog") == [3, 4, 10, 1]
