"""Qwen 2 / Qwen 3 config.json fields read as transformers' Qwen2Config / Qwen3Config read them:
the defaults of fields a file leaves out, and which layers slide (``layer_types``)."""

from __future__ import annotations

import json

import pytest
from torch.testing import assert_close

import lucidlm
from lucidlm.errors import UnsupportedArchitectureError
from qwen_toys import hf_qwen, logits, token_batch


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_left_out_context_length_is_the_config_class_default(tmp_path, arch):
    from transformers import AutoConfig

    hf = hf_qwen(arch, seed=41)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert lucidlm.load(tmp_path).config.max_seq_len == AutoConfig.from_pretrained(tmp_path).max_position_embeddings


def _with_config(hf, tmp_path, **changes):
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("layer_types", None)  # transformers 5 writes the list it derived; each case says its own
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


@pytest.mark.parametrize("changes", [
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),  # from layer 2 on: none of 2
    dict(use_sliding_window=True, sliding_window=None, max_window_layers=0),  # no window to slide in
    dict(use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "full_attention"]),
], ids=["window-past-the-last-layer", "no-window-size", "explicit-full-layer-types"])
def test_sliding_window_switch_without_a_sliding_layer_loads_as_transformers(tmp_path, changes):
    from transformers import AutoModelForCausalLM

    path = _with_config(hf_qwen("qwen2", seed=42), tmp_path, **changes)
    theirs = AutoModelForCausalLM.from_pretrained(path).eval()
    assert set(theirs.config.layer_types) == {"full_attention"}
    ids = token_batch(seed=3)
    assert_close(logits(lucidlm.load(path), ids), logits(theirs, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("changes, message", [
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     r"use_sliding_window=true makes layers 1\.\.1 \(max_window_layers=1 on\)"),
    (dict(use_sliding_window=False, sliding_window=16, layer_types=["full_attention", "sliding_attention"]),
     r"layer_types marks layer\(s\) \[1\] 'sliding_attention'"),
])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_sliding_layer_is_refused_naming_it(tmp_path, arch, changes, message):
    from transformers import AutoConfig

    path = _with_config(hf_qwen(arch, seed=43), tmp_path, **changes)
    assert "sliding_attention" in AutoConfig.from_pretrained(path).layer_types  # transformers would slide
    # the problem, then the fix: the config.json field to change
    with pytest.raises(UnsupportedArchitectureError, match=message + r".*not implemented.*In config\.json, only if"):
        lucidlm.load(path)
