"""Hugging Face files and models that do not fit each other: lucidlm must refuse, never write or
load a different model without a word.

- export: a config feature LlamaForCausalLM / GPT2LMHeadModel lack (Gemma's and Qwen 3's)
  would be written as a plain model that transformers runs differently;
- import: checkpoint tensors the config has no place for (a wrong layer count, q_norm/k_norm,
  a tied config with its own lm_head) would be dropped;
- quantized checkpoints (FP8, int) would be cast to float without their scales, or crash.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import lucidlm
from lucidlm.config import ModelConfig, preset
from lucidlm.errors import ConfigError, UnsupportedArchitectureError, WeightsError
from lucidlm.model.transformer import Transformer
from lucidlm.weights import hf_names
from lucidlm.weights.finite import FiniteCheck
from lucidlm.weights.hf import load_hf, save_hf
from random_weights import randomize_

VOCAB = 101
SIZES = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128, max_seq_len=64)
IDS = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))


def hf_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    config = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return randomize_(LlamaForCausalLM(LlamaConfig(**{**config, **overrides})), seed)


def edit(directory, config=None, tensors=None):
    """Change config.json fields and/or model.safetensors tensors (a callable on the dict)."""
    if config:
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        path = directory / "model.safetensors"
        loaded = load_file(path)
        tensors(loaded)
        save_file(loaded, path, metadata={"format": "pt"})


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


# ------------------------------------------------------------------ export

@pytest.mark.parametrize("base, changes, field", [
    ("llama", dict(qk_norm=True), r"qk_norm=True"),
    ("llama", dict(sliding_window=4), r"sliding_window=4 \(2 of 2 layers attend locally\)"),
    ("llama", dict(sliding_window=4, rope_local_theta=100.0), r"rope_local_theta=100\.0 differs from rope_theta"),
    ("llama", dict(final_logit_softcap=2.0), r"final_logit_softcap=2\.0"),
    ("llama", dict(scale_embeddings=True), r"scale_embeddings=True"),
    ("llama", dict(query_pre_attn_scalar=4.0), r"query_pre_attn_scalar=4\.0.*1/sqrt\(head_dim=16\)"),
    ("llama", dict(post_sublayer_norm=True), r"post_sublayer_norm=True"),
    ("gpt2", dict(n_kv_heads=4, qk_norm=True), r"as GPT2LMHeadModel.*qk_norm=True"),
])
def test_export_refuses_features_neither_family_has(tmp_path, base, changes, field):
    # Each of these exported as a plain LlamaForCausalLM before: transformers' logits were off by 2-6.
    model = Transformer(preset(base, **{**SIZES, **changes}))
    with pytest.raises(ConfigError, match=r"cannot be exported to Hugging Face.*" + field + r".*convert --to lucidlm"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_gemma3(tmp_path):
    config = preset("gemma3-270m", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                    d_mlp=64, max_seq_len=64)
    # Gemma 3 has none of LLaMA's pieces beyond RoPE and RMSNorm: every difference is named.
    with pytest.raises(ConfigError, match=r"mlp='geglu'.*qk_norm=True.*sliding_window=.*scale_embeddings=True.*"
                                          r"query_pre_attn_scalar=.*post_sublayer_norm=True"):
        save_hf(Transformer(config), tmp_path / "out")


@pytest.mark.parametrize("changes", [dict(query_pre_attn_scalar=16.0),  # = head_dim: the usual scale
                                     dict(sliding_window=4, global_layer_every=1)])  # every layer global
def test_export_allows_features_that_change_nothing(tmp_path, changes):
    # The refusals look at what the model computes, not at the field being set: transformers
    # must compute the same logits as ours from what was written.
    torch.manual_seed(5)
    ours = randomize_(Transformer(preset("llama", **{**SIZES, **changes})), seed=5)
    save_hf(ours, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want = logits(theirs)
    assert want.std() > 0.3
    assert_close(logits(ours), want)


def test_export_refuses_tensors_without_a_hugging_face_name(tmp_path, monkeypatch):
    # The safety net behind export_family: were a feature forgotten there, its tensors would be
    # left out of the file. Here export_family is made to overlook qk_norm.
    monkeypatch.setattr(hf_names, "_common_export_problems", lambda cfg: [])
    model = Transformer(preset("llama", **SIZES, qk_norm=True))
    with pytest.raises(ConfigError, match=r"as LlamaForCausalLM: 4 of its tensors have no LlamaForCausalLM name.*"
                                          r"'blocks\.0\.attn\.k_norm\.weight'"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_quantized_model(tmp_path):
    # It wrote only the norms before (the int8 codes had no Hugging Face name).
    model = lucidlm.load("llama", random_init=True, seed=1, **SIZES, quantize="int8")
    with pytest.raises(ConfigError, match=r"quantized.*weight_int8.*without quantize="):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ import: tensors left over

def test_more_layers_in_the_file_than_in_config_is_refused(tmp_path):
    hf_llama().save_pretrained(tmp_path)
    edit(tmp_path, config=dict(num_hidden_layers=1))  # loaded as a truncated 1-layer model before
    with pytest.raises(WeightsError, match=r"9 tensor\(s\).*'model\.layers\.1\.input_layernorm\.weight'.*"
                                           r"layers 0\.\.1 but config\.json's num_hidden_layers=1"):
        load_hf(tmp_path)


def test_qwen3_checkpoint_labelled_llama_is_refused(tmp_path):
    # Qwen 3 is LLaMA plus q_norm/k_norm; read as LLaMA, those norms were dropped.
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    randomize_(Qwen3ForCausalLM(config), 0).save_pretrained(tmp_path)
    edit(tmp_path, config=dict(architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(WeightsError, match=r"4 tensor\(s\).*'model\.layers\.0\.self_attn\.k_norm\.weight'.*"
                                           r"architecture variant lucidlm does not implement"):
        load_hf(tmp_path)


def test_bias_tensors_the_config_denies_are_refused_naming_the_flag(tmp_path):
    hf_llama(attention_bias=True).save_pretrained(tmp_path)
    edit(tmp_path, config=dict(attention_bias=False))
    with pytest.raises(WeightsError, match=r"8 tensor\(s\).*'model\.layers\.0\.self_attn\.k_proj\.bias'.*"
                                           r"config\.json's attention_bias / mlp_bias say there are none"):
        load_hf(tmp_path)


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path):
    hf = hf_llama(seed=1)
    hf.save_pretrained(tmp_path)
    edit(tmp_path, config=dict(tie_word_embeddings=True))
    # transformers (5.x) unties and uses the file's lm_head; lucidlm used the embedding: the
    # file is ambiguous, so it is refused rather than read either way.
    assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path).eval()), logits(hf))
    with pytest.raises(WeightsError, match=r"tie_word_embeddings=true, but the file's 'lm_head\.weight' differs "
                                           r"from 'model\.embed_tokens\.weight'"):
        load_hf(tmp_path)


def test_harmless_extra_tensors_still_load(tmp_path):
    # A tied model saved with its lm_head written out too, and RoPE's inv_freq buffers (older
    # transformers saved them): nothing the model lacks, so it loads and matches transformers.
    hf = hf_llama(seed=2, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)

    def add(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    edit(tmp_path, tensors=add)
    want = logits(hf)
    assert want.std() > 0.3
    assert_close(logits(load_hf(tmp_path)), want)


# ------------------------------------------------------------------ import: quantized checkpoints

def test_quantization_config_is_refused_naming_the_method(tmp_path):
    hf_llama().save_pretrained(tmp_path)
    edit(tmp_path, config=dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    with pytest.raises(UnsupportedArchitectureError, match=r"config\.json: the checkpoint is quantized .*"
                                                           r"quant_method='fp8'.*quantize="):
        lucidlm.load(tmp_path)


@pytest.mark.parametrize("dtype, name", [(torch.float8_e4m3fn, "float8_e4m3fn"), (torch.int8, "int8")])
def test_quantized_tensor_dtype_is_refused_naming_it(tmp_path, dtype, name):
    # Without a quantization_config: an FP8 weight crashed the finiteness check with a raw
    # NotImplementedError; an int8 one would have been cast to float without its scales.
    hf_llama().save_pretrained(tmp_path)

    def quantize(tensors):
        weight = tensors["model.layers.0.mlp.up_proj.weight"]
        tensors["model.layers.0.mlp.up_proj.weight"] = weight.to(dtype) if dtype.is_floating_point else \
            (weight * 100).round().to(dtype)
        tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(1)
    edit(tmp_path, tensors=quantize)
    with pytest.raises(WeightsError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' is stored as " + name +
                                           r", a quantized format.*float32, float16 or bfloat16"):
        lucidlm.load(tmp_path)


@pytest.mark.parametrize("dtype, bad, count", [(torch.float8_e4m3fn, float("nan"), "1 NaN"),
                                               (torch.float8_e5m2, float("inf"), "1 infinite")])
def test_finite_check_reads_float8(dtype, bad, count):
    check = FiniteCheck("f")
    check.add("ok", torch.tensor([1.0, -2.0, 448.0 if dtype == torch.float8_e4m3fn else 5e4]).to(dtype))
    check.verify()  # finite float8 passes
    check.add("w", torch.tensor([1.0, bad, 0.5]).to(dtype))
    with pytest.raises(WeightsError, match=r"f: tensor 'w' holds " + count):
        check.verify()
