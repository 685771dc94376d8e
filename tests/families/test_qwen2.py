"""Qwen 2 / 2.5 (``Qwen2ForCausalLM``, GGUF ``qwen2``) on tiny random models written here, against
transformers: a Hugging Face folder and a GGUF (F32, Q8_0, Q4_0, read float, with the file's own
quants and as int8/int4) give transformers' logits and greedy tokens; the export is a Qwen 2
folder again; ``use_sliding_window: true`` is refused by name.

Qwen 2's attention has q/k/v biases and no o_proj bias; in GGUF the biases come before their
weights, so a quantized load must keep a bias that arrived before its matrix."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

import lucidlm

from lucidlm.model.decode_block import _plan
from qwen_toys import (QUANTIZED_ATOL, assert_gguf_logits, assert_picks_are_references, assert_quantized_logits,
                       assert_same_greedy, assert_same_logits, checked_dequantized_state, hf_qwen, logits,
                       our_greedy, run_convert, token_batch, with_weights, write_gguf_variants)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def saved(request, tmp_path_factory):
    hf = hf_qwen("qwen2", tie=request.param, seed=int(request.param))
    path = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(path)
    return hf, path


def test_folder_logits_match_transformers(saved):
    hf, path = saved
    ours = lucidlm.load(path)
    cfg = ours.config
    assert (cfg.name, cfg.attn_bias, cfg.attn_out_bias, cfg.qk_norm) == ("qwen2", True, False, False)
    assert cfg.tie_embeddings == hf.config.tie_word_embeddings and cfg.rope_theta == 1e6
    assert_same_logits(ours, hf, token_batch(seed=1))


def test_greedy_generation_matches_transformers(saved):
    assert_same_greedy(*saved)


def test_hook_q_is_transformers_q_projection(saved):
    hf, path = saved
    ids = token_batch(seed=3)
    seen = {}
    handle = hf.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.setdefault("q", o))
    try:
        logits(hf, ids)
    finally:
        handle.remove()
    _, cache = lucidlm.load(path).run_with_cache(ids)
    q = cache["blocks.1.attn.hook_q"]  # (B, T, nh, hd)
    assert q.shape == (2, 24, 4, 16)
    assert_close(q, seen["q"].view(2, 24, 4, 16), atol=1e-5, rtol=1e-5)


def test_export_is_a_qwen2_folder_transformers_reads(saved, tmp_path, capsys):
    hf, path = saved
    assert run_convert(path, tmp_path / "back", "hf") == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["use_sliding_window"] is False and "attention_bias" not in config
    with safe_open(str(tmp_path / "back" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.bias" in names and "model.layers.0.self_attn.o_proj.bias" not in names
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    ids = token_batch(seed=4)
    assert_close(logits(back, ids), logits(hf, ids), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ GGUF


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def gguf_files(request, tmp_path_factory):
    """(the transformers model, {file type: (path, the HF state dict the file stands for)})."""
    hf = hf_qwen("qwen2", tie=request.param, seed=10 + int(request.param))
    return hf, write_gguf_variants(hf, "qwen2", tmp_path_factory.mktemp("qwen2_gguf"))


def test_gguf_f32_matches_transformers_and_its_gguf_loader(gguf_files):
    hf, files = gguf_files
    path, _ = files["F32"]
    ours = lucidlm.load(path)  # a GGUF file's default: float32
    assert (ours.config.name, ours.config.attn_bias, ours.config.attn_out_bias) == ("qwen2", True, False)
    assert_gguf_logits(ours, hf, path, token_batch(seed=5))


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("quantize", [None, "gguf", "int8", "int4"])
def test_gguf_quantized_files_every_load_path(gguf_files, quant, quantize):
    hf, files = gguf_files
    path, stands_for = files[quant]
    ours = lucidlm.load(path, dtype=torch.float32, quantize=quantize)
    ids = token_batch(seed=6)
    # the file's q/k/v biases survive, whatever the matrices became (they precede them in the file)
    for p in "qkv":
        assert_close(getattr(ours.blocks[1].attn, f"{p}_proj").bias.float(),
                     stands_for[f"model.layers.1.self_attn.{p}_proj.bias"])
    assert_quantized_logits(ours, hf, stands_for, quantize, ids)


@pytest.mark.parametrize("quantize", ["gguf", "int4"])
def test_quantized_generation_matches_its_dequantized_reference(gguf_files, quantize):
    """Decoding a biased quantized model (the one-call decode step takes no biases, so the layers'
    own modules run): each of 20 greedy tokens is transformers' pick from the same dequantized
    matrices, up to the kernels' bfloat16 rounding (a near-tie may go either way)."""
    hf, files = gguf_files
    path, stands_for = files["Q4_0"]
    ours = lucidlm.load(path, quantize=quantize)
    assert _plan(ours.blocks[0]) is None  # q/k/v biases keep the block off the one-call step
    prompt = token_batch(seed=7, rows=1, length=9)
    reference = with_weights(hf, checked_dequantized_state(ours, stands_for, quantize))
    assert_picks_are_references(our_greedy(ours, prompt), reference, prompt, QUANTIZED_ATOL[quantize])
