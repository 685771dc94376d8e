"""An adapter file names the base it was trained on by a hash of its config; a lucidlm that has
since added config fields must still recognise that base (and only that one)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings

import pytest
import torch

from lucidlm.config import ModelConfig, preset
from lucidlm.model.transformer import Transformer
from lucidlm.peft import LoRALinear, add_lora, load_adapter, save_adapter
from lucidlm.peft.adapter_meta import LATER_CONFIG_FIELDS

CONFIG = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=64, max_seq_len=32)
# ModelConfig's fields when lucidlm first saved adapters (b8fbe7b, 2026-11-22)
FIRST_FIELDS = {"attn_bias", "attn_out_bias", "d_mlp", "d_model", "dropout", "ffn_dim_multiplier", "final_norm",
                "head_dim", "max_seq_len", "mlp", "mlp_bias", "multiple_of", "n_heads", "n_kv_heads", "n_layers",
                "name", "norm", "norm_bias", "norm_eps", "norm_position", "positions", "rope_theta", "rope_variant",
                "tie_embeddings", "unembed_bias", "vocab_size"}


def test_every_later_config_field_is_listed():
    """A field added to ModelConfig changes every base's hash: it must join LATER_CONFIG_FIELDS,
    or adapters saved before it would all be called another model's."""
    later = {name for group in LATER_CONFIG_FIELDS for name in group}
    assert {f.name for f in dataclasses.fields(ModelConfig)} == FIRST_FIELDS | later


def old_digest(config: ModelConfig) -> str:
    """config_sha256 as lucidlm wrote it before rope_scaling existed (2026-11-22 to 11-28)."""
    cfg = {k: v for k, v in dataclasses.asdict(config).items() if k != "rope_scaling"}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def saved_before_rope_scaling(tmp_path):
    torch.manual_seed(0)
    model = Transformer(preset("llama", **CONFIG)).eval()
    add_lora(model, r=2, targets=("q", "v"))
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, LoRALinear)):
            layer.lora_B["default"].normal_(0, 0.3)
    save_adapter(model, tmp_path)
    meta = json.loads((tmp_path / "lucidlm_adapter.json").read_text())
    meta["base"]["config_sha256"] = old_digest(model.config)
    del meta["format_version"]  # those files had none
    (tmp_path / "lucidlm_adapter.json").write_text(json.dumps(meta))
    return model


def test_an_adapter_saved_before_a_new_config_field_loads_on_its_base_without_warning(tmp_path):
    """Every adapter saved before rope_scaling joined ModelConfig warned that it 'was trained on a
    base model with config ...; outputs may be meaningless' on the very base it was trained on."""
    trained = saved_before_rope_scaling(tmp_path)
    torch.manual_seed(0)
    base = Transformer(preset("llama", **CONFIG)).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_adapter(base, tmp_path)
    # the reference: each adapted layer as W + scaling * B A, computed here
    torch.manual_seed(0)
    reference = Transformer(preset("llama", **CONFIG)).eval()
    with torch.no_grad():
        for name, layer in trained.named_modules():
            if isinstance(layer, LoRALinear):
                delta = layer.scaling["default"] * layer.lora_B["default"] @ layer.lora_A["default"]
                reference.get_submodule(name).weight.add_(delta)
        assert (base(ids) - reference(ids)).abs().max() <= 1e-5


def test_an_old_adapter_on_another_base_still_warns(tmp_path):
    saved_before_rope_scaling(tmp_path)
    for other in (dict(CONFIG, rope_theta=10000.0),  # preset llama: 500000
                  dict(CONFIG, rope_scaling={"rope_type": "linear", "factor": 2.0})):
        with pytest.warns(UserWarning, match="trained on a base model"):
            load_adapter(Transformer(preset("llama", **other)).eval(), tmp_path)
