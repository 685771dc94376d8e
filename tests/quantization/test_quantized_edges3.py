"""Quantized layers on inputs and shapes the common cases do not reach: a strided input (torch's
int4/int8 ops refuse one; nn.Linear takes it) and heads whose size is not a multiple of 8 (the
one-call C++ decode step's attention loop cannot take them; it must leave them to the modules)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lucidlm.quantization.int4 import Int4Linear
from lucidlm.quantization.int8 import Int8Linear


@pytest.mark.parametrize("cls, group_size", [(Int4Linear, 64), (Int4Linear, 32), (Int8Linear, None),
                                             (Int8Linear, 32)])
def test_a_strided_input_gives_the_float_product(cls, group_size):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40)
    layer = cls.from_float(linear, group_size)
    x = torch.randn(64, 3).t()  # (3, 64), a transposed view
    assert not x.is_contiguous()
    expected = F.linear(x, layer.dequantize(torch.float32), linear.bias.detach())
    torch.testing.assert_close(layer(x), expected, atol=2e-2, rtol=2e-2)  # int4's activations are rounded too
    torch.testing.assert_close(layer(x), layer(x.contiguous()), atol=0, rtol=0)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_heads_of_twelve_values_generate_as_the_full_forward_pass_predicts(tmp_path, scheme):
    transformers = pytest.importorskip("transformers")
    import lucidlm

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)  # head_dim 12
    model = lucidlm.load(str(tmp_path), quantize=scheme, group_size=32)
    prompt, expected = [5, 6, 7, 8], []
    with torch.no_grad():
        for _ in range(6):  # teacher-forced: whole passes, no KV cache, no decode step
            expected.append(int(model(torch.tensor([prompt + expected]))[0, -1].argmax()))
    got = model.generate(prompt, max_new_tokens=6, temperature=0, stop_on_eos=False).token_ids
    assert got == expected
