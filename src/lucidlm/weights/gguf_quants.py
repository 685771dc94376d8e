"""GGUF quantized blocks -> lucidlm's quantized layouts, without a float32 detour.

Block formats (ggml's, 32 weights per block, little-endian):

    Q8_0  34 bytes: f16 d, 32 x int8 q            W = d * q
    Q4_0  18 bytes: f16 d, 16 bytes of nibbles    W = d * (q - 8)
    Q4_1  20 bytes: f16 d, f16 m, 16 bytes        W = d * q + m
    (nibbles: byte i holds weight i in its low half and weight i + 16 in its high half)

These map exactly onto our schemes: Q8_0 -> int8 in groups of 32 (scale d); Q4_0 / Q4_1 ->
int4 in groups of 32 with scale d and zero 0 / m + 8 d. The only change is the scales'
rounding to the compute dtype (bfloat16 by default), which the tests bound.

Two more map onto them block by block (``MAPPED``), read straight from their bytes:

    Q5_0  22 bytes: f16 d, 4 bytes of fifth bits, 16 bytes of nibbles    W = d * (q - 16)
          -> int8 in groups of 32: code q - 16 in -16..15, scale d (float16, kept exact)
    Q4_K  144 bytes per 256 weights: f16 d, f16 dmin, 12 bytes of eight 6-bit scales sc and
          mins m, 128 bytes of nibbles; sub-block j of 32: W = (d sc_j) q - dmin m_j
          -> int4 in groups of 32: scale d sc_j, zero 8 d sc_j - dmin m_j (rounded to the
          compute dtype, as Q4_1's)

Requantizing them from their float values instead (what every other type gets) put a fresh
grid over each group: Gemma 3 270M's Q4_K matrices moved by 4.4 % (relative RMS), and its
perplexity by +3 %.

Every other type (the other K-quants, Q5_1, ...) has no counterpart in our schemes: it is
dequantized one tensor at a time with ``gguf.quants`` and quantized again to its nearest
representation, ``NEAREST`` (int8 in groups of 32: int4 put a grid over two sub-blocks of
different scales, 4-7 % off for Q2_K/Q3_K), and the error that adds is measured in the tests.
Float tensors (norms; F16/F32/F64 matrices) stay float.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import numpy as np
import torch

from lucidlm.quantization import scheme_class
from lucidlm.quantization.int4 import codes_from_nibble_words, pack_nibbles
from lucidlm.weights.ggml_types import quant_sizes

BLOCK = 32
EXACT = {"Q8_0": ("int8", BLOCK), "Q4_0": ("int4", BLOCK), "Q4_1": ("int4", BLOCK)}
MAPPED = {"Q5_0": ("int8", BLOCK), "Q4_K": ("int4", BLOCK)}  # block by block, no float detour (above)
# Q2_K and Q3_K too go to int8: their sub-blocks of 16 carry their own (Q3_K: signed) scales, so
# no one 16-level grid fits a group of 32 (int4/32 moved random Q3_K blocks by 6.8 %, int8/32 by 0.45 %).
NEAREST = {"Q2_K": ("int8", BLOCK), "Q3_K": ("int8", BLOCK), "Q5_1": ("int8", BLOCK), "Q5_K": ("int8", BLOCK),
           "Q6_K": ("int8", BLOCK)}
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# Byte offsets of the f16 scales (d, and m / dmin) inside each block, from ggml's block
# structs: the only bytes of a quantized tensor that can hold a NaN or an infinity (the
# codes are integers, and a finite scale times a code stays finite in float32).
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                 "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                 "IQ4_NL": (0,), "IQ4_XS": (0,)}


def native_scheme(type_name: str) -> Optional[tuple[str, int]]:
    """The (scheme, group size) a GGUF tensor type is kept in under ``quantize="gguf"``;
    None for float types, which stay float."""
    if type_name in FLOAT_TYPES:
        return None
    return EXACT.get(type_name) or MAPPED.get(type_name) or NEAREST.get(type_name) or ("int8", BLOCK)


def finite_parts(tensor: Any) -> Optional[tuple[torch.Tensor, str]]:
    """(values that must be finite, what they are) for a reader tensor: a float tensor's
    values, or a quantized tensor's block scales; None for types whose block layout is not
    listed here (the caller then checks the dequantized values)."""
    name = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    if name == "BF16":  # NumPy has no bfloat16: the reader gives bytes
        return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16), "values"
    if name in FLOAT_TYPES:
        return _from_numpy(data), "values"
    if name not in SCALE_OFFSETS:
        return None
    type_size = quant_sizes(tensor.tensor_type)[1]
    halves = _from_numpy(data.reshape(-1, type_size)).view(torch.float16)  # (n_blocks, bytes per block / 2)
    offsets = SCALE_OFFSETS[name]  # one scale, or two side by side
    return halves[:, offsets[0] // 2:offsets[-1] // 2 + 1], "block scales"  # a strided view: no copy


def _from_numpy(data: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only map: we only ever read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q4_K": 144}  # Q4_K: a superblock of 256


def _blocks(tensor: Any, type_name: str) -> torch.Tensor:
    """(N, K/32, block bytes) uint8 view of the tensor's bytes (no copy of the mapped file)."""
    data = np.asarray(tensor.data)
    with warnings.catch_warnings():  # a read-only map: we only ever read it (every use copies)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data.reshape(data.shape[0], -1, BLOCK_BYTES[type_name]))


def _scales(blocks: torch.Tensor, type_name: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(d, m or None), float32 (N, G): the f16 fields at bytes 0 and 2 of each block (Q4_K: d and
    dmin of each superblock), read through one float16 view of the blocks (every block size is even)."""
    halves = blocks.view(torch.float16)  # (N, G, block bytes / 2), strided reads below: no byte copies
    return halves[..., 0].float(), (halves[..., 1].float() if type_name in ("Q4_1", "Q4_K") else None)


def _codes(blocks: torch.Tensor, type_name: str, dtype: torch.dtype, scratch: Any = None) -> torch.Tensor:
    """(N, G, 32) codes of ``dtype``, in column order: Q8_0's signed bytes, Q4's nibbles 0..15
    (byte i of a block holds column i in its low half and column i + 16 in its high half);
    written into ``scratch.take(N * K, dtype)`` (``host_memory.Scratch``) when given."""
    shape = (*blocks.shape[:2], BLOCK)
    codes = torch.empty(shape, dtype=dtype) if scratch is None else scratch.take(math.prod(shape), dtype).view(shape)
    if type_name == "Q8_0":
        codes.copy_(blocks[..., 2:].view(torch.int8))  # a copy: never a view of the map
        return codes
    start = BLOCK_BYTES[type_name] - 16  # the 16 nibble bytes end each block
    if start % 4 == 0:  # Q4_1: 4 whole int32 words, unpacked 4 bytes per operation (2x faster than
        # byte-wise ops on the 16-of-20 byte strides)
        codes.copy_(codes_from_nibble_words(blocks.view(torch.int32)[..., start // 4:]))  # (N, G, 32)
        return codes
    nibbles = blocks[..., start:]  # (N, G, 16)
    codes[..., :16] = nibbles & 0x0F  # written straight into the output dtype: no uint8 (N, K) copy
    codes[..., 16:] = nibbles >> 4
    return codes


def exact_plain(tensor: Any, type_name: str, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain-layout tensors of our scheme for a Q8_0 / Q4_0 / Q4_1 tensor, bit for bit: Q8_0's
    float16 scales exactly (as float32: rounded to bfloat16 they flipped the embedded model's
    sampled answers, its token table being Q8_0), Q4's scales and zeros rounded to ``scale_dtype``."""
    if type_name == "Q8_0":
        blocks = _blocks(tensor, type_name)
        codes, (d, _) = _codes(blocks, type_name, torch.int8), _scales(blocks, type_name)
        return {"weight_int8": codes.reshape(blocks.shape[0], -1), "scales": d}
    codes, scales, zeros = exact_codes(tensor, type_name, scale_dtype, torch.uint8)
    return {"weight_int4": pack_nibbles(codes), "scales": scales, "zeros": zeros}


def exact_codes(tensor: Any, type_name: str, scale_dtype: torch.dtype, dtype: torch.dtype = torch.int32,
                scratch: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (N, K) of ``dtype`` in 0..15, scales, zeros (N, G) in ``scale_dtype``) of a Q4_0 /
    Q4_1 tensor in our int4 scheme, bit for bit: int32 codes are what torch's CPU tile
    packing takes, so ``Int4Linear.from_codes`` skips packing into nibbles and out again."""
    blocks = _blocks(tensor, type_name)
    N = blocks.shape[0]
    d, m = _scales(blocks, type_name)
    zeros = torch.zeros_like(d) if m is None else m + 8 * d  # (q - 8) d + zero = d q + m
    return _codes(blocks, type_name, dtype, scratch).reshape(N, -1), d.to(scale_dtype), zeros.to(scale_dtype)


def exact_nibble_words(tensor: Any, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(words (N, G, 4) int32: each block's 16 nibble bytes as stored, scales, zeros (N, G)
    float32) of a Q4_0 / Q4_1 tensor in our int4 scheme, for ``Int4Linear.from_nibble_words``.
    Q4_1's words are a view of the map (its nibbles start 4 bytes into each 20-byte block);
    Q4_0's are copied out first (they start at byte 2)."""
    blocks = _blocks(tensor, type_name)
    d, m = _scales(blocks, type_name)
    zeros = torch.zeros_like(d) if m is None else m + 8 * d  # (q - 8) d + zero = d q + m
    start = BLOCK_BYTES[type_name] - 16
    words = blocks.view(torch.int32)[..., start // 4:] if start % 4 == 0 else \
        blocks[..., start:].contiguous().view(torch.int32)
    return words, d, zeros


def stored_blocks(tensor: Any) -> torch.Tensor:
    """(N, G, block bytes) uint8: a Q4_0 / Q4_1 / Q8_0 tensor's blocks as stored, a view of the
    map, for ``Int4Linear.from_q4_blocks`` and ``Int8Linear.from_q8_blocks``."""
    return _blocks(tensor, tensor.tensor_type.name)


def exact_group_codes(tensor: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, G, 32) int8, a strided view of the map, and scales (N, G) float32, exact) of
    a Q8_0 tensor, for ``Int8Linear.from_group_codes`` (which copies the codes once)."""
    blocks = _blocks(tensor, "Q8_0")
    return blocks[..., 2:].view(torch.int8), _scales(blocks, "Q8_0")[0]


def exact_float(tensor: Any, type_name: str, scratch: Any = None) -> torch.Tensor:
    """float32 (N, K) of a Q8_0 / Q4_0 / Q4_1 tensor with exactly ``gguf.quants.dequantize``'s
    arithmetic (float32, multiply then add), computed with torch in place (in ``scratch``'s
    buffer when given): ~30x faster."""
    blocks = _blocks(tensor, type_name)
    N = blocks.shape[0]
    d, m = _scales(blocks, type_name)
    w = _codes(blocks, type_name, torch.float32, scratch)  # (N, G, 32)
    if type_name == "Q4_0":
        w.sub_(8)
    w.mul_(d[..., None])
    if m is not None:
        w.add_(m[..., None])
    return w.reshape(N, -1)


def mapped_plain(tensor: Any, type_name: str, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain-layout tensors of our scheme for a Q5_0 (int8) or Q4_K (int4) tensor, read from its
    blocks (module docstring): Q5_0 exactly, Q4_K up to its scales' and zeros' rounding to
    ``scale_dtype``. Vectorized over every block of the tensor (one copy of the codes)."""
    blocks = _blocks(tensor, type_name)  # (N, G, 22) or (N, S, 144): S superblocks of 256 weights
    rows = blocks.shape[0]
    if type_name == "Q5_0":
        d = _scales(blocks, type_name)[0]  # (N, G)
        fifth = blocks[..., 2:6].contiguous().view(torch.int32)  # (N, G, 1): bit i is weight i's fifth bit
        high = (fifth >> torch.arange(32, dtype=torch.int32)) & 1  # (N, G, 32)
        nibbles = blocks[..., 6:].to(torch.int32)  # (N, G, 16): weight i low, weight i + 16 high
        low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # (N, G, 32)
        codes = (low | (high << 4)) - 16
        return {"weight_int8": codes.to(torch.int8).reshape(rows, -1), "scales": d}
    assert type_name == "Q4_K", type_name
    S = blocks.shape[1]
    d, dmin = (t[..., None] for t in _scales(blocks, type_name))  # (N, S, 1) each
    packed = blocks[..., 4:16].to(torch.int32)  # (N, S, 12): eight 6-bit scales and mins
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([first & 63, (rest & 15) | ((first >> 6) << 4)], dim=-1)  # (N, S, 8)
    mins = torch.cat([second & 63, (rest >> 4) | ((second >> 6) << 4)], dim=-1)
    scale = d * sc.float()  # (N, S, 8) float32, exact: 11 bits times 6
    zero = 8 * scale - dmin * mins.float()  # W = scale (q - 8) + zero = scale q - dmin m; one rounding
    nibbles = blocks[..., 16:].view(rows, S, 4, 1, 32)  # chunk c: sub-block 2c low, 2c + 1 high
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3).reshape(rows, S * 256)  # (N, K)
    return {"weight_int4": pack_nibbles(codes), "scales": scale.reshape(rows, -1).to(scale_dtype),
            "zeros": zero.reshape(rows, -1).to(scale_dtype)}


def plain_from_float(weight: torch.Tensor, scheme: str, group_size: Optional[int],
                     scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return scheme_class(scheme).quantize_weight(weight, group_size, scale_dtype)
