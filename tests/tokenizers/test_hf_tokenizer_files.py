"""tokenizer.json files of less common shapes, against the ``tokenizers`` library and
transformers: post-processors that add BOS and EOS, an exported folder's BOS, allowing only
some special tokens, decoders lucidlm mirrors (and those it refuses), added tokens through the
decoder."""

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, WordLevel, WordPiece
from tokenizers.trainers import BpeTrainer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers import BPETokenizer, CharTokenizer, HFTokenizer
from lucidlm.weights.hf import _save_tokenizer

CORPUS = ["hello world the quick brown fox jumps over the lazy dog"] * 20


def _tiny_byte_level(template: str) -> Tokenizer:
    backend = Tokenizer(BPE(vocab={"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4, "Ġ": 5}, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0), ("</s>", 1)])
    return backend


def _save(backend: Tokenizer, folder, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("template", ["<s> $A </s>", "<s> $A"])
def test_bos_read_from_a_post_processor_that_also_appends(tmp_path, template):
    # The template also appending </s> used to hide its BOS: no BOS at all.
    path = _save(_tiny_byte_level(template), tmp_path, {"bos_token": "<s>", "eos_token": "</s>"})
    ours = HFTokenizer.from_file(path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path))("ab a")["input_ids"]
    assert ours.add_bos and reference[0] == 0
    # lucidlm puts BOS first and appends nothing: a prompt goes on
    assert ours.encode("ab a") == reference[:len(ours.encode("ab a"))]


@pytest.mark.parametrize("template", ["<s> $A", None])
def test_exported_folder_gives_transformers_the_same_ids(tmp_path, template):
    backend = _tiny_byte_level(template or "$A")
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is None:
        config["add_bos_token"] = True  # BOS from the config alone: the export needs a post-processor
    ours = HFTokenizer.from_file(_save(backend, tmp_path / "src", config))
    out = tmp_path / "out"
    out.mkdir()
    _save_tokenizer(ours, out)
    exported = AutoTokenizer.from_pretrained(str(out))("ab a")["input_ids"]
    assert exported == ours.encode("ab a") == [0, 4, 5, 2]
    assert HFTokenizer.from_file(out / "tokenizer.json").encode("ab a") == [0, 4, 5, 2]


def _trained(pre_tokenizer, decoder, vocab_size, specials=()):
    backend = Tokenizer(BPE(unk_token="<unk>" if "<unk>" in specials else None))
    backend.pre_tokenizer, backend.decoder = pre_tokenizer, decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    backend.train_from_iterator(CORPUS, BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                   initial_alphabet=alphabet, show_progress=False))
    return backend


def test_a_subset_of_special_tokens_keeps_their_flags(tmp_path):
    backend = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), 300)
    backend.add_special_tokens([AddedToken("<X>", lstrip=True, rstrip=True), "<Y>"])
    path = _save(backend, tmp_path)
    ours, reference = HFTokenizer.from_file(path), PreTrainedTokenizerFast(tokenizer_file=str(path))
    text = "hello <X> world"
    expected = reference(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text, allowed_special={"<X>"}) == ours.encode(text) == expected
    # "<Y>" not allowed: ordinary text, as transformers' split_special_tokens=True makes it
    split = PreTrainedTokenizerFast(tokenizer_file=str(path), split_special_tokens=True)
    assert ours.encode("a <Y> b", allowed_special={"<X>"}) == split("a <Y> b", add_special_tokens=False)["input_ids"]


def test_a_subset_of_special_tokens_prefixes_metaspace_once(tmp_path):
    meta = dict(prepend_scheme="first", split=False)
    backend = _trained(pre_tokenizers.Metaspace(**meta), decoders.Metaspace(**meta), 120, ["<unk>", "<s>", "</s>"])
    backend.add_special_tokens(["<X>"])
    path = _save(backend, tmp_path)
    ours, reference = HFTokenizer.from_file(path), PreTrainedTokenizerFast(tokenizer_file=str(path))
    text = "<s>hello</s> world"
    expected = reference(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text, allowed_special={"<s>", "</s>"}) == expected


def test_decoders_lucidlm_cannot_mirror_are_refused_at_load(tmp_path):
    wordpiece = Tokenizer(WordPiece(vocab={"[UNK]": 0, "hello": 1, "##s": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    with pytest.raises(TokenizerError, match="decoder step WordPiece"):
        HFTokenizer.from_file(_save(wordpiece, tmp_path / "wp"))
    suffix = Tokenizer(BPE(vocab={"h": 0, "i</w>": 1, "hi</w>": 2}, merges=[("h", "i</w>")], end_of_word_suffix="</w>"))
    suffix.decoder = decoders.BPEDecoder(suffix="</w>")
    with pytest.raises(TokenizerError, match="BPEDecoder"):
        HFTokenizer.from_file(_save(suffix, tmp_path / "bpe"))


def test_metaspace_with_its_own_replacement_decodes_as_the_library(tmp_path):
    backend = Tokenizer(WordLevel(vocab={"_hello": 0, "_world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="_")
    backend.decoder = decoders.Metaspace(replacement="_")
    ours = HFTokenizer.from_file(_save(backend, tmp_path))
    ids = backend.encode("hello world").ids
    assert ours.decode(ids) == backend.decode(ids) == "hello world"


def test_added_tokens_go_through_the_sentencepiece_decoder(tmp_path):
    # CodeLlama-style "▁<PRE>" and byte tokens listed among the added tokens
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in ["▁", "h", "i", "▁h", "▁hi", "▁<PRE>"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(BPE(vocab=vocab, merges=[("▁", "h"), ("▁h", "i")], byte_fallback=True,
                            unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "▁<PRE>"] + [f"<0x{i:02X}>" for i in range(256)])
    ours = HFTokenizer.from_file(_save(backend, tmp_path))
    for ids in ([vocab["▁hi"], vocab["▁<PRE>"], vocab["▁hi"]], backend.encode("hi 🦊").ids):
        assert ours.decode(ids) == backend.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("train", [
    lambda: BPETokenizer.train("hello world " * 50, 300, special_tokens=["<|endoftext|>", ""], progress=False),
    lambda: CharTokenizer.train("hello", special_tokens=[""]),
])
def test_an_empty_special_token_is_refused(train):
    with pytest.raises(TokenizerError, match="non-empty"):
        train()
