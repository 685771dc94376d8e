"""ggml's tensor type ids and block sizes, without importing the ``gguf`` package.

``import gguf`` takes ~0.2 s (its ``__init__`` imports the writer, the lazy-tensor machinery
and more), a seventh of a fresh ``lucidlm generate`` before its first token, and a GGUF load
of the common types needs only this table: each type's id, name, weights per block and bytes
per block (ggml's ``ggml.h`` / ``ggml-common.h``; ``gguf.constants`` holds the same, and a
test checks every entry against it). A type id missing here (a newer ggml) is looked up in
``gguf`` itself, so the table never limits what the installed ``gguf`` can read.
"""

from __future__ import annotations

import enum
from typing import Any


class GGMLType(enum.IntEnum):
    """Same names and values as ``gguf.GGMLQuantizationType`` (an IntEnum too, so either
    is accepted wherever the other is: ``gguf.quants.dequantize``, ``GGML_QUANT_SIZES``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35


# (weights per block, bytes per block)
QUANT_SIZES: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24), GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144), GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292), GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98), GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110), GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136), GGMLType.I8: (1, 1), GGMLType.I16: (1, 2), GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8), GGMLType.F64: (1, 8), GGMLType.IQ1_M: (256, 56), GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 54), GGMLType.TQ2_0: (256, 66),
}


def ggml_type(kind: int) -> Any:
    """The type with id ``kind``: ours, else ``gguf``'s (a type newer than this table);
    ValueError when neither knows it."""
    try:
        return GGMLType(kind)
    except ValueError:
        import gguf

        return gguf.GGMLQuantizationType(kind)


def quant_sizes(kind: Any) -> tuple[int, int]:
    """(weights per block, bytes per block) of a type from ``ggml_type``."""
    if kind in QUANT_SIZES:
        return QUANT_SIZES[kind]
    import gguf

    return gguf.GGML_QUANT_SIZES[kind]
