"""lucidlm's own table of ggml tensor types (``weights/ggml_types.py``, read without importing
``gguf``) against ``gguf.constants``, the reference: same ids, names and block sizes, and a type
the table lacks is still found through ``gguf``."""

from __future__ import annotations

import gguf
import pytest

from lucidlm.weights.ggml_types import QUANT_SIZES, GGMLType, ggml_type, quant_sizes


@pytest.mark.parametrize("ours", list(GGMLType), ids=lambda t: t.name)
def test_each_type_matches_gguf(ours):
    theirs = gguf.GGMLQuantizationType[ours.name]
    assert int(theirs) == int(ours)
    assert quant_sizes(ours) == QUANT_SIZES[ours] == gguf.GGML_QUANT_SIZES[theirs]
    assert ours == theirs and gguf.GGML_QUANT_SIZES[ours] == QUANT_SIZES[ours]  # interchangeable keys


def test_types_missing_here_come_from_gguf():
    newer = [t for t in gguf.GGMLQuantizationType if int(t) not in {int(o) for o in GGMLType}]
    for theirs in newer:
        assert ggml_type(int(theirs)) is theirs
        assert quant_sizes(ggml_type(int(theirs))) == gguf.GGML_QUANT_SIZES[theirs]
    with pytest.raises(ValueError):
        ggml_type(10_000)
