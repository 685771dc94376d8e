"""A GGUF file's tensors, planned and converted straight to their final form.

The model is built on the meta device (no storage, no init). Then each tensor of the file is
read from the memory map and converted to what the model keeps (float weights in the model's
dtype, or a quantized module's codes and scales); ``gguf_fill.py`` puts them in place,
several tensors at a time, and lets the file's pages go. Nothing holds the whole model
twice: no float32 copy of every tensor before a cast, no dict of converted tensors before a
copy, no float32 table behind a quantized embedding. Large tensors are converted in row chunks (a row's values
never depend on another row, in any GGUF type or lucidlm scheme), so the float32 detour of
SmolLM2's 49152 x 576 embedding is a few MB at a time instead of 113 MB.

Everything that can be checked from the header (names, shapes, types, group sizes) is checked
before the first tensor is converted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch import nn

from lucidlm.config import ModelConfig
from lucidlm.errors import GGUFError
from lucidlm.model.positions import permute_qk_to_half
from lucidlm.weights.gguf_families import CONFIG_TENSORS, FAMILIES, gguf_tensors_check_name, our_name
from lucidlm.weights.gguf_quants import (EXACT, FLOAT_TYPES, MAPPED, exact_float, exact_group_codes,
                                         exact_nibble_words, exact_plain, finite_parts, mapped_plain, native_scheme,
                                         stored_blocks)
from lucidlm.host_memory import Scratch

CHUNK_BYTES = 8 << 20  # float32 bytes converted at once for a large tensor


@dataclass
class Planned:
    """One file tensor and where it goes: ``ours`` (parameter name), ``target`` (scheme,
    group size) for a matrix kept quantized, None for float, ``heads`` when its rows are
    llama.cpp's permuted Q/K rows (the head count to undo it with)."""

    tensor: Any
    ours: str
    target: Optional[tuple[str, Optional[int]]]
    heads: Optional[int]

    @property
    def module(self) -> str:
        return self.ours.rsplit(".", 1)[0]


@functools.lru_cache(maxsize=None)
def supported_types() -> tuple[str, ...]:
    """Tensor types we can dequantize: whatever ``gguf.quants`` implements (F32, F16, BF16,
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, the IQ types, ...), found by trying one block."""
    import gguf
    from gguf import quants

    names = []
    for kind in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES[kind]
        try:
            quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), kind)  # one block of zeros
        except (NotImplementedError, ValueError, TypeError):
            continue
        names.append(kind.name)
    return tuple(names)


# --------------------------------------------------------------------------------------- planning


EMBEDDING_TENSORS = ("embed.weight", "unembed.weight")  # what quantize_embeddings=False keeps float


def plan(reader: Any, config: ModelConfig, source: str, quantize: Optional[str] = None,
         group_size: Optional[int] = None, quantize_embeddings: bool = True) -> list[Planned]:
    """Every tensor with its destination in a model of ``config`` (``gguf.fit_to_tensors``
    has checked names and shapes), refusing an unsupported type or a group size that does
    not fit before anything is converted. ``quantize_embeddings=False`` keeps the token
    embedding and the unembedding float while the other matrices are quantized."""
    from lucidlm.quantization.base import check_group_size
    from lucidlm.quantization.swap import scheme_class

    family = FAMILIES.get(config.name, FAMILIES["llama"])
    planned: list[Planned] = []
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue  # already in the config (gguf_config.fit_skeleton)
        ours = our_name(tensor.name, family.extra_layer_tensors)
        if ours is None:
            gguf_tensors_check_name(tensor, config, source)
        kind = tensor.tensor_type.name
        if kind not in FLOAT_TYPES and kind not in EXACT and kind not in supported_types():
            raise _unsupported_type(tensor, source)
        target = None
        quantized = quantize is not None and (quantize_embeddings or ours not in EMBEDDING_TENSORS)
        if quantized and len(tensor.shape) == 2:  # norms (and Gemma's QK-norms) stay float
            target = native_scheme(kind) if quantize == "gguf" else (
                quantize, scheme_class(quantize).default_group_size if group_size is None else group_size)
            if target is not None:  # GGUF shape: [in, out]
                check_group_size(ours[: -len(".weight")], int(tensor.shape[0]), target[1], scheme_class(target[0]))
        heads = None
        if family.permuted_qk and ours.endswith("q_proj.weight"):
            heads = config.n_heads
        elif family.permuted_qk and ours.endswith("k_proj.weight"):
            heads = config.n_kv_heads
        planned.append(Planned(tensor, ours, target, heads))
    return planned


def _unsupported_type(tensor: Any, source: str) -> GGUFError:
    return GGUFError(
        f"{source}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which lucidlm cannot dequantize. "
        f"Supported types: {', '.join(supported_types())}. Re-quantize the model to one of these "
        f"(e.g. llama-quantize ... Q8_0)."
    )


# --------------------------------------------------------------------------------------- converting


def dequantize_tensor(tensor: Any, source: str, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """One reader tensor (or a row slice of one) as float32, in the (out, in) orientation
    of its data, with exactly ``gguf.quants.dequantize``'s numbers; in ``scratch``'s float32
    buffer when given and the type allows (the caller copies it out before the next one)."""
    kind = tensor.tensor_type
    if kind.name in EXACT:  # the common types: same numbers as gguf.quants, computed in torch
        return exact_float(tensor, kind.name, scratch)
    if kind.name in ("F32", "F16", "F64"):  # the values as float32 (gguf.quants has no F64 at all)
        return torch.from_numpy(np.array(tensor.data, dtype=np.float32, copy=True))
    from gguf import quants

    try:
        array = quants.dequantize(tensor.data, kind)
    except NotImplementedError:
        raise _unsupported_type(tensor, source) from None
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def row_chunks(tensor: Any) -> Iterable[tuple[int, Any]]:
    """(first row, the tensor restricted to a run of rows) covering ``tensor``, each run about
    CHUNK_BYTES once in float32; a vector or a small matrix is one run."""
    data = tensor.data
    rows = int(data.shape[0]) if data.ndim > 1 else 1
    per_row = 4 * int(np.prod(tensor.shape)) // rows  # float32 bytes of one row
    step = max(1, CHUNK_BYTES // max(per_row, 1))
    if data.ndim < 2 or rows <= step:
        yield 0, tensor
        return
    for start in range(0, rows, step):
        yield start, SimpleNamespace(name=tensor.name, tensor_type=tensor.tensor_type, data=data[start:start + step])


def float_weight(item: Planned, source: str, dtype: torch.dtype, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """The tensor as float ``dtype``, Q/K rows in the half layout: float32 exactly as
    ``gguf.quants`` gives it, then rounded once to ``dtype``. With ``scratch`` and a dtype
    other than float32, the float32 rows are computed in its buffer."""
    if item.heads is not None:  # Q/K: small, and the permutation mixes rows
        return permute_qk_to_half(dequantize_tensor(item.tensor, source), item.heads).to(dtype)
    scratch = scratch if dtype != torch.float32 else None  # float32: the values are the weight itself
    out: Optional[torch.Tensor] = None
    for start, part in row_chunks(item.tensor):
        values = dequantize_tensor(part, source, scratch)  # (rows, K) float32
        if part is item.tensor:
            return values.to(dtype) if scratch is None else values.to(dtype, copy=True)
        if out is None:
            out = torch.empty((int(item.tensor.data.shape[0]), *values.shape[1:]), dtype=dtype)
        out[start:start + values.shape[0]] = values
    assert out is not None
    return out


def quantized_plain(item: Planned, source: str, scale_dtype: torch.dtype,
                    scratch: Optional[Scratch] = None) -> dict[str, torch.Tensor]:
    """The plain-layout tensors of ``item.target`` for a matrix: bit for bit from the file's
    blocks where they already are that scheme and group size, else quantized from float32
    one row chunk at a time (both schemes quantize each row on its own)."""
    from lucidlm.quantization.swap import scheme_class

    kind = item.tensor.tensor_type.name
    scheme, group_size = item.target
    if EXACT.get(kind) == item.target:
        plain = exact_plain(item.tensor, kind, scale_dtype)
    elif MAPPED.get(kind) == item.target:
        plain = mapped_plain(item.tensor, kind, scale_dtype)
    else:
        cls = scheme_class(scheme)
        parts = [cls.quantize_weight(dequantize_tensor(part, source, scratch), group_size, scale_dtype)
                 for _, part in row_chunks(item.tensor)]
        plain = parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if item.heads is not None:  # permuting output rows (codes with their row's scales) is exact
        plain = {k: permute_qk_to_half(v, item.heads) for k, v in plain.items()}
    return plain


def _kernel_layout(item: Planned, device: str | torch.device,
                   make: Callable[[torch.Tensor, Optional[torch.Tensor]], Optional[tuple[nn.Module, int]]]
                   ) -> Optional[tuple[nn.Module, bool]]:
    """(module, whether its block scales were found finite) from ``make(blocks, rows)``, one C pass
    from the file's blocks into lucidlm's CPU kernel layout (LLaMA's Q/K rows un-permuted on the
    way); None off the CPU or where ``make`` says that layout does not apply."""
    if torch.device(device).type != "cpu":
        return None
    blocks = stored_blocks(item.tensor)
    rows = None if item.heads is None else permute_qk_to_half(torch.arange(blocks.shape[0]), item.heads)
    made = make(blocks, rows)
    return None if made is None else (made[0], made[1] == 0)


def int4_from_blocks(item: Planned, device: str | torch.device,
                     out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> tuple[nn.Module, bool]:
    """(An Int4Linear from a Q4_0 / Q4_1 matrix's blocks, whether its block scales were found
    finite on the way). Bit for bit: the nibble bytes go to the module as they are stored
    (lucidlm's CPU kernel reads them as they are, reordered), never unpacked to codes and
    packed again."""
    from lucidlm.quantization import Int4Linear

    made = _kernel_layout(item, device, lambda blocks, rows: Int4Linear.from_q4_blocks(blocks, rows, out=out))
    if made is not None:
        return made
    words, scales, zeros = exact_nibble_words(item.tensor, item.tensor.tensor_type.name)
    if item.heads is not None:  # permuting output rows (codes with their row's scales) is exact
        words, scales, zeros = (permute_qk_to_half(t, item.heads) for t in (words, scales, zeros))
    return Int4Linear.from_nibble_words(words.to(device), scales.to(device), zeros.to(device)), False


def int8_from_blocks(item: Planned, device: str | torch.device) -> tuple[nn.Module, bool]:
    """(An Int8Linear in groups of 32 from a Q8_0 matrix's blocks, codes and float16 scales
    exact, whether its block scales were found finite on the way)."""
    from lucidlm.quantization import Int8Linear

    made = _kernel_layout(item, device, Int8Linear.from_q8_blocks)
    if made is not None:
        return made
    codes, scales = exact_group_codes(item.tensor)
    if item.heads is not None:
        codes, scales = (permute_qk_to_half(t, item.heads) for t in (codes, scales))
    return Int8Linear.from_group_codes(codes.to(device), scales.to(device)), False
