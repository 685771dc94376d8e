"""``quantize(compute_dtype=)`` and ``dequantize(model, dtype)`` take a dtype's name as
``lucidlm.load(dtype=)`` does. A name used to fail inside torch: ``compute_dtype="bfloat16"``
with "finfo(): argument 'type' must be torch.dtype", and ``dequantize(model, "float32")`` with
"Invalid device string: 'float32'" (``Tensor.to`` reads a string as a device)."""

from __future__ import annotations

import copy

import pytest
import torch

import lucidlm
from lucidlm import preset
from lucidlm.errors import DeviceError
from lucidlm.quantization import dequantize, quantize


def tiny() -> lucidlm.Transformer:
    torch.manual_seed(0)
    config = preset("llama", vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128, max_seq_len=64)
    return lucidlm.Transformer(config).eval()


IDS = torch.tensor([[1, 5, 9, 3]])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", ["bfloat16", "bf16", "float32"])
def test_compute_dtype_by_name_is_the_torch_dtype(scheme, name):
    by_name = quantize(tiny(), scheme, compute_dtype=name)
    by_dtype = quantize(tiny(), scheme, compute_dtype=getattr(torch, "bfloat16" if name == "bf16" else name))
    with torch.no_grad():
        assert torch.equal(by_name(IDS), by_dtype(IDS))


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_dequantize_to_a_dtype_by_name(name):
    quantized = quantize(tiny(), "int8")
    by_name = dequantize(copy.deepcopy(quantized), name)
    by_dtype = dequantize(copy.deepcopy(quantized), getattr(torch, name))
    matrices = [m.weight for m in by_name.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    assert matrices and {w.dtype for w in matrices} == {getattr(torch, name)}  # the quantized ones; norms stay
    assert by_name.state_dict().keys() == by_dtype.state_dict().keys()
    assert all(torch.equal(by_name.state_dict()[k], v) for k, v in by_dtype.state_dict().items())


def test_an_unknown_dtype_name_is_named():
    with pytest.raises(DeviceError, match="'float33'.*float32"):
        dequantize(quantize(tiny(), "int8"), "float33")
    with pytest.raises(DeviceError, match="'bfloat61'.*bfloat16"):
        quantize(tiny(), "int8", compute_dtype="bfloat61")
