"""Where a Llama config.json keeps its RoPE settings: transformers 5 reads ``rope_parameters``,
older files ``rope_theta``/``rope_scaling``, and a file may carry both. lucidlm must resolve theta
exactly as transformers does (a non-empty ``rope_scaling`` replaces ``rope_parameters`` whole),
or the same file gives different logits in the two libraries."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import lucidlm

CASES = {
    "leftover default scaling overrides parameters": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rope_scaling={"rope_type": "default"}),
    "scaling with its own theta": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        rope_scaling={"rope_type": "default", "rope_theta": 300.0}),
    "top-level theta fills the scaling dict": dict(rope_theta=2000.0, rope_scaling={"type": "default"}),
    "parameters only": dict(rope_parameters={"rope_type": "default", "rope_theta": 700.0}),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)  # large enough that theta visibly moves the logits
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("fields", CASES.values(), ids=list(CASES))
def test_theta_is_resolved_as_transformers_does(hf_dir, tmp_path, fields):
    config = json.loads((hf_dir / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        config.pop(key, None)
    config.update(fields)
    for item in hf_dir.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))

    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = lucidlm.load(tmp_path, dtype=torch.float32)
    assert ours.config.rope_theta == reference.config.rope_parameters["rope_theta"]
    ids = torch.randint(3, 61, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)
