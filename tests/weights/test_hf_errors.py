"""Hugging Face directories that lucidlm cannot or must not load, and models it cannot export:
each fails with our own error type and a message that names the problem."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lucidlm.commands import convert
from lucidlm.config import ModelConfig, preset
from lucidlm.errors import (
    ConfigError,
    LucidLMError,
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    WeightsError,
)
from lucidlm.model.transformer import Transformer
from lucidlm.weights.hf import is_hf_dir, load_hf, save_hf


@pytest.fixture
def llama_dir(tmp_path):
    """A valid HF LLaMA directory written by save_hf (its parity is tested in test_hf_llama.py)."""
    torch.manual_seed(0)
    model = Transformer(preset("llama", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               d_mlp=64, max_seq_len=32))
    save_hf(model, tmp_path)
    return tmp_path


def edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unknown_architecture_is_named_with_the_supported_ones(llama_dir):
    edit_config(llama_dir, architectures=["MambaForCausalLM"], model_type="mamba")
    assert is_hf_dir(llama_dir)
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"MambaForCausalLM.*not supported.*LlamaForCausalLM, GPT2LMHeadModel"):
        load_hf(llama_dir)


def test_unimplemented_rope_scaling_is_named(llama_dir):
    edit_config(llama_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(UnsupportedArchitectureError, match=r"'yarn' is not implemented"):
        load_hf(llama_dir)
    edit_config(llama_dir, rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0})  # pre-v5 spelling
    with pytest.raises(UnsupportedArchitectureError, match=r"'dynamic' is not implemented"):
        load_hf(llama_dir)


def test_missing_tensor_is_named(llama_dir):
    path = llama_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(MissingTensorError,
                       match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing.*\(64, 32\)"):
        load_hf(llama_dir)


def test_misshaped_tensor_names_both_shapes(llama_dir):
    path = llama_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(24, 32)
    save_file(tensors, path, metadata={"format": "pt"})
    name = r"'model\.layers\.0\.self_attn\.k_proj\.weight'"
    with pytest.raises(ShapeMismatchError, match=name + r" has shape \(24, 32\), expected \(16, 32\)"):
        load_hf(llama_dir)


def test_missing_shard_and_corrupt_file(llama_dir):
    (llama_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(WeightsError, match=r"model\.safetensors cannot be read"):
        load_hf(llama_dir)
    (llama_dir / "model.safetensors").unlink()
    (llama_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match=r"model-00001-of-00002\.safetensors is missing"):
        load_hf(llama_dir)


def test_not_an_hf_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not is_hf_dir(tmp_path)  # no weights
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert is_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hello": 1}))
    assert not is_hf_dir(tmp_path)  # not a transformers config


@pytest.mark.parametrize("changes, field", [
    (dict(norm_position="post"), r"norm_position='post'"),
    (dict(positions="sinusoidal"), r"positions='sinusoidal'"),
    (dict(mlp="relu"), r"mlp='relu', but LLaMA needs mlp='swiglu'"),
    (dict(final_norm=False), r"final_norm=False"),
])
def test_export_of_inexpressible_model_names_the_field(tmp_path, changes, field):
    model = Transformer(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, d_mlp=64, **changes))
    with pytest.raises(ConfigError, match=field):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_export_of_seed_presets(tmp_path):
    with pytest.raises(ConfigError,
                       match=r"as GPT2LMHeadModel .*norm_position='post'.*final_norm=False.*unembed_bias=True"):
        save_hf(Transformer(preset("seed004-words", vocab_size=50)), tmp_path)
    with pytest.raises(ConfigError, match=r"GPT-2 has no grouped-query attention"):
        save_hf(Transformer(preset("gpt2", vocab_size=50, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)), tmp_path)


def test_convert_refuses_a_non_empty_out_dir(llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    parser = argparse.ArgumentParser()
    convert.register(parser.add_subparsers())
    args = parser.parse_args(["convert", str(llama_dir), str(out), "--to", "lucidlm"])
    with pytest.raises(LucidLMError, match=r"is not empty.*--force"):
        args.handler(args)
    with pytest.raises(SystemExit):  # --to is required: no silent default direction
        parser.parse_args(["convert", str(llama_dir), str(out)])
