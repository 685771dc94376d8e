"""RoPE frequency scaling (Llama 3.1's llama3 rule, linear, a GGUF's rope_freqs) against transformers.

Each case builds the reference in transformers on the same weights and compares logits at
positions past the scaling's original context, where a model read unscaled differs (each test
also checks that, so a loader that ignored the scaling would fail).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import lucidlm
from lucidlm.config import ModelConfig
from lucidlm.errors import ConfigError, GGUFError
from lucidlm.model.transformer import Transformer
from lucidlm.weights.gguf import load_gguf
from lucidlm.weights.hf import save_hf

from test_gguf import D_MLP, D_MODEL, HEAD_DIM, N_HEADS, N_KV, VOCAB, tiny_weights, to_gguf_layout, write_llama_gguf
from test_meta_llama3 import converter, write_meta_checkpoint  # noqa: F401  (converter: a fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LLAMA3 = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def hf_llama(rope_scaling, seed=0, **sizes):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024, rope_theta=500000.0, tie_word_embeddings=True)
    torch.manual_seed(seed)
    # (a copy: transformers writes rope_theta into the dict it is given)
    copied = dict(rope_scaling) if rope_scaling else None
    return LlamaForCausalLM(LlamaConfig(**{**settings, **sizes, "rope_scaling": copied})).eval()


def unscaled(model: Transformer) -> Transformer:
    """The same weights read without the scaling: what a loader ignoring it would give."""
    plain = Transformer(model.config.replace(rope_scaling=None))
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def check_against(ours: Transformer, expected: torch.Tensor, ids: torch.Tensor, tolerance: float = 1e-4) -> None:
    with torch.no_grad():
        got = ours(ids)
        ignored = unscaled(ours)(ids)
    assert expected.std() > 0.1
    assert (ignored - expected).abs().max() > 10 * tolerance  # the scaling matters at these positions
    assert_close(got, expected, atol=tolerance, rtol=tolerance)


# ----------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_hf_scaled_rope_matches_transformers(tmp_path, scaling):
    hf = hf_llama(scaling)
    hf.save_pretrained(tmp_path)
    ours = lucidlm.load(tmp_path)
    assert ours.config.rope_scaling == scaling
    ids = torch.randint(0, 96, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    check_against(ours, expected, ids)


def test_pre_v5_rope_scaling_spelling_and_defaults(tmp_path):
    """transformers 4's config.json: top-level rope_theta and rope_scaling with "type"; the
    llama3 parameters llama.cpp's converter defaults (low 1, high 4, original 8192) filled."""
    hf = hf_llama({"rope_type": "linear", "factor": 2.0})
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0,
                                                      "rope_scaling": {"type": "linear", "factor": 2.0}}))
    assert lucidlm.load(tmp_path).config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    cfg = ModelConfig(rope_scaling={"rope_type": "llama3", "factor": 8})
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}


def test_greedy_generation_past_the_original_context_matches_transformers(tmp_path):
    hf = hf_llama(LLAMA3, seed=3)
    hf.save_pretrained(tmp_path)
    ours = lucidlm.load(tmp_path)
    prompt = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                               do_sample=False)[0, 150:].tolist()
    assert ours.generate(prompt[0].tolist(), max_new_tokens=20, temperature=0).token_ids == expected


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_export_keeps_the_scaling_for_transformers(tmp_path, scaling):
    from transformers import AutoModelForCausalLM

    ours = lucidlm.load("llama", random_init=True, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=96,
                        max_seq_len=512, rope_theta=500000.0, rope_scaling=scaling)
    save_hf(ours, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == scaling["rope_type"]
    ids = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids).logits
    check_against(ours, expected, ids)


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("rule", ["yarn", "dynamic", "longrope"])
def test_other_scalings_are_refused_by_name(tmp_path, spelling, rule):
    hf = hf_llama(None)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, spelling: {"rope_type": rule, "factor": 4.0,
                                                                            "rope_theta": 500000.0}}))
    with pytest.raises(lucidlm.errors.UnsupportedArchitectureError, match=rf"'{rule}' is not implemented.*'llama3'"):
        lucidlm.load(tmp_path)



@pytest.mark.parametrize("where", ["top level", "rope_parameters"])
@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_partial_rotary_factor_with_a_scaling_is_refused(tmp_path, where, scaling):
    """transformers' scaled rules size their frequencies by partial_rotary_factor, which LLaMA's
    forward pass cannot apply (it raises); lucidlm turned every pair, silently."""
    from transformers import AutoModelForCausalLM

    hf_llama(scaling).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (config if where == "top level" else config["rope_parameters"])["partial_rotary_factor"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with pytest.raises(RuntimeError, match="must match the size"), torch.no_grad():
        reference(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(lucidlm.errors.UnsupportedArchitectureError,
                       match=rf"partial_rotary_factor=0\.5 with RoPE scaling '{scaling['rope_type']}'.*partial rotary"):
        lucidlm.load(tmp_path)


def test_partial_rotary_factor_of_plain_rope_is_ignored_as_in_transformers(tmp_path):
    """LLaMA's default rotation in transformers turns the whole head whatever the factor says."""
    from transformers import AutoModelForCausalLM

    hf_llama(None).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.5}))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_close(lucidlm.load(tmp_path)(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)

@pytest.mark.parametrize("bad, message", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, r"must exceed"),
    ({"rope_type": "linear", "factor": -2.0}, r"rope_scaling\.factor.*-2"),
    ({"rope_type": "linear"}, r"rope_scaling\.factor.*missing"),
])
def test_bad_scaling_values_name_the_field(tmp_path, bad, message):
    hf = hf_llama(None)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": bad}))
    with pytest.raises(ConfigError, match=message):
        lucidlm.load(tmp_path)


def test_scaling_needs_rope_and_known_parameters():
    with pytest.raises(ConfigError, match=r"rope_scaling.*positions='learned'"):
        ModelConfig(positions="learned", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match=r"no parameter 'beta_fast'; its parameters are factor"):
        ModelConfig(rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 32})


# ----------------------------------------------------------------------------- GGUF


def llama_cpp_rope_freqs(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) writes as rope_freqs for a
    llama3 rope_scaling: float32 frequencies, the original context from the top-level
    hyperparameters (8192 when absent, as in every Llama 3.1/3.2 config.json)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high, old = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"], 8192
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


HF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_from_gguf_weights(weights: dict, n_layers: int, rope_scaling):
    """transformers' LlamaForCausalLM holding ``tiny_weights`` (Hugging Face layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=D_MLP, num_hidden_layers=n_layers,
                         num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HEAD_DIM,
                         max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(rope_scaling) if rope_scaling else None, tie_word_embeddings=True)
    hf = LlamaForCausalLM(config).eval()
    state = {"model.embed_tokens.weight": weights["token_embd.weight"], "model.norm.weight": weights["output_norm.weight"]}
    for name, value in weights.items():
        parts = name.split(".")
        if parts[0] == "blk":
            state[f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.weight"] = value
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf


def gguf_with(tmp_path: Path, weights: dict, extra_tensors=None, extra=None) -> Path:
    tensors = {k: to_gguf_layout(k, v) for k, v in weights.items()} | (extra_tensors or {})
    return write_llama_gguf(tmp_path / "scaled.gguf", tensors, 2, extra=extra)


GGUF_IDS = torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(6))


def test_gguf_rope_freqs_of_llama3_read_as_the_llama3_rule(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    weights = tiny_weights(2, seed=7)
    path = gguf_with(tmp_path, weights, {"rope_freqs.weight": llama_cpp_rope_freqs(scaling, HEAD_DIM, 10000.0)})
    ours = load_gguf(path)
    assert ours.config.rope_scaling == scaling
    hf = hf_from_gguf_weights(weights, 2, scaling)
    with torch.no_grad():
        expected = hf(GGUF_IDS).logits
    check_against(ours, expected, GGUF_IDS)
    # ... and it exports to transformers as llama3, with the same logits
    from transformers import AutoModelForCausalLM

    save_hf(ours, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert exported.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        assert_close(exported(GGUF_IDS).logits, expected, atol=1e-4, rtol=1e-4)


def test_gguf_rope_freqs_of_no_rule_divide_each_frequency(tmp_path):
    """Divisors that follow no llama3 rule: llama.cpp divides pair i's frequency by value i.
    Reference: transformers' rotary embedding with its inverse frequencies divided so."""
    weights = tiny_weights(2, seed=8)
    factors = np.random.default_rng(3).uniform(1.0, 6.0, HEAD_DIM // 2).astype(np.float32)
    ours = load_gguf(gguf_with(tmp_path, weights, {"rope_freqs.weight": factors}))
    assert ours.config.rope_scaling["rope_type"] == "frequency_factors"
    hf = hf_from_gguf_weights(weights, 2, None)
    rotary = hf.model.rotary_emb
    inverse = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    rotary.inv_freq.copy_((inverse / torch.from_numpy(factors).double()).float())
    with torch.no_grad():
        expected = hf(GGUF_IDS).logits
    check_against(ours, expected, GGUF_IDS)
    with pytest.raises(ConfigError, match=r"frequency_factors.*'linear' or 'llama3'"):
        save_hf(ours, tmp_path / "hf")


def test_gguf_linear_scaling_matches_transformers(tmp_path):
    weights = tiny_weights(2, seed=9)

    def extra(writer):
        writer.add_string("llama.rope.scaling.type", "linear")
        writer.add_float32("llama.rope.scaling.factor", 4.0)

    ours = load_gguf(gguf_with(tmp_path, weights, extra=extra))
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with torch.no_grad():
        expected = hf_from_gguf_weights(weights, 2, {"rope_type": "linear", "factor": 4.0})(GGUF_IDS).logits
    check_against(ours, expected, GGUF_IDS)


@pytest.mark.parametrize("factors, message", [
    (np.ones(HEAD_DIM, dtype=np.float32), r"rope_freqs\.weight is F32 of shape \[64\].*one float32 divisor per rotated pair \(32\)"),
    (np.zeros(HEAD_DIM // 2, dtype=np.float32), r"not a positive finite number"),
])
def test_bad_rope_freqs_are_named(tmp_path, factors, message):
    path = gguf_with(tmp_path, tiny_weights(2), {"rope_freqs.weight": factors})
    with pytest.raises(GGUFError, match=message):
        load_gguf(path)


def test_quantized_gguf_path_rotates_like_the_float_path(tmp_path):
    """quantize="int8" keeps the model's scaled rotation tables on its kernels' path: its logits
    follow a float model holding its dequantized weights, scaled, far closer than unscaled."""
    from lucidlm.quantization.base import QuantizedLinear

    factors = np.random.default_rng(4).uniform(4.0, 8.0, HEAD_DIM // 2).astype(np.float32)
    path = gguf_with(tmp_path, tiny_weights(2, seed=7), {"rope_freqs.weight": factors})
    quantized = lucidlm.load(path, quantize="int8", quantize_embeddings=False)
    assert quantized.config.rope_scaling["rope_type"] == "frequency_factors"
    dequantized = load_gguf(path)
    assert torch.equal(quantized.rotary.cos, dequantized.rotary.cos)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantizedLinear):
                dequantized.get_submodule(name).weight.copy_(module.dequantize())
        got, expected = quantized(GGUF_IDS), dequantized(GGUF_IDS)
        ignored = unscaled(dequantized)(GGUF_IDS)
    # int8's error against the scaling's effect, past the first positions (where it is small)
    error, effect = (got - expected)[:, 64:].abs().mean(), (ignored - expected)[:, 64:].abs().mean()
    assert error < 0.1 * effect


# ----------------------------------------------------------------------------- Meta params.json


def test_meta_use_scaled_rope_matches_transformers_conversion(tmp_path, converter):  # noqa: F811
    from transformers import AutoModelForCausalLM

    meta = write_meta_checkpoint(tmp_path / "meta", seed=5, params={"use_scaled_rope": True})
    vocab = json.loads((meta / "params.json").read_text())["vocab_size"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converter.write_model(str(tmp_path / "hf"), str(meta), llama_version="3.1", vocab_size=vocab, num_shards=1)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = lucidlm.load(meta)
    assert ours.config.rope_scaling["factor"] == hf.config.rope_parameters["factor"] == 8.0
    ids = torch.randint(0, vocab, (1, 2048), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    # transformers turns position 2000 in float32 (~1e-4 rad off), lucidlm in float64
    check_against(ours, expected, ids, tolerance=2e-3)


def test_llama3_original_context_comes_from_max_position_embeddings_as_in_transformers(tmp_path):
    """A llama3 dict without original_max_position_embeddings: transformers' standardize_rope_params
    takes max_position_embeddings (a top-level original_max_position_embeddings first)."""
    hf = hf_llama({"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                  max_position_embeddings=512)
    hf.save_pretrained(tmp_path)
    ours = lucidlm.load(tmp_path)
    assert ours.config.rope_scaling["original_max_position_embeddings"] == \
        hf.config.rope_parameters["original_max_position_embeddings"] == 512
    ids = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
    check_against(ours, expected, ids)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"].pop("original_max_position_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "original_max_position_embeddings": 128}))
    assert lucidlm.load(tmp_path).config.rope_scaling["original_max_position_embeddings"] == 128


def test_a_bad_value_is_named_under_the_key_the_file_uses(tmp_path):
    hf = hf_llama(None)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": {
        "rope_type": "linear", "factor": -2.0, "rope_theta": 10000.0}}))
    with pytest.raises(ConfigError, match=r"config\.json: field 'rope_parameters\.factor' is -2"):
        lucidlm.load(tmp_path)
