"""What ``quantize`` must refuse rather than half-do: a model carrying a fine-tuning method
(its adapter layers are no plain nn.Linear, so they stayed float and untrainable, and the saved
model could not be read back) and weights whose scales the compute dtype cannot hold (float16
scales overflowed to inf and the logits were NaN)."""

from __future__ import annotations

import pytest
import torch

import lucidlm
from lucidlm import preset
from lucidlm.errors import QuantizationError
from lucidlm.peft.lora import add_lora, merge_adapter
from lucidlm.quantization import quantize


def tiny() -> lucidlm.Transformer:
    torch.manual_seed(0)
    config = preset("llama", vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128, max_seq_len=64)
    return lucidlm.Transformer(config).eval()


@pytest.mark.parametrize("merged", [False, True])
def test_a_model_with_lora_is_refused_and_left_as_it_was(merged):
    model = tiny()
    add_lora(model, r=4)
    if merged:
        merge_adapter(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(QuantizationError, match="LoRALinear.*merge_and_unload"):
        quantize(model, "int8")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_float16_scales_that_would_overflow_are_refused(scheme):
    model = tiny()
    with torch.no_grad():
        model.blocks[0].mlp.down_proj.weight[0, 0] = 1e7  # float32 and bfloat16 hold it; float16 stops at 65504
    with pytest.raises(QuantizationError, match="blocks.0.mlp.down_proj.*65504.*bfloat16"):
        quantize(model, scheme, compute_dtype=torch.float16)
    assert type(model.blocks[0].mlp.down_proj) is torch.nn.Linear  # nothing was swapped
    quantize(model, scheme)  # bfloat16 scales hold it
    assert torch.isfinite(model.blocks[0].mlp.down_proj.dequantize()).all()


def test_a_width_no_int4_group_divides_points_to_int8():
    # d_mlp 200: no int4 group size (32..256) divides the down projection's input, so the old
    # advice "use a group size that divides 200" could not be followed
    config = preset("llama", vocab_size=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_mlp=200, max_seq_len=64)
    model = lucidlm.Transformer(config).eval()
    for group_size in (None, 64):
        with pytest.raises(QuantizationError, match=r"down_proj: the input width 200 .*\(32, 64, 128, 256\).*"
                                                    r"quantize='int8'"):
            quantize(model, "int4", group_size)
    assert type(model.blocks[0].mlp.down_proj) is torch.nn.Linear  # nothing was half-swapped
    quantize(model, "int8")  # what the message offers works
    assert model.blocks[0].mlp.down_proj.scheme == "int8"
