// torch.ops.lucidlm.decode_block: one decode step of a pre-norm LLaMA-style block (RMSNorm,
// fused q/k/v, RoPE, KV cache, grouped-query attention, SwiGLU MLP) in one C++ call, for B rows
// of one new token each, float32 activations and weights on lucidlm's blocks kernel.
//
// Why: an eager decode step of such a block is ~15 module calls and ~25 small torch ops, each
// a few microseconds of Python and dispatch, around ~150 us of arithmetic (SmolLM2 int4, batch
// 1): the calls cost more than the work. This file makes the same calls to the same C loops
// (blocks32.c, rms_norm_rows.c, decode_attention.c) in C++, and writes the few element-wise
// steps between them out in the order torch computes them, so the result is bit for bit what
// model/block.py computes (tests/model/test_decode_block.py holds it to that). model/block.py
// stays the definition; model/decode_block.py decides when this call may stand in for it.
//
// The element-wise loops need exact IEEE products and sums, as torch's: this file is built
// with -ffp-contract=off (blocks_kernel.py), so a * b + c * d is never fused into an FMA.
#include <algorithm>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

extern "C" int lucidlm_int4_blocks_mm(const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N,
                                      const void *codes, const void *s, const void *z);
extern "C" int lucidlm_int8_blocks_mm(const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N,
                                      const void *codes, const void *s, const void *qsum);
extern "C" void lucidlm_rms_norm_rows(const float *x, const float *w, int64_t B, int64_t D, float eps, float *out);
extern "C" int lucidlm_decode_attention(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                                        int64_t B, int64_t H, int64_t G, int64_t S, int64_t D, int64_t k_batch,
                                        int64_t k_head, int64_t k_slot, int64_t v_batch, int64_t v_head,
                                        int64_t v_slot, float scale);

namespace {

// One weight on the blocks kernel: (blocks, scales, extra) as torch.ops.lucidlm.blocks_mm takes them.
struct Blocks {
    const at::Tensor &blocks, &scales, &extra;
    const char *name;

    int64_t rows() const { return blocks.size(0) * 16; }
    int64_t columns() const { return blocks.size(1) * 32; }

    void check(int64_t in) const {
        const bool int8 = blocks.scalar_type() == at::kChar;
        const auto scale_type = int8 ? at::kFloat : at::kBFloat16;
        TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == (int8 ? 512 : 256) && blocks.is_contiguous()
                        && (int8 || blocks.scalar_type() == at::kByte),
                    "decode_block: ", name, " must be int4 (N/16, G, 256) uint8 or int8 (N/16, G, 512) blocks; got ",
                    blocks.scalar_type(), " ", blocks.sizes());
        TORCH_CHECK(columns() == in, "decode_block: ", name, " reads ", columns(), " inputs, the block gives it ", in);
        const int64_t lanes = blocks.size(0) * blocks.size(1) * 16;
        TORCH_CHECK(scales.scalar_type() == scale_type && extra.scalar_type() == scale_type && scales.is_contiguous()
                        && extra.is_contiguous() && scales.numel() == lanes && extra.numel() == lanes,
                    "decode_block: ", name, "'s scales and ", int8 ? "code sums" : "zeros", " must be ", lanes, " ",
                    scale_type, " values, contiguous");
    }

    // y (M, rows()) = x (M, columns()) @ W^T, both float32 and contiguous
    void mm(const float *x, float *y, int64_t M) const {
        auto fn = blocks.scalar_type() == at::kChar ? lucidlm_int8_blocks_mm : lucidlm_int4_blocks_mm;
        TORCH_CHECK(fn(x, y, 0, M, columns(), rows(), blocks.data_ptr(), scales.data_ptr(), extra.data_ptr()) == 0,
                    "decode_block: out of memory for ", name, "'s quantized input");
    }
};

void check_vector(const at::Tensor &w, int64_t D, const char *name) {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == D && w.scalar_type() == at::kFloat && w.is_contiguous(),
                "decode_block: ", name, " must be a contiguous float32 (", D, ",) weight; got ", w.scalar_type(), " ",
                w.sizes());
}

// RoPE on one head's hd values: out[j] = x[j] cos[j] + x[partner(j)] sin[j] (model/positions.py
// apply_rope: the two products, then their sum). partner: j + hd/2 mod hd ("half"), j ^ 1 ("interleaved").
void rotate(const float *x, const float *cos, const float *sin, int64_t hd, bool interleaved, float *out) {
    for (int64_t j = 0; j < hd; j++) {
        const int64_t partner = interleaved ? (j ^ 1) : (j + hd / 2) % hd;
        const float straight = x[j] * cos[j], crossed = x[partner] * sin[j];
        out[j] = straight + crossed;
    }
}

}  // namespace

// x (B, 1, D) float32 -> (B, 1, D): x + attn(ln1(x)), then that + mlp(ln2(that)), writing this
// token's rotated key and value at slot input_pos[0] of k_cache, v_cache (B, n_kv, S, hd) float32.
// cos, sin (B, 1, 1, hd): the rotation of each row's position (RotaryEmbedding.cos_sin); mask (B,
// 1, 1, S) bool, True = may attend; scale: the scores' factor; n_heads query heads of hd values.
static at::Tensor decode_block(const at::Tensor &x_in, const at::Tensor &ln1, double eps1, const at::Tensor &qkv_blocks,
                               const at::Tensor &qkv_scales, const at::Tensor &qkv_extra, const at::Tensor &cos_in,
                               const at::Tensor &sin_in, bool interleaved, const at::Tensor &k_cache,
                               const at::Tensor &v_cache, const at::Tensor &input_pos, const at::Tensor &mask_in,
                               double scale, int64_t n_heads, const at::Tensor &o_blocks, const at::Tensor &o_scales,
                               const at::Tensor &o_extra, const at::Tensor &ln2, double eps2,
                               const at::Tensor &gate_up_blocks, const at::Tensor &gate_up_scales,
                               const at::Tensor &gate_up_extra, const at::Tensor &down_blocks,
                               const at::Tensor &down_scales, const at::Tensor &down_extra) {
    TORCH_CHECK(x_in.dim() == 3 && x_in.size(1) == 1 && x_in.scalar_type() == at::kFloat,
                "decode_block: x must be (B, 1, D) float32, one new token per row; got ", x_in.scalar_type(), " ",
                x_in.sizes());
    const int64_t B = x_in.size(0), D = x_in.size(2);
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B
                    && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat
                    && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "decode_block: the caches must be contiguous float32 (", B, ", n_kv, S, hd); got ", k_cache.sizes(),
                " and ", v_cache.sizes());
    const int64_t n_kv = k_cache.size(1), S = k_cache.size(2), hd = k_cache.size(3);
    TORCH_CHECK(n_kv > 0 && n_heads % n_kv == 0 && hd % 8 == 0 && hd % 2 == 0,
                "decode_block: ", n_heads, " query heads cannot share ", n_kv, " kv heads of ", hd,
                " values (a multiple of 8)");
    const int64_t q_dim = n_heads * hd, kv_dim = n_kv * hd;
    TORCH_CHECK(input_pos.dim() == 1 && input_pos.numel() == 1 && input_pos.scalar_type() == at::kLong,
                "decode_block: input_pos must be one int64 slot, got ", input_pos.sizes());
    const int64_t slot = input_pos.data_ptr<int64_t>()[0];
    TORCH_CHECK(slot >= 0 && slot < S, "decode_block: slot ", slot, " is outside the cache's ", S, " slots");
    TORCH_CHECK(cos_in.numel() == B * hd && sin_in.numel() == B * hd && cos_in.scalar_type() == at::kFloat
                    && sin_in.scalar_type() == at::kFloat,
                "decode_block: cos and sin must be float32 (B, 1, 1, hd) = (", B, ", 1, 1, ", hd, ")");
    TORCH_CHECK(mask_in.scalar_type() == at::kBool && mask_in.dim() == 4 && mask_in.size(-1) == S
                    && mask_in.numel() / S == (mask_in.size(0) == 1 ? 1 : B),
                "decode_block: mask must be (B or 1, 1, 1, ", S, ") bool, got ", mask_in.sizes());
    check_vector(ln1, D, "ln1's weight");
    check_vector(ln2, D, "ln2's weight");
    const Blocks qkv{qkv_blocks, qkv_scales, qkv_extra, "the fused q/k/v"}, o{o_blocks, o_scales, o_extra, "o_proj"},
        gate_up{gate_up_blocks, gate_up_scales, gate_up_extra, "the fused gate/up"},
        down{down_blocks, down_scales, down_extra, "down_proj"};
    qkv.check(D);
    TORCH_CHECK(qkv.rows() == q_dim + 2 * kv_dim, "decode_block: the fused q/k/v gives ", qkv.rows(),
                " outputs, the heads need ", q_dim + 2 * kv_dim);
    o.check(q_dim);
    TORCH_CHECK(o.rows() == D, "decode_block: o_proj gives ", o.rows(), " outputs, the stream has ", D);
    gate_up.check(D);
    const int64_t d_mlp = gate_up.rows() / 2;
    down.check(d_mlp);
    TORCH_CHECK(down.rows() == D && gate_up.rows() % 2 == 0, "decode_block: down_proj gives ", down.rows(),
                " outputs, the stream has ", D);

    const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
    const at::Tensor mask = mask_in.expand({B, 1, 1, S}).reshape({B, S}).contiguous();
    const auto options = x.options();
    at::Tensor normed = at::empty({B, D}, options), qkv_out = at::empty({B, qkv.rows()}, options);
    at::Tensor q = at::empty({B, q_dim}, options), z = at::empty({B, q_dim}, options);
    at::Tensor attn_out = at::empty({B, D}, options), out = at::empty({B, 1, D}, options);
    float *stream = out.data_ptr<float>(), *h = normed.data_ptr<float>();

    // attention: x + o_proj(attend(rope(q), cache with rope(k), v)) over ln1(x)
    lucidlm_rms_norm_rows(x.data_ptr<float>(), ln1.data_ptr<float>(), B, D, static_cast<float>(eps1), h);
    qkv.mm(h, qkv_out.data_ptr<float>(), B);
    float *k_base = k_cache.data_ptr<float>(), *v_base = v_cache.data_ptr<float>();
    for (int64_t b = 0; b < B; b++) {
        const float *row = qkv_out.data_ptr<float>() + b * qkv.rows(), *c = cos.data_ptr<float>() + b * hd,
                    *s = sin.data_ptr<float>() + b * hd;
        for (int64_t head = 0; head < n_heads; head++)
            rotate(row + head * hd, c, s, hd, interleaved, q.data_ptr<float>() + b * q_dim + head * hd);
        for (int64_t head = 0; head < n_kv; head++) {
            const int64_t at = ((b * n_kv + head) * S + slot) * hd;  // the cache's (b, head, slot, :)
            rotate(row + q_dim + head * hd, c, s, hd, interleaved, k_base + at);
            std::copy_n(row + q_dim + kv_dim + head * hd, hd, v_base + at);
        }
    }
    TORCH_CHECK(lucidlm_decode_attention(q.data_ptr<float>(), k_base, v_base,
                                         reinterpret_cast<const uint8_t *>(mask.data_ptr<bool>()), z.data_ptr<float>(),
                                         B, n_kv, n_heads / n_kv, S, hd, k_cache.stride(0), k_cache.stride(1),
                                         k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                         static_cast<float>(scale)) == 0,
                "decode_block: out of memory for the attention scores");
    o.mm(z.data_ptr<float>(), attn_out.data_ptr<float>(), B);
    const float *x_data = x.data_ptr<float>(), *a = attn_out.data_ptr<float>();
    for (int64_t i = 0; i < B * D; i++) stream[i] = x_data[i] + a[i];

    // MLP: that + down_proj(silu(gate) * up) over ln2(that)
    lucidlm_rms_norm_rows(stream, ln2.data_ptr<float>(), B, D, static_cast<float>(eps2), h);
    at::Tensor gate_up_out = at::empty({B, 2 * d_mlp}, options);
    gate_up.mm(h, gate_up_out.data_ptr<float>(), B);
    // torch's own silu on the same (B, d_mlp) view of the gate as model/mlp.py's: its vectorized exp,
    // not libm's, so the same bits
    at::Tensor hidden = at::silu(gate_up_out.narrow(1, 0, d_mlp));
    float *hid = hidden.data_ptr<float>();
    for (int64_t b = 0; b < B; b++) {
        const float *up = gate_up_out.data_ptr<float>() + b * 2 * d_mlp + d_mlp;
        for (int64_t i = 0; i < d_mlp; i++) hid[b * d_mlp + i] *= up[i];
    }
    at::Tensor mlp_out = at::empty({B, D}, options);
    down.mm(hid, mlp_out.data_ptr<float>(), B);
    const float *m = mlp_out.data_ptr<float>();
    for (int64_t i = 0; i < B * D; i++) stream[i] += m[i];
    return out;
}

TORCH_LIBRARY_FRAGMENT(lucidlm, m) {
    m.def("decode_block(Tensor x, Tensor ln1, float eps1, Tensor qkv_blocks, Tensor qkv_scales, Tensor qkv_extra, "
          "Tensor cos, Tensor sin, bool interleaved, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor input_pos, "
          "Tensor mask, float scale, int n_heads, Tensor o_blocks, Tensor o_scales, Tensor o_extra, Tensor ln2, "
          "float eps2, Tensor gate_up_blocks, Tensor gate_up_scales, Tensor gate_up_extra, Tensor down_blocks, "
          "Tensor down_scales, Tensor down_extra) -> Tensor");
}

TORCH_LIBRARY_IMPL(lucidlm, CPU, m) {
    m.impl("decode_block", decode_block);
}
