"""BPE edge cases against the references: split patterns with capturing groups (tiktoken),
the Hugging Face export of a BPE tokenizer (transformers, ``tokenizers``, GPT-2's own files),
and the clear errors for special_tokens given as one str, an unknown eos_token, bad training
input and damaged tokenizer files."""

import json
import warnings
from functools import lru_cache

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFBackend
from transformers import AutoTokenizer

import lucidlm
from lucidlm.errors import TokenizerError
from lucidlm.tokenizers import BPETokenizer, CharTokenizer, HFTokenizer, WordTokenizer, load_tokenizer
from lucidlm.tokenizers.gpt2_files import bytes_to_unicode
from lucidlm.tokenizers.tiktoken_bpe import LLAMA3_SPLIT_PATTERN, TiktokenTokenizer
from lucidlm.weights.hf import _save_tokenizer, save_hf

from tokenizer_assets import shared_file  # noqa: E402  (tests/tokenizers is on sys.path)

# GPT-2's pattern with the contractions in a capturing group, a common way to spell it; and
# the same with two groups (findall returned the group's text, or tuples for two groups).
ONE_GROUP = r"""('s|'t|'re|'ve|'m|'ll|'d)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TWO_GROUPS = r"""('s|'t|'re|'ve|'m|'ll|'d)|( ?\p{L}+)| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TEXTS = ["Hello world, it's 42!", "I'LL  don't\n\n\tcafé 日本語 🦊 x=1+2;  ",
         "a<|endoftext|>b <pad> <|endoftext|>", " , . ' s  ", "y" * 450 + " end"]


@lru_cache(maxsize=None)
def corpus() -> str:
    return shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:60_000]


@lru_cache(maxsize=None)
def gpt2() -> BPETokenizer:
    return BPETokenizer.from_gpt2_files(shared_file("gpt2", "encoder.json"), shared_file("gpt2", "vocab.bpe"))


def train(vocab_size=400, specials=("<|endoftext|>",), **kwargs) -> BPETokenizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a small corpus may run out of pairs
        return BPETokenizer.train(corpus(), vocab_size, list(specials), progress=False, **kwargs)


def tiktoken_for(tok: BPETokenizer, pattern: str):
    """tiktoken with ``tok``'s token bytes as ranks (id = rank) and ``pattern`` as its pat_str."""
    tiktoken = pytest.importorskip("tiktoken")
    n_mergeable = 256 + len(tok.merges)
    ranks = {tok.decode_bytes([i]): i for i in range(n_mergeable)}
    return tiktoken.Encoding(name="lucidlm_test", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens=dict(tok.special_tokens))


# ----------------------------------------------------------------- capturing groups in the pattern


@pytest.mark.parametrize("pattern", [ONE_GROUP, TWO_GROUPS], ids=["one-group", "two-groups"])
def test_gpt2_merges_under_a_grouped_pattern_encode_as_tiktoken(pattern):
    base = gpt2()
    ours = BPETokenizer(base.merges, base.special_tokens, pattern=pattern, byte_order=base.byte_order)
    reference = tiktoken_for(ours, pattern)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text, allowed_special="all")
    assert ours.encode("Hello world, it's 42!") == [15496, 995, 11, 340, 338, 5433, 0]


@pytest.mark.parametrize("pattern", [ONE_GROUP, TWO_GROUPS], ids=["one-group", "two-groups"])
def test_training_under_a_grouped_pattern_sees_whole_matches(pattern):
    tok = train(pattern=pattern)
    assert len(tok.merges) == 400 - 257  # it used to see no words at all: 1 merge, or a crash
    reference = tiktoken_for(tok, pattern)
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text, allowed_special="all")
        assert tok.decode(tok.encode(text)) == text


def test_tiktoken_tokenizer_under_a_grouped_pattern_encodes_as_tiktoken():
    base = gpt2()
    ranks = {base.decode_bytes([i]): i for i in range(50256)}
    ours = TiktokenTokenizer(ranks, ["<|endoftext|>"], ONE_GROUP)
    reference = tiktoken_for(base, ONE_GROUP)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text, allowed_special="all")


# ----------------------------------------------------------------- Hugging Face export


def export(tok, folder):
    folder.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(tok, folder)
    return folder


@pytest.mark.parametrize("pattern", [None, LLAMA3_SPLIT_PATTERN, r"\p{L}+| \p{L}+"],
                         ids=["gpt2-pattern", "llama3-pattern", "letters-only"])
def test_exported_bpe_encodes_and_decodes_as_transformers_and_tokenizers(tmp_path, pattern):
    kwargs = {} if pattern is None else {"pattern": pattern}
    tok = train(specials=("<|endoftext|>", "<pad>"), **kwargs)
    folder = export(tok, tmp_path)
    auto = AutoTokenizer.from_pretrained(str(folder))
    backend = HFBackend.from_file(str(folder / "tokenizer.json"))
    back = HFTokenizer.from_file(folder / "tokenizer.json")
    assert len(auto) == backend.get_vocab_size() == back.vocab_size == tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert auto(text, add_special_tokens=False)["input_ids"] == ids
        assert backend.encode(text, add_special_tokens=False).ids == ids
        assert back.encode(text) == ids
        assert auto.decode(ids) == backend.decode(ids, skip_special_tokens=False) == tok.decode(ids)
    # the export drops what the pattern does not match, as tiktoken does
    assert tiktoken_for(tok, tok.pattern).encode(TEXTS[1]) == auto(TEXTS[1], add_special_tokens=False)["input_ids"]
    assert auto.convert_tokens_to_ids("<pad>") == tok.special_tokens["<pad>"]
    assert auto.eos_token == "<|endoftext|>"


def test_gpt2_export_is_gpt2s_own_files():
    spec = json.loads(gpt2().to_hf_json())
    encoder = json.loads(shared_file("gpt2", "encoder.json").read_text(encoding="utf-8"))
    merges = shared_file("gpt2", "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]
    assert spec["model"]["vocab"] == {token: i for token, i in encoder.items() if token != "<|endoftext|>"}
    assert spec["model"]["merges"] == [line for line in merges if line]
    assert [(t["content"], t["id"]) for t in spec["added_tokens"]] == [("<|endoftext|>", 50256)]


def test_gpt2_model_round_trips_lucidlm_hf_lucidlm_with_its_tokenizer(tmp_path):
    model = lucidlm.load("gpt2", random_init=True, n_layers=1, d_model=32, n_heads=2, max_seq_len=32)
    save_hf(model, tmp_path)
    reference = tiktoken_for(gpt2(), r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    back = lucidlm.load(tmp_path).tokenizer
    assert back is not None and back.eos_id == 50256
    for text in TEXTS:
        expected = reference.encode(text, allowed_special="all")
        assert auto(text)["input_ids"] == back.encode(text) == expected
        assert auto.decode(expected) == back.decode(expected) == text


@pytest.mark.parametrize("specials, pattern, problem", [
    (["<é>"], None, "ByteLevel decoder"),  # HF decodes it through GPT-2's byte alphabet: '<\ufffd>'
    (["a"], None, "spelled like its ordinary token"),  # HF would give it the id of the byte 'a'
    (["<|endoftext|>"], r"(?P<w>\p{L}+)|\s+|[^\s\p{L}]+", "cannot run it"),  # Oniguruma has no (?P<
])
def test_an_unmirrorable_bpe_is_left_out_of_the_export_with_a_warning(tmp_path, specials, pattern, problem):
    kwargs = {} if pattern is None else {"pattern": pattern}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = BPETokenizer.train("hello world abc " * 10, 270, specials, progress=False, **kwargs)
    with pytest.warns(UserWarning, match=problem):
        export(tok, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    with pytest.raises(TokenizerError, match=problem):
        tok.to_hf_json()


def test_two_merges_making_the_same_bytes_are_left_out_of_the_export():
    tok = BPETokenizer([(97, 98), (97, 98)], {"<|endoftext|>": 258})  # a Hugging Face vocab holds "ab" once
    with pytest.raises(TokenizerError, match="make the same bytes"):
        tok.to_hf_json()


def test_why_an_e_acute_special_is_unmirrorable():
    # The reference's own behaviour that the refusal above guards against.
    backend = HFBackend(models.BPE({c: b for b, c in bytes_to_unicode().items()}, []))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<é>", special=True, normalized=False)])
    assert backend.decode(backend.encode("<é>").ids, skip_special_tokens=False) != "<é>"


# ----------------------------------------------------------------- clear errors


@pytest.mark.parametrize("build", [
    lambda: CharTokenizer.train("hello", special_tokens="<eos>"),
    lambda: CharTokenizer(list("ab"), "<eos>"),
    lambda: BPETokenizer.train("hello world", 300, special_tokens="<eos>", progress=False),
    lambda: BPETokenizer.train("hello world", 300, special_tokens="<|endoftext|>", progress=False),
    lambda: TiktokenTokenizer({bytes([b]): b for b in range(256)}, "<eos>"),
])
def test_special_tokens_as_one_str_is_refused(build):
    with pytest.raises(TokenizerError, match=r"must be a list of names, e\.g\. \['<"):
        build()


def test_char_tokenizer_refuses_an_eos_token_it_does_not_have():
    with pytest.raises(TokenizerError, match="eos_token '<eos>' is not one of"):
        CharTokenizer(list("ab"), ["<EOS>"], eos_token="<eos>")
    with pytest.raises(TokenizerError, match="eos_token '<EOS>' is not one of"):
        CharTokenizer(list("ab"), ["<pad>"], eos_token="<EOS>")
    # not naming one still means <|endoftext|> when it is a special token, else none
    assert CharTokenizer(list("ab")).eos_token == "<|endoftext|>"
    assert CharTokenizer(list("ab"), ()).eos_id is None
    assert CharTokenizer.train("ab", special_tokens=()).eos_id is None


@pytest.mark.parametrize("vocab_size", [300.5, "300", None, True])
def test_bpe_train_refuses_a_vocab_size_that_is_not_a_whole_number(vocab_size):
    with pytest.raises(TokenizerError, match="vocab_size=.* expected a whole number"):
        BPETokenizer.train("hello world", vocab_size, progress=False)


@pytest.mark.parametrize("train_on", [
    lambda text: BPETokenizer.train(text, 300, progress=False),
    lambda text: CharTokenizer.train(text),
    lambda text: WordTokenizer.train(text),
])
def test_training_refuses_what_encode_refuses(train_on):
    with pytest.raises(TokenizerError, match="lone surrogate"):
        train_on("ab\udc80ab ab ab")
    with pytest.raises(TokenizerError, match=r"train\(\) takes a str, got bytes"):
        train_on(b"hello hello world")


@pytest.mark.parametrize("field, value, problem", [
    ("version", "1", '"version" is \'1\''), ("version", None, '"version" is None'),
    ("version", True, '"version" is True'), ("type", ["char"], "\"type\" is \\['char'\\]"),
    ("type", None, '"type" is None'),
])
def test_a_damaged_tokenizer_file_names_the_bad_field(tmp_path, field, value, problem):
    path = tmp_path / "tok.json"
    CharTokenizer.train("hello").save(path)
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match=f"tok.json: {problem}"):
        load_tokenizer(path)
