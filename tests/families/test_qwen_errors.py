"""Bias tensors a Qwen 2 / Qwen 3 file has no place for are refused by what the architecture is:
a bias transformers' model never has (Qwen 2's o_proj, Qwen 3's MLP; transformers drops them as
unexpected keys) names the file as another model, not a config.json switch Qwen has not got; a
bias Qwen 3's attention_bias switch turns on names that switch. (LLaMA's message, naming its
attention_bias / mlp_bias, is tests/weights/test_hf_mismatch.py's.)"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lucidlm.errors import WeightsError
from lucidlm.weights.hf import load_hf
from qwen_toys import hf_qwen


def add_tensors(folder, suffix: str, rows: int) -> list[str]:
    """Add a (rows,) tensor named ``model.layers.N.<suffix>`` for each layer to the folder's file."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    added = [f"model.layers.{i}.{suffix}" for i in range(2)]
    tensors.update({name: torch.full((rows,), 0.5) for name in added})
    save_file(tensors, str(path), metadata={"format": "pt"})
    return added


def unexpected_to_transformers(folder) -> set[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return set(info["unexpected_keys"])


def test_qwen2_o_proj_bias_names_the_architecture_not_a_switch(tmp_path):
    hf_qwen("qwen2").save_pretrained(tmp_path)
    added = add_tensors(tmp_path, "self_attn.o_proj.bias", 64)
    assert set(added) <= unexpected_to_transformers(tmp_path)  # Qwen2ForCausalLM has no place for them
    with pytest.raises(WeightsError) as caught:
        load_hf(tmp_path)
    message = str(caught.value)
    assert "2 tensor(s)" in message and "'model.layers.0.self_attn.o_proj.bias'" in message
    assert ("Qwen2ForCausalLM has no o_proj bias; this file is not a Qwen 2 checkpoint "
            "(or config.json names the wrong architecture)") in message
    assert "config.json's" not in message  # no switch to blame


def test_qwen3_mlp_bias_names_the_architecture_not_a_switch(tmp_path):
    hf_qwen("qwen3").save_pretrained(tmp_path)
    added = add_tensors(tmp_path, "mlp.up_proj.bias", 128)
    assert set(added) <= unexpected_to_transformers(tmp_path)  # Qwen3ForCausalLM has no MLP bias
    with pytest.raises(WeightsError) as caught:
        load_hf(tmp_path)
    message = str(caught.value)
    assert "'model.layers.0.mlp.up_proj.bias'" in message
    assert ("Qwen3ForCausalLM has no MLP bias; this file is not a Qwen 3 checkpoint "
            "(or config.json names the wrong architecture)") in message
    assert "config.json's" not in message


def test_qwen3_attention_biases_the_config_denies_name_its_one_switch(tmp_path):
    hf_qwen("qwen3", attention_bias=True).save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["attention_bias"] = False
    config_path.write_text(json.dumps(config))
    # transformers reads the q/k/v/o biases as unexpected once the switch is off
    assert "model.layers.0.self_attn.o_proj.bias" in unexpected_to_transformers(tmp_path)
    with pytest.raises(WeightsError, match=r"8 tensor\(s\).*config\.json's attention_bias says there are none; "
                                           r"correct config\.json"):
        load_hf(tmp_path)
