"""int8 weight-only quantization: symmetric, per output channel (default) or per group.

Scheme (what the codes mean), for row n and input column k in group j = k // group_size
(one group spanning the whole row when group_size is None):

    W[n, k] = scales[n, j] * weight_int8[n, k],    weight_int8 in [-127, 127]
    scales[n, j] = max |W[n, group j]| / 127        (rounded to the compute dtype first,
                                                     and the codes computed with that scale)

Plain layout (state_dict / files): ``weight_int8`` int8 (out, in), ``scales`` (out, groups)
in the compute dtype, or float32 where they came so (a GGUF Q8_0 file's float16 scales, kept
exact). It is also torch's kernel layout.

Kernels: per channel on CPU, ``torch.ops.aten._weight_int8pack_mm`` (int8 x bf16 -> bf16,
scales applied per output). Per group there is no fused torch kernel: the group scales are
applied to the codes in the compute dtype and ``F.linear`` runs on the result (exact, but
it reads the weight twice; ``torch.compile`` fuses it). GGUF Q8_0 (blocks of 32) and Q6_K
(blocks of 16) land here per group. Groups of 32 made inside ``blocks_kernel.prefer()`` (the
embedded model's default load) use lucidlm's own kernel instead (``blocks_kernel.py``), its
codes in that kernel's layout and its scales kept as given in float32 (a GGUF Q8_0 file's
float16 scales exactly; rounded to bfloat16 they flipped the embedded model's sampled answers).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lucidlm.quantization import blocks_kernel
from lucidlm.quantization.base import BLOCKS_KERNEL_DTYPES, DEFAULT_COMPUTE_DTYPE, QuantizedLinear

QMAX = 127


class Int8Linear(QuantizedLinear):
    """A linear layer with int8 weights: symmetric codes in [-127, 127] and one scale per output
    channel (default) or per group of ``group_size`` input columns (module docstring). Built by
    ``quantize(model, "int8")``; y = x @ (scales * codes).T + b, in the compute dtype."""

    scheme = "int8"
    default_group_size = None  # per output channel
    plain_names = ("weight_int8", "scales")

    @staticmethod
    def quantize_weight(weight: torch.Tensor, group_size: Optional[int],
                        scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        N, K = weight.shape
        g = group_size or K
        grouped = weight.float().reshape(N, K // g, g)  # (N, G, g)
        scales = (grouped.abs().amax(-1) / QMAX).to(scale_dtype)  # (N, G)
        safe = scales.float().masked_fill(scales.float() == 0, 1.0)  # an all-zero group: codes 0
        codes = torch.round(grouped / safe[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
        return {"weight_int8": codes.reshape(N, K), "scales": scales}

    @staticmethod
    def dequantize_plain(plain: dict[str, torch.Tensor], group_size: Optional[int]) -> torch.Tensor:
        codes, scales = plain["weight_int8"], plain["scales"]
        N, K = codes.shape
        g = group_size or K
        return (codes.reshape(N, K // g, g).float() * scales.float()[..., None]).reshape(N, K)

    def _install(self, plain: dict[str, torch.Tensor]) -> None:
        codes = plain["weight_int8"].to(torch.int8).contiguous()
        if codes.data_ptr() % 64:
            # torch's _weight_int8pack_mm crashes the process on codes not 16-byte aligned, and
            # safetensors' load_file hands out views of one file buffer at the file's offsets
            # (a model saved with --quantize int8 segfaulted on its first forward): a fresh copy,
            # which torch's allocator places on a 64-byte boundary (the check asks for that)
            codes = codes.clone()
        N = codes.shape[0]
        # float32 scales (exact GGUF Q8_0 ones) stay float32; others take the compute dtype
        self.scale_dtype = torch.float32 if plain["scales"].dtype == torch.float32 else self.compute_dtype
        if codes.device.type == "cpu" and self.blocks_kernel_fits(N):  # the kernel reads float32 scales
            self._install_blocks(codes, plain["scales"].to(self.scale_dtype).float().reshape(N, -1))
            return
        self.installs += 1
        self.uses_blocks_kernel = False
        self.code_blocks = self.block_scales = self.code_sums = None
        self.register_buffer("weight_int8", codes)
        self.register_buffer("scales", plain["scales"].to(self.scale_dtype).reshape(N, -1).contiguous())

    def _install_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """The codes ((N, K), or (N, G, 32) possibly strided) in lucidlm's kernel layout only."""
        self._install_block_lanes(blocks_kernel.int8_blocks_from_codes(codes), blocks_kernel.lanes_from_rows(scales),
                                  blocks_kernel.int8_code_sums(codes))

    def _install_block_lanes(self, code_blocks: torch.Tensor, block_scales: torch.Tensor,
                             code_sums: torch.Tensor) -> None:
        """Codes (N/16, G, 512), float32 scales and code sums (N/16, G, 16), all in the kernel's layout."""
        self.installs += 1
        self.uses_blocks_kernel = True
        self.register_buffer("weight_int8", None)
        self.register_buffer("scales", None)
        self.register_buffer("code_blocks", code_blocks)
        self.register_buffer("block_scales", block_scales)
        self.register_buffer("code_sums", code_sums)

    @classmethod
    def from_group_codes(cls, codes: torch.Tensor, scales: torch.Tensor,
                         compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> "Int8Linear":
        """A module in groups of 32 from codes (N, G, 32) int8, which may be a strided view of
        a GGUF file's Q8_0 blocks, and float32 scales (N, G): straight into lucidlm's kernel
        layout where it applies (one copy of the codes), else through the plain layout."""
        N, G, _ = codes.shape
        module = cls(G * 32, N, False, 32, compute_dtype)
        if codes.device.type == "cpu" and module.blocks_kernel_fits(N):
            module.scale_dtype = scales.dtype
            module._install_blocks(codes, scales.float())
            return module
        module._install({"weight_int8": codes.reshape(N, G * 32), "scales": scales})
        return module

    @classmethod
    def from_q8_blocks(cls, blocks: torch.Tensor, rows: Optional[torch.Tensor] = None,
                       compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> Optional[tuple["Int8Linear", int]]:
        """(A module in groups of 32 from GGUF Q8_0 blocks, how many of those blocks have a scale
        that is NaN or infinite). blocks: (N, G, 34) uint8 (a view of the file's map); output
        row n is taken from row ``rows[n]`` (all rows in order when None). One C pass
        (``torch.ops.lucidlm.q8_blocks_into``) writes lucidlm's kernel layout, the codes
        reordered, d in float32 (exact) and each group's code sum, and counts the non-finite
        scales on the way, so a loader need not read them again. None where that layout does
        not apply."""
        N, G, _ = blocks.shape
        module = cls(G * 32, N, False, 32, compute_dtype)
        if blocks.device.type != "cpu" or not module.blocks_kernel_fits(N):
            return None
        lanes = (N // blocks_kernel.ROW_BLOCK, G)
        out = (torch.empty((*lanes, 512), dtype=torch.int8),
               *(torch.empty((*lanes, 16), dtype=torch.float32) for _ in range(2)))
        nonfinite = torch.ops.lucidlm.q8_blocks_into(blocks, rows, *out)
        module.scale_dtype = torch.float32  # Q8_0's float16 scales, exactly
        module._install_block_lanes(*out)
        return module, nonfinite

    def plain_state(self) -> dict[str, torch.Tensor]:
        if self.uses_blocks_kernel:
            return {"weight_int8": blocks_kernel.int8_codes_from_blocks(self.code_blocks),
                    "scales": blocks_kernel.rows_from_lanes(self.block_scales).to(self.scale_dtype).contiguous()}
        return {"weight_int8": self.weight_int8, "scales": self.scales}

    def blocks_operands(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        b = self._buffers  # read directly: a decode step asks for 120 of these (base.py)
        return (b["code_blocks"], b["block_scales"], b["code_sums"]) if self.uses_blocks_kernel else None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_blocks_kernel and x.dtype in BLOCKS_KERNEL_DTYPES:
            return blocks_kernel.blocks_mm(x, *self.blocks_operands())  # (M, N)
        if self.group_size is None:
            # torch's kernel reads K in blocks of 16: any other width gives garbage (and past the
            # end of x, a crash with several rows), so those take the plain path
            if x.device.type == "cpu" and x.dtype == torch.bfloat16 and self.in_features % 16 == 0:
                return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales[:, 0].to(x.dtype))  # (M, N)
            return F.linear(x, self.weight_int8.to(x.dtype)) * self.scales[:, 0].to(x.dtype)
        N, K = self.weight_int8.shape
        g = self.group_size
        scales = self.scales[..., None]  # (N, G, 1); float32 ones apply before the rounding to x's dtype
        weight = (self.weight_int8.reshape(N, K // g, g).to(scales.dtype) * scales).to(x.dtype).reshape(N, K)
        return F.linear(x, weight)
