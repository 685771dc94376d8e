"""int8 weight-only quantization: symmetric, per output channel (default) or per group.

Scheme (what the codes mean), for row n and input column k in group j = k // group_size
(one group spanning the whole row when group_size is None):

    W[n, k] = scales[n, j] * weight_int8[n, k],    weight_int8 in [-127, 127]
    scales[n, j] = max |W[n, group j]| / 127        (rounded to the compute dtype first,
                                                     and the codes computed with that scale)

Plain layout (state_dict / files): ``weight_int8`` int8 (out, in), ``scales`` (out, groups)
in the compute dtype. It is also the kernel layout.

Kernels: per channel on CPU, ``torch.ops.aten._weight_int8pack_mm`` (int8 x bf16 -> bf16,
scales applied per output). Per group there is no fused torch kernel: the group scales are
applied to the codes in the compute dtype and ``F.linear`` runs on the result (exact, but
it reads the weight twice; ``torch.compile`` fuses it). GGUF Q8_0 (blocks of 32) and Q6_K
(blocks of 16) land here per group.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lucidlm.quantization.base import QuantizedLinear

QMAX = 127


class Int8Linear(QuantizedLinear):
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
        scales = plain["scales"].to(self.compute_dtype).reshape(codes.shape[0], -1).contiguous()
        self.register_buffer("weight_int8", codes)
        self.register_buffer("scales", scales)

    def plain_state(self) -> dict[str, torch.Tensor]:
        return {"weight_int8": self.weight_int8, "scales": self.scales}

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.group_size is None:
            if x.device.type == "cpu" and x.dtype == torch.bfloat16:
                return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales[:, 0])  # (M, N)
            return F.linear(x, self.weight_int8.to(x.dtype)) * self.scales[:, 0]
        N, K = self.weight_int8.shape
        g = self.group_size
        weight = (self.weight_int8.reshape(N, K // g, g).to(x.dtype) * self.scales[..., None]).reshape(N, K)
        return F.linear(x, weight)
