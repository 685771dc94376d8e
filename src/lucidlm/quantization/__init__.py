"""Weight-only quantization by module swap (gpt-fast's design).

    lucidlm.quantize(model, "int8")                 # per output channel
    lucidlm.quantize(model, "int8", group_size=32)  # per group (GGUF Q8_0's layout)
    lucidlm.quantize(model, "int4")                 # groups of 32 (64, 128, 256: group_size=...)
    lucidlm.load("smollm2-135m", quantize="int4")

One file per scheme (``int8.py``, ``int4.py``): a ``QuantizedLinear`` subclass that defines
the codes, their file layout and the kernel. ``base.py`` holds the shared contract and the
quantized embedding; ``swap.py`` swaps modules and rebuilds them from files. A new scheme is
a new file plus one entry in ``swap.SCHEMES``. Which kernel multiplies is the scheme's choice:
torch's, or for groups of 32 on AVX-512 VNNI CPUs lucidlm's own (``blocks_kernel.py``, C in
``kernels/``), which the embedded model's default load picks.
"""

from lucidlm.quantization.base import DEFAULT_COMPUTE_DTYPE, QuantizedEmbedding, QuantizedLinear, dense_weight
from lucidlm.quantization.int4 import Int4Linear
from lucidlm.quantization.int8 import Int8Linear
from lucidlm.quantization.swap import (SCHEMES, dequantize, install_quantized, is_quantized, quantization_layout,
                                       quantize, scheme_class)

__all__ = ["quantize", "QuantizedLinear", "QuantizedEmbedding", "Int8Linear", "Int4Linear", "SCHEMES",
           "DEFAULT_COMPUTE_DTYPE", "dense_weight", "dequantize", "install_quantized", "is_quantized", "quantization_layout", "scheme_class"]
