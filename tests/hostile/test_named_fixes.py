"""An error's named fix must exist and work: each case triggers the error, then applies the
fix the message names (the README's rule: every bad input gets a clear error naming the
problem and the fix)."""

from __future__ import annotations

import copy

import pytest
import torch

import lucidlm
from lucidlm.errors import ConfigError, QuantizationError


def tiny(**overrides):
    return lucidlm.load("llama", random_init=True, n_layers=1, d_model=64, n_heads=4, **overrides)


def test_random_init_with_gguf_quantize_is_refused_as_not_a_gguf_file():
    # --quantize lists gguf as a choice; the error said "unknown quantization scheme 'gguf'"
    with pytest.raises(QuantizationError) as err:
        tiny(quantize="gguf")
    message = str(err.value)
    assert "unknown" not in message and "quantize='int8' or 'int4'" in message
    assert type(tiny(quantize="int8").blocks[0].attn.q_proj).__name__ == "Int8Linear"  # the fix named


def test_attn_in_on_grouped_heads_names_the_models_own_switch():
    model = tiny(n_kv_heads=2)
    with pytest.raises(ConfigError) as err:
        model.set_use_attn_in(True)
    fix = "model.set_use_split_qkv_input(True)"
    assert fix in str(err.value)  # not split_qkv_input=True, a keyword of no public function
    eval(fix, {"model": model})
    _, cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
    assert cache["blocks.0.hook_k_input"].shape == (1, 3, 2, 64)  # a residual copy per key/value head


def test_lora_on_a_quantized_base_names_the_quantization_not_an_empty_layer_list():
    from lucidlm.training.config import FinetuneConfig
    from lucidlm.training.finetune import attach_method

    config = FinetuneConfig(method="lora", out_dir="unused")
    quantized = lucidlm.quantize(tiny(), "int8")
    with pytest.raises(QuantizationError) as err:
        attach_method(quantized, config)  # was: "matches no linear layer ... Linear layers are named: ."
    assert "lucidlm.quantization.dequantize(model)" in str(err.value)
    lucidlm.quantization.dequantize(quantized)  # the fix named
    assert "LoRA" in attach_method(quantized, config)


def test_quantize_with_a_prefix_adapter_does_not_send_to_merge(tmp_path):
    from lucidlm.peft import add_prefix, save_adapter
    from lucidlm.weights.checkpoint import save_model

    base = tiny()
    save_model(base, tmp_path / "base")
    tuned = copy.deepcopy(base)
    add_prefix(tuned, length=2)
    save_adapter(tuned, tmp_path / "prefix")
    with pytest.raises(QuantizationError) as err:
        lucidlm.load(tmp_path / "base", adapter=tmp_path / "prefix", quantize="int8")
    message = str(err.value)
    assert "lucidlm merge" not in message and "without quantize=" in message
    model = lucidlm.load(tmp_path / "base", adapter=tmp_path / "prefix")  # the fix named
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, model.config.vocab_size)
