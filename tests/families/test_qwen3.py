"""Qwen 3 (``Qwen3ForCausalLM``, GGUF ``qwen3``) on tiny random models written here, against
transformers: per-head q/k RMSNorm (plain weight * x, rms_norm_eps) before RoPE, a head_dim
unlike hidden/heads, attention_bias on all four projections; a Hugging Face folder and a GGUF
(F32, Q8_0, Q4_0, every load path) give transformers' logits and greedy tokens, and the export
is a Qwen 3 folder again."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

import lucidlm
from lucidlm.weights.hf import save_hf

from lucidlm.model.decode_block import _plan
from lucidlm.quantization import blocks_kernel
from qwen_toys import (QUANTIZED_ATOL, assert_gguf_logits, assert_picks_are_references, assert_quantized_logits,
                       assert_same_greedy, assert_same_logits, checked_dequantized_state, hf_qwen, logits,
                       our_greedy, run_convert, token_batch, with_weights, write_gguf_variants)

HEAD_DIM = 32  # hidden_size 64 / 4 heads would be 16


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def saved(request, tmp_path_factory):
    hf = hf_qwen("qwen3", tie=request.param, seed=20 + int(request.param), head_dim=HEAD_DIM)
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return hf, path


def test_folder_logits_match_transformers(saved):
    hf, path = saved
    ours = lucidlm.load(path)
    cfg = ours.config
    assert (cfg.name, cfg.qk_norm, cfg.head_dim, cfg.attn_bias, cfg.norm_eps) == ("qwen3", True, HEAD_DIM, False, 1e-6)
    # the q/k norms hold transformers' own scales (no Gemma-style 1 + weight), spread around 1
    assert_close(ours.blocks[0].attn.q_norm.weight, hf.model.layers[0].self_attn.q_norm.weight)
    assert_same_logits(ours, hf, token_batch(seed=1))


def test_greedy_generation_matches_transformers(saved):
    assert_same_greedy(*saved)


def test_hook_q_and_normed_rotation_inputs_match_transformers(saved):
    hf, path = saved
    ids = token_batch(seed=3)
    attention, seen = hf.model.layers[0].self_attn, {}
    hooks = [attention.q_proj.register_forward_hook(lambda m, i, o: seen.setdefault("q", o)),
             attention.k_norm.register_forward_hook(lambda m, i, o: seen.setdefault("k_normed", o))]
    try:
        logits(hf, ids)
    finally:
        for hook in hooks:
            hook.remove()
    ours = lucidlm.load(path)
    _, cache = ours.run_with_cache(ids)
    assert_close(cache["blocks.0.attn.hook_q"], seen["q"].view(2, 24, 4, HEAD_DIM), atol=1e-5, rtol=1e-5)
    # k after the per-head norm (B, T, n_kv, hd): x / rms(x) from its hook, times the norm's weight
    normed = cache["blocks.0.attn.k_norm.hook_normalized"] * ours.blocks[0].attn.k_norm.weight
    assert_close(normed, seen["k_normed"], atol=1e-5, rtol=1e-5)


def test_attention_bias_covers_all_four_projections(tmp_path):
    hf = hf_qwen("qwen3", seed=23, head_dim=HEAD_DIM, attention_bias=True)
    hf.save_pretrained(tmp_path / "hf")
    ours = lucidlm.load(tmp_path / "hf")
    assert ours.config.attn_bias and ours.config.attn_out_bias
    ids = token_batch(seed=4)
    assert_close(logits(ours, ids), logits(hf, ids), atol=1e-4, rtol=1e-4)
    save_hf(ours, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["attention_bias"] is True
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert_close(logits(back, ids), logits(hf, ids), atol=1e-5, rtol=1e-5)


def test_head_dim_left_out_of_config_json_is_128(tmp_path):
    """Qwen3Config's default, not hidden_size / num_attention_heads (LLaMA's)."""
    hf = hf_qwen("qwen3", seed=24, head_dim=128)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = lucidlm.load(tmp_path)
    assert ours.config.head_dim == 128
    ids = token_batch(seed=5)
    assert_close(logits(ours, ids), logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_export_is_a_qwen3_folder_transformers_reads(saved, tmp_path, capsys):
    hf, path = saved
    assert run_convert(path, tmp_path / "back", "hf") == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == HEAD_DIM
    assert config["use_sliding_window"] is False and config["attention_bias"] is False
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    ids = token_batch(seed=6)
    assert_close(logits(back, ids), logits(hf, ids), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ GGUF
# head_dim 128: llama.cpp writes it as qwen3.attention.key_length; transformers' GGUF loader
# ignores that key and takes Qwen3Config's default, 128, so only that size compares with it.


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def gguf_files(request, tmp_path_factory):
    """(the transformers model, {file type: (path, the HF state dict the file stands for)})."""
    hf = hf_qwen("qwen3", tie=request.param, seed=30 + int(request.param), head_dim=128)
    return hf, write_gguf_variants(hf, "qwen3", tmp_path_factory.mktemp("qwen3_gguf"))


def test_gguf_f32_matches_transformers_and_its_gguf_loader(gguf_files):
    hf, files = gguf_files
    path, _ = files["F32"]
    ours = lucidlm.load(path)
    assert (ours.config.name, ours.config.qk_norm, ours.config.head_dim) == ("qwen3", True, 128)
    assert_gguf_logits(ours, hf, path, token_batch(seed=7))


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("quantize", [None, "gguf", "int8", "int4"])
def test_gguf_quantized_files_every_load_path(gguf_files, quant, quantize):
    hf, files = gguf_files
    path, stands_for = files[quant]
    ours = lucidlm.load(path, dtype=torch.float32, quantize=quantize)
    assert_quantized_logits(ours, hf, stands_for, quantize, token_batch(seed=8))


def test_quantized_generation_matches_its_dequantized_reference(gguf_files):
    """Qwen 3 has no biases, so its int4 blocks take the one-call decode step with the q/k norms
    (model/decode_block.py): each greedy token is transformers' pick from the same matrices, up to
    the kernels' bfloat16 rounding."""
    hf, files = gguf_files
    path, stands_for = files["Q4_0"]
    ours = lucidlm.load(path, quantize="gguf")
    if blocks_kernel.available():
        assert _plan(ours.blocks[0]) is not None
    prompt = token_batch(seed=9, rows=1, length=9)
    reference = with_weights(hf, checked_dequantized_state(ours, stands_for, "gguf"))
    assert_picks_are_references(our_greedy(ours, prompt), reference, prompt, QUANTIZED_ATOL["gguf"])
