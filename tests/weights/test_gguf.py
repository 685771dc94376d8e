"""GGUF loading on tiny LLaMA files written here with ``gguf.GGUFWriter``.

- Q/K layout: a float32 GGUF (Q/K permuted the way llama.cpp's converter does) gives the
  same logits in lucidlm as in transformers reading the same file, on a 48-token prompt.
- Every quantization type: our dequantized weights are exactly ``gguf.quants.dequantize``
  of the stored bytes, and close to the original weights where gguf can quantize.
- Loading reads the file directly: old float32 conversion caches are removed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch.testing import assert_close

from lucidlm.config import ModelConfig
from lucidlm.model.positions import permute_qk_to_half, permute_qk_to_interleaved
from lucidlm.model.transformer import Transformer
from lucidlm.tokenizers.bpe import bytes_to_unicode
from lucidlm.weights.gguf import load_gguf
from lucidlm.weights.state import load_into

D_MODEL, N_HEADS, N_KV, HEAD_DIM, D_MLP = 256, 4, 2, 64, 512  # rows of 256: K-quant blocks fit
EXTRA_TOKENS = ["ab", "cd", "ef", "Ġab"]  # made by merges, so the vocabulary is a real BPE one
MERGES = ["a b", "c d", "e f", "Ġ ab"]
VOCAB = 256 + len(EXTRA_TOKENS) + 1  # bytes, merged tokens, <|endoftext|>


def tiny_weights(n_layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under GGUF names, Q/K in the Hugging Face (half) layout."""
    g = np.random.default_rng(seed)

    def mat(out_dim: int, in_dim: int) -> np.ndarray:
        return (g.standard_normal((out_dim, in_dim)) * 0.15).astype(np.float32)

    def scale(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * g.standard_normal(dim)).astype(np.float32)

    w = {"token_embd.weight": mat(VOCAB, D_MODEL), "output_norm.weight": scale(D_MODEL)}
    for i in range(n_layers):
        w |= {
            f"blk.{i}.attn_norm.weight": scale(D_MODEL),
            f"blk.{i}.attn_q.weight": mat(N_HEADS * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_k.weight": mat(N_KV * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_v.weight": mat(N_KV * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_output.weight": mat(D_MODEL, N_HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": scale(D_MODEL),
            f"blk.{i}.ffn_gate.weight": mat(D_MLP, D_MODEL),
            f"blk.{i}.ffn_up.weight": mat(D_MLP, D_MODEL),
            f"blk.{i}.ffn_down.weight": mat(D_MODEL, D_MLP),
        }
    return w


def to_gguf_layout(name: str, weight: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter stores: Q/K rows permuted for interleaved RoPE."""
    if name.endswith("attn_q.weight"):
        return permute_qk_to_interleaved(torch.from_numpy(weight), N_HEADS).numpy()
    if name.endswith("attn_k.weight"):
        return permute_qk_to_interleaved(torch.from_numpy(weight), N_KV).numpy()
    return weight


def write_llama_gguf(path: Path, tensors: dict[str, np.ndarray | tuple[np.ndarray, Q]], n_layers: int,
                     architecture: str = "llama",
                     chat_template: str = "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                     alignment: int | None = None, extra: Callable[[Any], None] | None = None) -> Path:
    """A GGUF file with LLaMA metadata, a small byte-level BPE tokenizer and ``tensors``
    (float32 arrays, or (raw bytes, quantization type) pairs); ``extra(writer)`` adds more keys."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(128)
    writer.add_embedding_length(D_MODEL)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(D_MLP)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    writer.add_token_list(["<|endoftext|>", *byte_tokens, *EXTRA_TOKENS])
    writer.add_token_types([3] + [1] * (VOCAB - 1))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    if extra is not None:
        extra(writer)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            raw, kind = value
            writer.add_tensor(name, raw, raw_dtype=kind)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_f32_gguf(path: Path, n_layers: int = 2, seed: int = 0, **kwargs) -> tuple[Path, dict[str, np.ndarray]]:
    weights = tiny_weights(n_layers, seed)
    write_llama_gguf(path, {k: to_gguf_layout(k, v) for k, v in weights.items()}, n_layers, **kwargs)
    return path, weights


def prompt_ids(length: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- Q/K layout


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    return write_f32_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def test_config_and_weights_from_f32_gguf(f32_file):
    path, weights = f32_file
    model = load_gguf(path)
    cfg = model.config
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_mlp) == \
        (D_MODEL, 2, N_HEADS, N_KV, HEAD_DIM, D_MLP)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.rope_theta, cfg.rope_variant) == (VOCAB, 128, 10000.0, "half")
    assert cfg.tie_embeddings and model.unembed.weight is model.embed.weight  # no output.weight in the file
    # Q/K come back in the Hugging Face layout they had before llama.cpp's permutation.
    for ours, theirs in (("blocks.1.attn.q_proj.weight", "blk.1.attn_q.weight"),
                         ("blocks.1.attn.k_proj.weight", "blk.1.attn_k.weight"),
                         ("blocks.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                         ("ln_final.weight", "output_norm.weight")):
        assert torch.equal(model.state_dict()[ours], torch.from_numpy(weights[theirs]))


@pytest.mark.slow
def test_logits_match_transformers_on_same_gguf(f32_file):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM

    path, _ = f32_file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    ours = load_gguf(path)
    ids = prompt_ids(48)  # long enough that a wrong RoPE pairing shows
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert expected.abs().max() > 1.0  # logits far from zero, so the tolerance means something
    assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_untied_output_and_tokenizer(tmp_path):
    weights = tiny_weights(1)
    weights["output.weight"] = (np.random.default_rng(5).standard_normal((VOCAB, D_MODEL)) * 0.1).astype(np.float32)
    path = write_llama_gguf(tmp_path / "untied.gguf", {k: to_gguf_layout(k, v) for k, v in weights.items()}, 1)
    model = load_gguf(path, dtype=torch.bfloat16)
    assert not model.config.tie_embeddings and model.dtype == torch.bfloat16
    assert torch.equal(model.unembed.weight.float(), torch.from_numpy(weights["output.weight"]).bfloat16().float())
    tok = model.tokenizer
    assert tok.vocab_size == VOCAB and tok.eos_id == 0 and tok.special_tokens == {"<|endoftext|>": 0}
    # "ab" merges; " ab" merges again through "Ġ ab"; 'x' is its byte token (id 1 + byte)
    assert tok.encode("ab abx<|endoftext|>") == [257, 260, 1 + ord("x"), 0]
    assert tok.chat_template.startswith("{% for m in messages %}")


# ----------------------------------------------------------------------------- quantization types

# Types gguf can quantize, and the relative RMS error their grid allows on N(0, 0.15) weights.
QUANTIZABLE = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 6e-2, Q.Q5_1: 6e-2, Q.Q4_0: 0.12, Q.Q4_1: 0.12}
# Types gguf can only dequantize: random blocks with small fp16 scales (byte offsets of the
# scale fields inside one block, from ggml-common.h).
SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
                 Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def random_blocks(kind: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        raw[:, :, offset:offset + 2] = np.frombuffer(np.float16(2e-3).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def quantized_file(tmp_path: Path, kind: Q) -> tuple[Path, dict, dict]:
    """A 1-layer file with every matrix in ``kind``; returns (path, stored, original)."""
    weights = tiny_weights(1, seed=3)
    stored: dict[str, np.ndarray | tuple[np.ndarray, Q]] = {}
    for i, (name, w) in enumerate(weights.items()):
        w = to_gguf_layout(name, w)
        if w.ndim == 1:
            stored[name] = w
        elif kind in QUANTIZABLE:
            stored[name] = (gguf.quants.quantize(w, kind), kind)
        else:
            stored[name] = (random_blocks(kind, *w.shape, seed=i), kind)
    return write_llama_gguf(tmp_path / f"tiny-{kind.name}.gguf", stored, 1), stored, weights


@pytest.mark.parametrize("kind", [*QUANTIZABLE, *SCALE_OFFSETS], ids=lambda k: k.name)
def test_quantized_weights_and_logits(tmp_path, kind):
    path, stored, original = quantized_file(tmp_path, kind)
    model = load_gguf(path)
    ours = model.state_dict()
    reference: dict[str, torch.Tensor] = {}
    names = {"token_embd.weight": "embed.weight", "output_norm.weight": "ln_final.weight",
             "blk.0.attn_q.weight": "blocks.0.attn.q_proj.weight", "blk.0.attn_k.weight": "blocks.0.attn.k_proj.weight",
             "blk.0.attn_v.weight": "blocks.0.attn.v_proj.weight", "blk.0.attn_output.weight": "blocks.0.attn.o_proj.weight",
             "blk.0.ffn_gate.weight": "blocks.0.mlp.gate_proj.weight", "blk.0.ffn_up.weight": "blocks.0.mlp.up_proj.weight",
             "blk.0.ffn_down.weight": "blocks.0.mlp.down_proj.weight", "blk.0.attn_norm.weight": "blocks.0.ln1.weight",
             "blk.0.ffn_norm.weight": "blocks.0.ln2.weight"}
    for gguf_name, value in stored.items():
        raw, kind_ = value if isinstance(value, tuple) else (value, Q.F32)
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(raw, kind_), dtype=np.float32))
        if gguf_name.endswith("attn_q.weight"):
            expected = permute_qk_to_half(expected, N_HEADS)
        elif gguf_name.endswith("attn_k.weight"):
            expected = permute_qk_to_half(expected, N_KV)
        assert torch.equal(ours[names[gguf_name]], expected), gguf_name
        reference[names[gguf_name]] = expected
        if kind in QUANTIZABLE and expected.ndim == 2:  # the values are the original weights, up to rounding
            w = torch.from_numpy(original[gguf_name])
            assert ((expected - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()) < QUANTIZABLE[kind], gguf_name
        else:
            assert torch.isfinite(expected).all() and expected.abs().max() < 50

    # The whole model: logits equal those of a model given the reference weights directly.
    direct = Transformer.empty(ModelConfig(**{**model.config.to_dict()}))
    load_into(direct, reference, "reference")
    ids = prompt_ids(40)
    with torch.no_grad():
        got, want = model(ids), direct.eval()(ids)
    assert torch.isfinite(got).all()
    assert_close(got, want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- old conversion cache


def test_loading_removes_the_old_float32_cache(tmp_path, monkeypatch, f32_file):
    """lucidlm <= 0.1 wrote a 538 MB float32 copy (and .partial- leftovers when interrupted)
    under $LUCIDLM_CACHE; nothing reads them now, so a load deletes them and nothing else."""
    import lucidlm.pretrained as pretrained

    path, _ = f32_file
    cache = tmp_path / "cache"
    old = [cache / "smollm2-135m-0123456789abcdef", cache / ".smollm2-135m-0123456789abcdef.partial-x1y2"]
    keep = [cache / "smollm2-135m-notes", cache / "other-0123456789abcdef"]
    for directory in old + keep:
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"x")
    monkeypatch.setenv("LUCIDLM_CACHE", str(cache))
    monkeypatch.setattr(pretrained, "find_gguf", lambda name: path)
    model = pretrained.load_pretrained("smollm2-135m", dtype=torch.float32)
    assert model.config.d_model == D_MODEL
    assert not any(d.exists() for d in old) and all(d.exists() for d in keep)
