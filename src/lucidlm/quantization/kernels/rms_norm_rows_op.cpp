// torch.ops.lucidlm.rms_norm_rows: rms_norm_rows.c as a torch operator.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" void lucidlm_rms_norm_rows(const float *x, const float *w, int64_t B, int64_t D, float eps, float *out);

// x (..., D) float32, weight (D,) float32, D >= 1 -> (..., D): F.rms_norm(x, (D,), weight, eps)
static at::Tensor rms_norm_rows(const at::Tensor &x, const at::Tensor &weight, double eps) {
    TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                    weight.dim() == 1 && x.size(-1) == weight.size(0) && weight.size(0) > 0,
                "rms_norm_rows: x must be float32 (..., D) and weight float32 (D,) with D >= 1; got ",
                x.scalar_type(), " ", x.sizes(), " and ", weight.scalar_type(), " ", weight.sizes());
    const int64_t D = x.size(-1);
    at::Tensor rows = x.contiguous(), w = weight.contiguous();
    at::Tensor out = at::empty(x.sizes(), rows.options());
    lucidlm_rms_norm_rows(rows.data_ptr<float>(), w.data_ptr<float>(), rows.numel() / D, D, static_cast<float>(eps),
                          out.data_ptr<float>());
    return out;
}

TORCH_LIBRARY_FRAGMENT(lucidlm, m) {
    m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(lucidlm, CPU, m) {
    m.impl("rms_norm_rows", rms_norm_rows);
}

// torch.compile's tracing: the output's shape only (blocks32_op.cpp says why in C++)
static at::Tensor rms_norm_rows_meta(const at::Tensor &x, const at::Tensor &weight, double eps) {
    return at::empty_symint(x.sym_sizes(), x.options());
}

TORCH_LIBRARY_IMPL(lucidlm, Meta, m) {
    m.impl("rms_norm_rows", rms_norm_rows_meta);
}
