// torch.ops.lucidlm.argmax_rows: argmax_rows.c as a torch operator.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" void lucidlm_argmax_rows(const float *x, int64_t B, int64_t V, int64_t *out);

// logits (B, V) float32, V >= 1 -> (B,) int64, what logits.argmax(dim=-1) returns
static at::Tensor argmax_rows(const at::Tensor &logits) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
                "argmax_rows: logits must be float32 (B, V) with V >= 1; got ", logits.scalar_type(), " ",
                logits.sizes());
    at::Tensor x = logits.contiguous();
    at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
    lucidlm_argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
    return out;
}

TORCH_LIBRARY_FRAGMENT(lucidlm, m) {
    m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(lucidlm, CPU, m) {
    m.impl("argmax_rows", argmax_rows);
}

// torch.compile's tracing: the output's shape only (blocks32_op.cpp says why in C++)
static at::Tensor argmax_rows_meta(const at::Tensor &logits) {
    return at::empty_symint({logits.sym_size(0)}, logits.options().dtype(at::kLong));
}

TORCH_LIBRARY_IMPL(lucidlm, Meta, m) {
    m.impl("argmax_rows", argmax_rows_meta);
}
