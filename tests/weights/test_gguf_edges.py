"""GGUF files at the edges of what llama.cpp writes, each checked against an oracle:
transformers' GGUF loader (tokenizer ids, the model's logits, its pre-tokenizer table), or the
file's own metadata as the gguf package reads it.

- every ``tokenizer.ggml.pre`` name transformers maps gets its regex (Mistral-Nemo's
  ``tekken`` among them), and an unknown name is refused instead of split like GPT-2;
- ``tokenizer.ggml.add_eos_token`` is read and exposed (prompts still get no EOS);
- a role token stored outside the byte alphabet (DeepSeek-R1 distills' BOS) keeps its id;
- sentencepiece (``tokenizer.ggml.model = "llama"``) files: Llama 2 / TinyLlama / Mistral 7B;
- per-layer head counts, partial rotary stated without ``key_length``, and bad
  ``general.sampling.*`` values are each one clear error naming the file.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import lucidlm
from lucidlm.errors import GGUFError, TokenizerError, UnsupportedArchitectureError
from lucidlm.pretrained import find_gguf
from lucidlm.tokenizers.bpe import bytes_to_unicode
from lucidlm.tokenizers.gguf_tokenizer import PRE_TOKENIZER_SPLITS
from lucidlm.weights.gguf import load_gguf, open_gguf, read_metadata, tokenizer_from_metadata

pytestmark = pytest.mark.usefixtures("one_thread")

BYTE_TOKENS = [bytes_to_unicode()[b] for b in range(256)]


def reference_tokenizer(path: Path):
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def ours(path: Path):
    return tokenizer_from_metadata(read_metadata(open_gguf(path)), str(path))


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama(path: Path, meta: dict | None = None, tokenizer=None, d_model: int = 64, n_heads: int = 4,
               n_kv: int = 2, head_dim: int = 16, n_layers: int = 2, seed: int = 0) -> Path:
    """A float32 llama GGUF; ``meta`` overrides llama.* keys (a list is written as an array);
    ``tokenizer(writer)`` writes the tokenizer keys and returns the vocabulary size."""
    writer = gguf.GGUFWriter(str(path), "llama")
    base = {"context_length": 64, "embedding_length": d_model, "block_count": n_layers, "feed_forward_length": 96,
            "attention.head_count": n_heads, "attention.head_count_kv": n_kv}
    for key, value in {**base, **(meta or {})}.items():
        if isinstance(value, list):
            writer.add_array(f"llama.{key}", value)
        else:
            writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if tokenizer is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(["<|endoftext|>", *BYTE_TOKENS])
        writer.add_token_types([3] + [1] * 256)
        writer.add_token_merges([])
        writer.add_eos_token_id(0)
        vocab = 257
    else:
        vocab = tokenizer(writer)
    g = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (g.standard_normal((rows, cols)) * 0.1).astype(np.float32)

    writer.add_tensor("token_embd.weight", mat(vocab, d_model))
    writer.add_tensor("output_norm.weight", np.ones(d_model, np.float32))
    shapes = {"attn_q": (n_heads * head_dim, d_model), "attn_k": (n_kv * head_dim, d_model),
              "attn_v": (n_kv * head_dim, d_model), "attn_output": (d_model, n_heads * head_dim),
              "ffn_gate": (96, d_model), "ffn_up": (96, d_model), "ffn_down": (d_model, 96)}
    for i in range(n_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d_model, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d_model, np.float32))
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", mat(*shape))
    finish(writer)
    return path


# ----------------------------------------------------------------- pre-tokenizer names (bug1)


@pytest.fixture(scope="module")
def smollm2_vocab():
    meta = read_metadata(open_gguf(find_gguf("smollm2-135m")))
    return meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], meta["tokenizer.ggml.merges"]


def smollm2_vocab_file(path: Path, vocab, pre: str) -> Path:
    """SmolLM2's real byte-level vocabulary and merges under another pre-tokenizer name."""
    tokens, types, merges = vocab
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    finish(writer)
    return path


def test_pre_tokenizer_table_is_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert PRE_TOKENIZER_SPLITS == GGUF_PRE_TOKENIZER_SPLITS


SPLIT_TEXTS = ["def f(x):\n    return x**2\n", "line1\r\nline2\n\n\nline3", "HelloWorld CamelCase ÀÉÎ it's 1234567",
               "naïve café 日本語 🤗 don't\t\ttabs  ", "URL https://a.b/c?d=1&e=2 <|im_start|>x"]


@pytest.mark.parametrize("pre", ["tekken", "kanana2", "qwen35"])
def test_pre_tokenizer_ids_match_transformers(tmp_path, smollm2_vocab, pre):
    path = smollm2_vocab_file(tmp_path / f"{pre}.gguf", smollm2_vocab, pre)
    tokenizer, reference = ours(path), reference_tokenizer(path)
    for text in SPLIT_TEXTS:
        assert tokenizer.encode(text) == reference.encode(text), text


def test_unknown_pre_tokenizer_is_refused(tmp_path, smollm2_vocab):
    path = smollm2_vocab_file(tmp_path / "mystery.gguf", smollm2_vocab, "not-a-pre-tokenizer")
    with pytest.raises(TokenizerError, match=r"mystery\.gguf.*tokenizer\.ggml\.pre='not-a-pre-tokenizer'"):
        ours(path)


# ----------------------------------------------------------------- add_eos_token (bug2)


def small_vocab_file(path: Path, add_eos: bool) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["<s>", "</s>", *BYTE_TOKENS, "ab", "Ġab"])
    writer.add_token_types([3, 3] + [1] * 258)
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(add_eos)
    writer.add_tensor("token_embd.weight", np.zeros((260, 8), np.float32))
    finish(writer)
    return path


def test_add_eos_token_is_read_but_prompts_get_no_eos(tmp_path):
    path = small_vocab_file(tmp_path / "eos.gguf", add_eos=True)
    tokenizer, reference = ours(path), reference_tokenizer(path)
    assert tokenizer.add_eos is True and reference.add_eos_token is True
    expected = reference.encode("ab ab")
    assert expected == [0, 258, 259, 1] and expected[-1] == tokenizer.eos_id
    assert tokenizer.encode("ab ab") == expected[:-1]  # a prompt goes on: no EOS
    plain = small_vocab_file(tmp_path / "no-eos.gguf", add_eos=False)
    assert ours(plain).add_eos is False and reference_tokenizer(plain).add_eos_token is False


def test_bad_add_eos_token_names_file_and_key(tmp_path):
    def tokenizer(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(["<|endoftext|>", *BYTE_TOKENS])
        writer.add_token_merges([])
        writer.add_eos_token_id(0)
        writer.add_uint32("tokenizer.ggml.add_eos_token", 7)
        return 257

    path = tiny_llama(tmp_path / "bad-eos.gguf", tokenizer=tokenizer)
    with pytest.raises(TokenizerError, match=r"bad-eos\.gguf.*tokenizer\.ggml\.add_eos_token"):
        ours(path)


# ----------------------------------------------------------------- a role token outside the byte alphabet (bug3)


DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def deepseek_style_tokenizer(writer) -> int:
    """As llama.cpp's converter writes a DeepSeek-R1-Distill-Llama vocabulary: the added
    tokens in plain UTF-8 text, typed CONTROL."""
    tokens = [*BYTE_TOKENS, DS_BOS, DS_EOS, "ab", "Ġab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 1, 1])
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_add_bos_token(True)
    return len(tokens)


def test_role_token_outside_byte_alphabet_keeps_the_files_id(tmp_path):
    path = tiny_llama(tmp_path / "ds-distill.gguf", tokenizer=deepseek_style_tokenizer, d_model=32, n_heads=2,
                      n_kv=2, n_layers=1)
    fields = gguf.GGUFReader(str(path)).fields
    bos, eos = (int(fields[f"tokenizer.ggml.{role}_token_id"].contents()) for role in ("bos", "eos"))
    model = lucidlm.load(str(path))
    tokenizer = model.tokenizer
    assert (tokenizer.bos_id, tokenizer.eos_id) == (bos, eos) == (256, 257)
    assert (tokenizer.bos_token, tokenizer.eos_token) == (DS_BOS, DS_EOS)
    # transformers gives the role token a new id (past the vocabulary), but splits the text alike
    reference = reference_tokenizer(path)
    expected = reference.encode(" ab ab")
    assert expected[0] >= 260 and tokenizer.encode(" ab ab") == [bos, *expected[1:]] == [256, 259, 259]
    assert tokenizer.encode("ab") == [256, 258]
    # the chat-template text of the role token is that token, as llama.cpp parses it
    assert tokenizer.encode(f"{DS_BOS}ab{DS_EOS}") == [256, 256, 258, 257]
    assert tokenizer.decode([256, 258, 257]) == f"{DS_BOS}ab{DS_EOS}"
    assert model.config.vocab_size == 260


# ----------------------------------------------------------------- sentencepiece llama files (bug4)


SPM_TEXTS = ["Hello world", " ab", "  two leading spaces", "line one\nline two\n\n", "\n starts with a newline",
             "byte fallback: 日本語 ✓ 🤗", "tabs\tand   runs   of spaces ", "<s>ab</s>", "", "a"]


def gemma_vocab_as_llama(writer, size: int = 20000) -> int:
    """The first ``size`` tokens of Gemma 3's real sentencepiece vocabulary, with its real
    scores and types, written as a Llama-style (``tokenizer.ggml.model = "llama"``) file."""
    meta = read_metadata(open_gguf(find_gguf("gemma3-270m")))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(meta["tokenizer.ggml.tokens"][:size])
    writer.add_token_scores(meta["tokenizer.ggml.scores"][:size])
    writer.add_token_types(meta["tokenizer.ggml.token_type"][:size])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    return size


def test_sentencepiece_vocabulary_ids_match_transformers(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    size = gemma_vocab_as_llama(writer)
    writer.add_tensor("token_embd.weight", np.zeros((size, 8), np.float32))
    finish(writer)
    path = tmp_path / "spm.gguf"
    tokenizer, reference = ours(path), reference_tokenizer(path)
    assert tokenizer.add_bos is True and reference.add_bos_token is True  # no add_bos_token key: llama.cpp's default
    for text in SPM_TEXTS:
        expected = reference.encode(text)
        assert tokenizer.encode(text) == expected, text
        assert tokenizer.decode(expected) == reference.decode(expected), text
    assert any(tokenizer.backend.id_to_token(i).startswith("<0x")
               for i in tokenizer.encode("日本語 🤗"))  # the byte fallback was exercised


def tinyllama_tokenizer(writer) -> int:
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)],
              "\u2581", "\u2581a", "b", "\u2581ab", "a", "\u2581the", "he", "\u2581t", "h", "e", "t"]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -0.5, -4.0, -0.2, -2.5, -1.5, -5.0, -5.0, -5.0]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 11)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    return len(tokens)


def test_sentencepiece_llama_file_loads_like_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_llama(tmp_path / "tinyllama-like.gguf", meta={"rope.dimension_count": 16},
                      tokenizer=tinyllama_tokenizer, d_model=32, n_heads=2, n_kv=2)
    model = lucidlm.load(str(path))
    reference_tok = reference_tokenizer(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
    for text in ["the ab", " ab", "  the\nthe", "hét ab"]:
        expected = reference_tok.encode(text)
        assert model.tokenizer.encode(text) == expected, text
        assert model.tokenizer.decode(expected) == reference_tok.decode(expected)
    ids = torch.tensor([reference_tok.encode("the ab the ab hét")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- metadata edges (bug5, bug6, bug7)


def test_per_layer_kv_head_counts_read_when_uniform(tmp_path):
    path = tiny_llama(tmp_path / "kv-array.gguf", meta={"attention.head_count_kv": [2, 2]})
    assert list(gguf.GGUFReader(str(path)).fields["llama.attention.head_count_kv"].contents()) == [2, 2]
    assert load_gguf(path).config.n_kv_heads == 2


def test_per_layer_kv_head_counts_that_differ_are_refused(tmp_path):
    path = tiny_llama(tmp_path / "kv-mixed.gguf", meta={"attention.head_count_kv": [2, 4]})
    with pytest.raises(UnsupportedArchitectureError, match=r"kv-mixed\.gguf.*head_count_kv gives layer 1 4"):
        load_gguf(path)
    short = tiny_llama(tmp_path / "kv-short.gguf", meta={"attention.head_count_kv": [2]})
    with pytest.raises(GGUFError, match=r"kv-short\.gguf.*head_count_kv.*1 per-layer values for block_count=2"):
        load_gguf(short)


@pytest.mark.parametrize("meta", [{"rope.dimension_count": 8}, {"rope.dimension_count": 8, "attention.key_length": 16}])
def test_partial_rotary_is_named_with_or_without_key_length(tmp_path, meta):
    # head size 64 / 4 = 16 (llama.cpp's default for key_length), RoPE over 8 of it
    path = tiny_llama(tmp_path / "partial.gguf", meta=meta)
    with pytest.raises(UnsupportedArchitectureError, match=r"partial\.gguf: RoPE rotates 8 of 16 head dimensions"):
        load_gguf(path)


def test_rope_dimension_count_as_head_size_still_loads(tmp_path):
    # no key_length, rope.dimension_count 32 != 64 / 4: transformers reads it as the head size
    path = tiny_llama(tmp_path / "wide-heads.gguf", meta={"rope.dimension_count": 32}, head_dim=32)
    assert load_gguf(path).config.head_dim == 32


def byte_tokenizer_with_sampling(sampling: dict):
    """A GGUF byte-level tokenizer writer (vocabulary 257) that also writes ``general.sampling.*`` keys."""
    def tokenizer(writer):
        for key, value in sampling.items():
            (writer.add_int32 if isinstance(value, int) else writer.add_float32)(key, value)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(["<|endoftext|>", *BYTE_TOKENS])
        writer.add_token_merges([])
        writer.add_eos_token_id(0)
        return 257
    return tokenizer


@pytest.mark.parametrize("key,value", [("general.sampling.top_p", 7.0), ("general.sampling.temp", -1.0),
                                       ("general.sampling.top_k", -3)])
def test_bad_sampling_metadata_is_refused_at_load(tmp_path, key, value):
    path = tiny_llama(tmp_path / "sampling.gguf", tokenizer=byte_tokenizer_with_sampling({key: value}))
    with pytest.raises(GGUFError, match=rf"sampling\.gguf: field '{key}' is"):
        lucidlm.load(str(path))


def test_good_sampling_metadata_is_kept(tmp_path):
    sampling = {"general.sampling.top_p": 0.5, "general.sampling.top_k": 20}
    path = tiny_llama(tmp_path / "sampling-ok.gguf", tokenizer=byte_tokenizer_with_sampling(sampling))
    assert lucidlm.load(str(path)).generation_defaults == {"top_p": 0.5, "top_k": 20}
