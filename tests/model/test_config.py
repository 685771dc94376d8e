"""ModelConfig validation and presets: every bad value gets our ConfigError with a useful message."""

from __future__ import annotations

import json

import pytest

from lucidlm import ModelConfig, preset
from lucidlm.config import PRESETS, llama_hidden_dim
from lucidlm.errors import ConfigError


def test_derived_fields() -> None:
    cfg = ModelConfig(d_model=256, n_heads=8, mlp="swiglu", multiple_of=256)
    assert cfg.n_kv_heads == 8 and cfg.head_dim == 32
    # LLaMA: int(2 * 4d / 3) = 682, rounded up to a multiple of 256 -> 768
    assert cfg.d_mlp == 768
    assert ModelConfig(d_model=256, n_heads=8, mlp="gelu").d_mlp == 1024


def test_llama3_8b_hidden_dim_is_14336() -> None:
    # Meta's published FFN width for Llama 3 8B (dim 4096, multiple_of 1024, multiplier 1.3).
    assert llama_hidden_dim(4096, 1024, 1.3) == 14336
    assert preset("llama3-8b").d_mlp == 14336


@pytest.mark.parametrize("changes,message", [
    (dict(n_heads=8, n_kv_heads=3), r"n_heads=8 is not divisible by n_kv_heads=3.*\[1, 2, 4, 8\]"),
    (dict(d_model=64, n_heads=4, head_dim=15, positions="rope"), r"head_dim=15 is odd.*RoPE"),
    (dict(d_model=0), r"^ModelConfig: field 'd_model' is 0; expected a value between 1 and \d+\. Pass valid"),
    (dict(n_layers=-2), r"field 'n_layers' is -2; expected a value between 1 and 4096"),
    (dict(vocab_size=3.5), r"field 'vocab_size' is 3\.5; expected an integer"),
    (dict(positions="alibi"), r"field 'positions' is 'alibi'; expected one of 'rope', 'sinusoidal', 'learned', 'none'"),
    (dict(mlp="reglu"), r"field 'mlp' is 'reglu'; expected one of 'relu', 'gelu', 'gelu_tanh', 'swiglu', 'geglu'"),
    (dict(norm="batch"), r"field 'norm' is 'batch'; expected one of 'rms', 'layer', 'none'"),
    (dict(sliding_window=0), r"field 'sliding_window' is 0; expected a value between 1 and"),
    (dict(global_layer_every=6), r"global_layer_every=6 needs a sliding_window"),
    (dict(norm="none", qk_norm=True), r"norm='none' has no norm"),
    (dict(norm_position="sandwich"), r"expected one of 'pre', 'post'"),
    (dict(rope_variant="neox"), r"expected one of 'half', 'interleaved'"),
    (dict(dropout=1.0), r"field 'dropout' is 1\.0; expected a number < 1\.0 and >= 0\.0"),
    (dict(d_model=100, n_heads=3), r"d_model=100 is not divisible by n_heads=3"),
])
def test_invalid_configs_are_rejected(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**changes)


def test_unknown_fields_and_malformed_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['n_embd'\]; valid fields are: .*d_model"):
        ModelConfig.from_dict({"n_embd": 128})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ModelConfig.load(bad)
    with pytest.raises(ConfigError, match=r"missing\.json: model config not found"):
        ModelConfig.load(tmp_path / "missing.json")


def test_save_load_round_trip(tmp_path) -> None:
    cfg = preset("smollm2-135m")
    cfg.save(tmp_path / "c.json")
    assert ModelConfig.load(tmp_path / "c.json") == cfg
    assert json.loads((tmp_path / "c.json").read_text())["n_kv_heads"] == 3


def test_presets_build_and_unknown_preset() -> None:
    for name in PRESETS:
        preset(name)  # every preset is a valid config
    assert preset("gpt2").tie_embeddings and preset("gpt2").positions == "learned"
    assert preset("seed000").norm_position == "post" and preset("seed004-words").positions == "sinusoidal"
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'; available presets: .*gpt2"):
        preset("gpt5")


def test_replace_derives_again_what_was_derived() -> None:
    """replace() gives what a fresh config of the changed fields gives; sizes that were set
    (gemma3's head_dim 256, a GQA preset's n_kv_heads) stay as set."""
    base = ModelConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=100)
    for changes in ({"d_model": 128}, {"n_heads": 8}, {"n_heads": 2}, {"mlp": "gelu"}):
        fresh = ModelConfig(**{**dict(d_model=64, n_heads=4, n_layers=2, vocab_size=100), **changes})
        assert base.replace(**changes) == fresh
    gemma = preset("gemma3-270m")
    assert gemma.replace(d_model=1024).head_dim == gemma.head_dim == 256
    assert gemma.replace(d_model=1024).n_kv_heads == gemma.n_kv_heads
    assert base.replace(d_model=128, head_dim=8).head_dim == 8
