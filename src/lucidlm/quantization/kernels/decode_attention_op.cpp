// torch.ops.lucidlm.decode_attention: decode_attention.c as a torch operator (eager calls and
// compiled graphs reach it through the dispatcher, as blocks_mm).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" int lucidlm_decode_attention(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                                        int64_t B, int64_t T, int64_t H, int64_t G, int64_t S, int64_t D,
                                        int64_t k_batch, int64_t k_head, int64_t k_slot, int64_t v_batch,
                                        int64_t v_head, int64_t v_slot, float scale);

// q (B, H, G, D) float32: one query per head, the G query heads of each kv head together;
// k, v (B, H, S, D) float32, each slot's D values contiguous (a cache, a slice of one, a token's own);
// mask (B, S) bool, True = may attend. Returns (B, H, G, D).
static at::Tensor decode_attention(const at::Tensor &q_in, const at::Tensor &k, const at::Tensor &v,
                                   const at::Tensor &mask_in, double scale) {
    TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask_in.dim() == 2,
                "decode_attention: q, k, v must be 4-D (B, H, G or S, D) and mask (B, S); got ", q_in.sizes(), ", ",
                k.sizes(), ", ", v.sizes(), ", ", mask_in.sizes());
    TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat
                    && mask_in.scalar_type() == at::kBool,
                "decode_attention: q, k, v must be float32 and mask bool");
    const int64_t B = q_in.size(0), H = q_in.size(1), G = q_in.size(2), D = q_in.size(3), S = k.size(2);
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == H && k.size(3) == D
                    && mask_in.size(0) == B && mask_in.size(1) == S,
                "decode_attention: shapes do not agree: q ", q_in.sizes(), ", k ", k.sizes(), ", v ", v.sizes(),
                ", mask ", mask_in.sizes());
    TORCH_CHECK(D % 8 == 0 && k.stride(3) == 1 && v.stride(3) == 1,
                "decode_attention: the head size must be a multiple of 8 and each slot's values contiguous; got D = ", D,
                ", k strides ", k.strides(), ", v strides ", v.strides());
    at::Tensor q = q_in.contiguous(), mask = mask_in.contiguous();
    at::Tensor out = at::empty({B, H, G, D}, q.options());
    if (out.numel() > 0)
        TORCH_CHECK(lucidlm_decode_attention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                             reinterpret_cast<const uint8_t *>(mask.data_ptr<bool>()),
                                             out.data_ptr<float>(), B, 1, H, G, S, D, k.stride(0), k.stride(1), k.stride(2),
                                             v.stride(0), v.stride(1), v.stride(2), static_cast<float>(scale)) == 0,
                    "decode_attention: out of memory for the scores (", B, " x ", H, " x ", G, " x ", S, ")");
    return out;
}

TORCH_LIBRARY_FRAGMENT(lucidlm, m) {
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lucidlm, CPU, m) {
    m.impl("decode_attention", decode_attention);
}

// torch.compile's tracing: the output's shape only (blocks32_op.cpp says why in C++)
static at::Tensor decode_attention_meta(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                        const at::Tensor &mask, double scale) {
    return at::empty_symint(q.sym_sizes(), q.options());
}

TORCH_LIBRARY_IMPL(lucidlm, Meta, m) {
    m.impl("decode_attention", decode_attention_meta);
}
