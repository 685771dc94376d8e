// torch.ops.lucidlm.blocks_mm: the kernels of blocks32.c as a torch operator, so that eager
// calls and compiled graphs reach them through torch's dispatcher in C++ (~3 us a call; a
// Python custom op costs ~20 us, and a decode step makes ~200 of these calls).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" int lucidlm_int4_blocks_mm(const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N,
                                      const void *codes, const void *s, const void *z);
extern "C" int lucidlm_int8_blocks_mm(const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N,
                                      const void *codes, const void *s, const void *qsum);

// x (M, K) float32 or bfloat16; blocks uint8 (N/16, G, 256) for int4 or int8 (N/16, G, 512);
// scales (N/16, G, 16) bfloat16 for int4, float32 for int8; extra: the int4 zeros (bfloat16) or
// the int8 code sums (float32).
static at::Tensor blocks_mm(const at::Tensor &x_in, const at::Tensor &blocks, const at::Tensor &scales,
                            const at::Tensor &extra) {
    const bool int8 = blocks.scalar_type() == at::kChar;
    TORCH_CHECK(x_in.dim() == 2 && blocks.dim() == 3 && blocks.size(2) == (int8 ? 512 : 256),
                "blocks_mm: x must be (M, K) and blocks (N/16, K/32, ", int8 ? 512 : 256, ")");
    TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
                "blocks_mm: x must be float32 or bfloat16, got ", x_in.scalar_type());
    TORCH_CHECK(x_in.size(1) == blocks.size(1) * 32, "blocks_mm: x has ", x_in.size(1), " columns, the weights ",
                blocks.size(1) * 32);
    const auto scale_type = int8 ? at::kFloat : at::kBFloat16;
    TORCH_CHECK(scales.scalar_type() == scale_type && extra.scalar_type() == scale_type && scales.is_contiguous()
                    && blocks.is_contiguous() && extra.is_contiguous(),
                "blocks_mm: scales, zeros or sums of the wrong dtype or layout");
    // One scale and one zero (or code sum) per row and group: the kernel reads exactly that many.
    const int64_t lanes = blocks.size(0) * blocks.size(1) * 16;
    TORCH_CHECK(scales.numel() == lanes && extra.numel() == lanes, "blocks_mm: the weights need ", lanes,
                " scales and ", lanes, " ", int8 ? "code sums" : "zeros", " (one per row and group of 32), got ",
                scales.numel(), " and ", extra.numel());
    at::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0) * 16;
    at::Tensor y = at::empty({M, N}, x.options());
    if (M > 0) {
        auto fn = int8 ? lucidlm_int8_blocks_mm : lucidlm_int4_blocks_mm;
        TORCH_CHECK(fn(x.data_ptr(), y.data_ptr(), x.scalar_type() == at::kBFloat16, M, K, N, blocks.data_ptr(),
                       scales.data_ptr(), extra.data_ptr()) == 0,
                    "blocks_mm: out of memory for the quantized input (", M, " x ", K, ")");
    }
    return y;
}

TORCH_LIBRARY(lucidlm, m) {
    m.def("blocks_mm(Tensor x, Tensor blocks, Tensor scales, Tensor extra) -> Tensor");
}

TORCH_LIBRARY_IMPL(lucidlm, CPU, m) {
    m.impl("blocks_mm", blocks_mm);
}
