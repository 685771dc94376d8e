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


def test_int4_refuses_a_compute_dtype_torchs_kernel_refuses():
    """compute_dtype='float64' (a name load() knows) was taken by quantize(model, 'int4'), and
    every forward then failed inside torch's int4 kernel, which takes 16- and 32-bit floats only
    (the oracle below); int8 runs it, through its dequantized matrix."""
    from lucidlm.errors import QuantizationError
    from lucidlm.quantization.int4 import Int4Linear

    layer = Int4Linear.from_float(torch.nn.Linear(64, 64), group_size=32, name="probe", compute_dtype=torch.float32)
    assert layer.uses_cpu_kernel  # torch's kernel, which the float64 layer would call
    with pytest.raises(RuntimeError, match="32-bit or 16-bit float"):
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.randn(2, 64, dtype=torch.float64), layer.weight_int4, 32,
                                                    layer.scales_and_zeros.double())
    for compute_dtype in ("float64", torch.float64):
        with pytest.raises(QuantizationError, match="compute_dtype=float64: int4's kernels do not run in it.*float32"):
            quantize(tiny(), "int4", compute_dtype=compute_dtype)
    with torch.no_grad():
        assert quantize(tiny(), "int8", compute_dtype="float64")(IDS).isfinite().all()
