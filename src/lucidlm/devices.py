"""Device and dtype names as users type them, checked once with a one-line error.

``resolve_device("auto")`` picks CUDA when torch sees a GPU, else Apple's MPS, else CPU;
``resolve_dtype("bf16")`` is ``torch.bfloat16``. Every command and ``lucidlm.load`` go
through these two, so ``--device cuda`` on a CPU-only torch fails the same way everywhere.
"""

from __future__ import annotations

from typing import Any

import torch

from lucidlm.errors import DeviceError
from lucidlm.suggest import did_you_mean

DEVICE_KINDS = ("auto", "cpu", "cuda", "mps")
_DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "metal": "mps"}
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")  # what messages list and suggest first


def resolve_device(device: Any = "auto") -> torch.device:
    """A ``torch.device`` that exists on this machine, from a name or device."""
    if isinstance(device, torch.device):
        name = str(device)
    elif isinstance(device, str):
        name = device.strip().lower()
    else:
        raise DeviceError(f"device={device!r} is not a device name; use one of {', '.join(DEVICE_KINDS)} "
                          f"(or cuda:N).")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    kind = name.split(":", 1)[0]
    if kind in _DEVICE_ALIASES:
        raise DeviceError(f"device {device!r} is not a torch device name; did you mean "
                          f"{_DEVICE_ALIASES[kind]!r}?")
    try:
        parsed = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"device {device!r} is not a device name{did_you_mean(kind, DEVICE_KINDS)} "
                          f"(known: {', '.join(DEVICE_KINDS)}, or cuda:N).") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU"
            raise DeviceError(f"device {device!r} asked for CUDA, but {build} (torch {torch.__version__}); "
                              f"use --device cpu (or device='cpu').")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: there are only {torch.cuda.device_count()} CUDA device(s) "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1}).")
    elif parsed.type == "mps" and not _mps_available():
        raise DeviceError(f"device {device!r} asked for Apple's MPS, which this machine does not have; "
                          f"use --device cpu.")
    elif parsed.type not in DEVICE_KINDS:  # meta holds no values, xla & co. are not built in
        raise DeviceError(f"device {device!r} is a torch device type lucidlm does not run models on; use one of "
                          f"{', '.join(DEVICE_KINDS)} (or cuda:N).")
    return parsed


def resolve_dtype(dtype: Any) -> torch.dtype:
    """A floating ``torch.dtype`` from a dtype or a name (``"bfloat16"``, ``"bf16"``, ``"torch.float16"``)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise DeviceError(f"dtype={dtype} is not a floating-point dtype; weights need float32, "
                              f"bfloat16 or float16.")
        if dtype not in DTYPES.values():  # float8 is floating too, but torch has no arithmetic for it:
            # the first forward pass failed inside torch ("Promotion for Float8 Types is not supported")
            raise DeviceError(f"dtype={dtype} is not one lucidlm computes in (known: {', '.join(DTYPE_NAMES)}); "
                              f"for 8-bit weights use quantize='int8'.")
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
        hint = did_you_mean(name, DTYPE_NAMES) or did_you_mean(name, DTYPES)  # the full names first
        raise DeviceError(f"dtype {dtype!r} is not a known dtype{hint} (known: {', '.join(DTYPE_NAMES)}).")
    raise DeviceError(f"dtype={dtype!r} is neither a torch.dtype nor a name like 'bfloat16'.")


def cpu_multiplies_bfloat16() -> bool:
    """Whether torch multiplies bfloat16 matrices on this CPU at hardware speed: oneDNN's bf16
    path needs AVX-512 (BF16/AMX to be fast). Without it (AVX2-only CPUs such as AMD Zen 3)
    torch 2.13 falls back to a generic loop that is 5-30x slower than float32's matmul."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, skipped where it would convert nothing: even a no-op ``.to`` costs
    ~1.5 us of argument parsing and dispatch, and an eager SmolLM2 decode step would make ~430
    of them (quantized linears, RoPE, the KV cache write)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
