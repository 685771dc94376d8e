// torch.ops.lucidlm.decode_block: one decode step of a pre-norm block of the LLaMA kind (RMSNorm,
// q/k/v, RoPE, KV cache, grouped-query attention, gated MLP; Qwen 3 / Gemma 3's q/k norms and
// Gemma's sandwich norms optional) in one C++ call, for B rows of T new tokens each (one in a
// plain decode step, a few where speculative decoding checks its drafts), float32 activations
// and every matmul on lucidlm's blocks kernel.
//
// Why: an eager decode step of such a block is ~15 module calls and ~25 small torch ops, each
// a few microseconds of Python and dispatch, around ~150 us of arithmetic (SmolLM2 int4, batch
// 1): the calls cost more than the work. This file makes the same calls to the same C loops
// (blocks32.c, rms_norm_rows.c, decode_attention.c) in C++, and writes the few element-wise
// steps between them out in the order torch computes them, so the result is bit for bit what
// model/block.py computes (tests/model/test_decode_block.py holds it to that). T tokens at once
// give exactly what T one-token steps give: every step here treats each token's row on its own
// (the blocks kernel's rows do not mix), and each token's attention reads only the slots up to
// its own. (The modules' T-token pass attends through SDPA, summed in another order.) model/block.py
// stays the definition; model/decode_block.py decides when this call may stand in for it.
// torch.ops.lucidlm.decode_stack (at the end) runs decode_block for every layer of a model in
// one call.
//
// The element-wise loops need exact IEEE products and sums, as torch's: this file is built
// with -ffp-contract=off (blocks_kernel.py), so a * b + c * d is never fused into an FMA.
#include <algorithm>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

extern "C" int lucidlm_int4_blocks_mm(const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N,
                                      const void *codes, const void *s, const void *z);
extern "C" int lucidlm_int8_blocks_mm(const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N,
                                      const void *codes, const void *s, const void *qsum);
extern "C" void lucidlm_rms_norm_rows(const float *x, const float *w, int64_t B, int64_t D, float eps, float *out);
extern "C" int lucidlm_decode_attention(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                                        int64_t B, int64_t T, int64_t H, int64_t G, int64_t S, int64_t D,
                                        int64_t k_batch, int64_t k_head, int64_t k_slot, int64_t v_batch,
                                        int64_t v_head, int64_t v_slot, float scale);

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
// apply_rope: the two products, then their sum). partner(j): j + hd/2 for the first half and
// j - hd/2 for the second ("half"), j + 1 for even j and j - 1 for odd ("interleaved").
void rotate(const float *__restrict x, const float *__restrict cos, const float *__restrict sin, int64_t hd,
            bool interleaved, float *__restrict out) {
    if (interleaved) {
        for (int64_t j = 0; j < hd; j += 2) {
            const float even = x[j] * cos[j] + x[j + 1] * sin[j], odd = x[j + 1] * cos[j + 1] + x[j] * sin[j + 1];
            out[j] = even, out[j + 1] = odd;
        }
        return;
    }
    const int64_t half = hd / 2;
    for (int64_t j = 0; j < half; j++) out[j] = x[j] * cos[j] + x[j + half] * sin[j];
    for (int64_t j = half; j < hd; j++) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

}  // namespace

// The operands of one matmul (blocks, scales, extra) starting at `at` in a list of them.
static Blocks blocks_at(at::TensorList list, size_t at, const char *name) {
    return Blocks{list[at], list[at + 1], list[at + 2], name};
}

// An optional RMSNorm weight: nullptr where absent, else checked to be (D,) float32.
static const float *optional_norm(const std::optional<at::Tensor> &w, int64_t D, const char *name) {
    if (!w.has_value()) return nullptr;
    check_vector(*w, D, name);
    return w->data_ptr<float>();
}

// x (B, T, D) float32 -> (B, T, D), a pre-norm block's decode step for T new tokens a row:
//     x = x + post1(o_proj(attend(rope(qn(q)), rope(kn(k)), v)))     q, k, v from ln1(x)
//     x = x + post2(down_proj(act(gate) * up))                      gate, up from ln2(x)
// writing token t's rotated key and its value at slot input_pos[t] of k_cache, v_cache
// (B, n_kv, S, hd) float32, every token's before any attends. qkv: one matmul's operands
// (q/k/v fused, 3 tensors) or three (9); gate_up: one (fused) or two (6); o, down: one each.
// q_norm, k_norm (hd,): Qwen 3 / Gemma 3's RMSNorm of each head's query and key; ln1_post,
// ln2_post (D,): Gemma's sandwich norms; each optional. activation: 0 silu (SwiGLU), 1 gelu
// with tanh (GeGLU). cos, sin (B, T, 1, hd): each token's rotation (RotaryEmbedding.cos_sin);
// mask (B or 1, 1, T, S) bool, True = may attend; scale: the scores' factor; n_heads query
// heads of hd values.
static at::Tensor decode_block(const at::Tensor &x_in, const at::Tensor &ln1, double eps1, at::TensorList qkv_ops,
                               const std::optional<at::Tensor> &q_norm, const std::optional<at::Tensor> &k_norm,
                               double qk_eps, const at::Tensor &cos_in, const at::Tensor &sin_in, bool interleaved,
                               const at::Tensor &k_cache, const at::Tensor &v_cache, const at::Tensor &input_pos,
                               const at::Tensor &mask_in, double scale, int64_t n_heads, at::TensorList o_ops,
                               const std::optional<at::Tensor> &ln1_post, double eps1_post, const at::Tensor &ln2,
                               double eps2, at::TensorList gate_up_ops, int64_t activation, at::TensorList down_ops,
                               const std::optional<at::Tensor> &ln2_post, double eps2_post) {
    TORCH_CHECK(x_in.dim() == 3 && x_in.size(1) >= 1 && x_in.scalar_type() == at::kFloat,
                "decode_block: x must be (B, T, D) float32, T >= 1 new tokens per row; got ", x_in.scalar_type(), " ",
                x_in.sizes());
    const int64_t B = x_in.size(0), T = x_in.size(1), D = x_in.size(2), N = B * T;  // N: the token rows
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B
                    && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat
                    && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "decode_block: the caches must be contiguous float32 (", B, ", n_kv, S, hd); got ", k_cache.sizes(),
                " and ", v_cache.sizes());
    const int64_t n_kv = k_cache.size(1), S = k_cache.size(2), hd = k_cache.size(3);
    TORCH_CHECK(n_kv > 0 && n_heads % n_kv == 0 && hd % 8 == 0,
                "decode_block: ", n_heads, " query heads cannot share ", n_kv, " kv heads of ", hd,
                " values (a multiple of 8)");
    const int64_t q_dim = n_heads * hd, kv_dim = n_kv * hd;
    TORCH_CHECK(input_pos.dim() == 1 && input_pos.numel() == T && input_pos.scalar_type() == at::kLong
                    && input_pos.device().is_cpu(),
                "decode_block: input_pos must be ", T, " int64 slots, one a token; got ", input_pos.sizes());
    const at::Tensor slots = input_pos.contiguous();
    const int64_t *slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; t++)
        TORCH_CHECK(slot[t] >= 0 && slot[t] < S, "decode_block: slot ", slot[t], " is outside the cache's ", S,
                    " slots");
    TORCH_CHECK(cos_in.numel() == N * hd && sin_in.numel() == N * hd && cos_in.scalar_type() == at::kFloat
                    && sin_in.scalar_type() == at::kFloat,
                "decode_block: cos and sin must be float32 (B, T, 1, hd) = (", B, ", ", T, ", 1, ", hd, ")");
    TORCH_CHECK(mask_in.scalar_type() == at::kBool && mask_in.dim() == 4 && mask_in.size(1) == 1
                    && mask_in.size(2) == T && mask_in.size(3) == S && (mask_in.size(0) == 1 || mask_in.size(0) == B),
                "decode_block: mask must be (B or 1, 1, ", T, ", ", S, ") bool, got ", mask_in.sizes());
    TORCH_CHECK(activation == 0 || activation == 1, "decode_block: activation must be 0 (silu) or 1 (gelu tanh), got ",
                activation);
    TORCH_CHECK((qkv_ops.size() == 3 || qkv_ops.size() == 9) && (gate_up_ops.size() == 3 || gate_up_ops.size() == 6)
                    && o_ops.size() == 3 && down_ops.size() == 3,
                "decode_block: qkv takes 3 or 9 tensors, gate_up 3 or 6, o and down 3 each; got ", qkv_ops.size(), ", ",
                gate_up_ops.size(), ", ", o_ops.size(), ", ", down_ops.size());
    check_vector(ln1, D, "ln1's weight");
    check_vector(ln2, D, "ln2's weight");
    const float *qn = optional_norm(q_norm, hd, "q_norm's weight"), *kn = optional_norm(k_norm, hd, "k_norm's weight"),
                *post1 = optional_norm(ln1_post, D, "ln1_post's weight"),
                *post2 = optional_norm(ln2_post, D, "ln2_post's weight");

    // q/k/v: one fused matmul whose output rows hold q, k, v side by side, or one each
    const bool fused_qkv = qkv_ops.size() == 3;
    std::vector<Blocks> qkv_mms;
    if (fused_qkv) {
        qkv_mms.push_back(blocks_at(qkv_ops, 0, "the fused q/k/v"));
        qkv_mms[0].check(D);
        TORCH_CHECK(qkv_mms[0].rows() == q_dim + 2 * kv_dim, "decode_block: the fused q/k/v gives ", qkv_mms[0].rows(),
                    " outputs, the heads need ", q_dim + 2 * kv_dim);
    } else {
        const char *names[] = {"q_proj", "k_proj", "v_proj"};
        const int64_t widths[] = {q_dim, kv_dim, kv_dim};
        for (int i = 0; i < 3; i++) {
            qkv_mms.push_back(blocks_at(qkv_ops, 3 * i, names[i]));
            qkv_mms[i].check(D);
            TORCH_CHECK(qkv_mms[i].rows() == widths[i], "decode_block: ", names[i], " gives ", qkv_mms[i].rows(),
                        " outputs, the heads need ", widths[i]);
        }
    }
    const Blocks o = blocks_at(o_ops, 0, "o_proj"), down = blocks_at(down_ops, 0, "down_proj");
    o.check(q_dim);
    TORCH_CHECK(o.rows() == D, "decode_block: o_proj gives ", o.rows(), " outputs, the stream has ", D);
    const bool fused_gate_up = gate_up_ops.size() == 3;
    std::vector<Blocks> gate_up_mms;
    if (fused_gate_up) {
        gate_up_mms.push_back(blocks_at(gate_up_ops, 0, "the fused gate/up"));
        gate_up_mms[0].check(D);
        TORCH_CHECK(gate_up_mms[0].rows() % 2 == 0, "decode_block: the fused gate/up gives an odd ",
                    gate_up_mms[0].rows(), " outputs");
    } else {
        gate_up_mms.push_back(blocks_at(gate_up_ops, 0, "gate_proj"));
        gate_up_mms.push_back(blocks_at(gate_up_ops, 3, "up_proj"));
        gate_up_mms[0].check(D);
        gate_up_mms[1].check(D);
        TORCH_CHECK(gate_up_mms[0].rows() == gate_up_mms[1].rows(), "decode_block: gate_proj gives ",
                    gate_up_mms[0].rows(), " outputs, up_proj ", gate_up_mms[1].rows());
    }
    const int64_t d_mlp = fused_gate_up ? gate_up_mms[0].rows() / 2 : gate_up_mms[0].rows();
    down.check(d_mlp);
    TORCH_CHECK(down.rows() == D, "decode_block: down_proj gives ", down.rows(), " outputs, the stream has ", D);

    const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
    const at::Tensor mask = mask_in.expand({B, 1, T, S}).reshape({N, S}).contiguous();
    const auto options = x.options();
    at::Tensor normed = at::empty({N, D}, options), q = at::empty({N, q_dim}, options), z = at::empty({N, q_dim}, options);
    at::Tensor branch = at::empty({N, D}, options), out = at::empty({B, T, D}, options);
    float *stream = out.data_ptr<float>(), *h = normed.data_ptr<float>(), *br = branch.data_ptr<float>();

    // attention
    lucidlm_rms_norm_rows(x.data_ptr<float>(), ln1.data_ptr<float>(), N, D, static_cast<float>(eps1), h);
    // each of q, k, v: where its token row r starts and how far apart rows are
    at::Tensor qkv_out[3];
    const float *part[3];
    int64_t part_stride[3];
    if (fused_qkv) {
        qkv_out[0] = at::empty({N, q_dim + 2 * kv_dim}, options);
        qkv_mms[0].mm(h, qkv_out[0].data_ptr<float>(), N);
        const float *base = qkv_out[0].data_ptr<float>();
        part[0] = base, part[1] = base + q_dim, part[2] = base + q_dim + kv_dim;
        part_stride[0] = part_stride[1] = part_stride[2] = q_dim + 2 * kv_dim;
    } else {
        for (int i = 0; i < 3; i++) {
            qkv_out[i] = at::empty({N, qkv_mms[i].rows()}, options);
            qkv_mms[i].mm(h, qkv_out[i].data_ptr<float>(), N);
            part[i] = qkv_out[i].data_ptr<float>();
            part_stride[i] = qkv_mms[i].rows();
        }
    }
    float *k_base = k_cache.data_ptr<float>(), *v_base = v_cache.data_ptr<float>();
    std::vector<float> head(hd);
    for (int64_t r = 0; r < N; r++) {  // token t = r % T of row b = r / T
        const int64_t b = r / T, t = r % T;
        const float *c = cos.data_ptr<float>() + r * hd, *s = sin.data_ptr<float>() + r * hd;
        for (int64_t i = 0; i < n_heads; i++) {
            const float *raw = part[0] + r * part_stride[0] + i * hd;
            if (qn) lucidlm_rms_norm_rows(raw, qn, 1, hd, static_cast<float>(qk_eps), head.data()), raw = head.data();
            rotate(raw, c, s, hd, interleaved, q.data_ptr<float>() + r * q_dim + i * hd);
        }
        for (int64_t i = 0; i < n_kv; i++) {
            const int64_t at = ((b * n_kv + i) * S + slot[t]) * hd;  // the cache's (b, i, slot, :)
            const float *raw = part[1] + r * part_stride[1] + i * hd;
            if (kn) lucidlm_rms_norm_rows(raw, kn, 1, hd, static_cast<float>(qk_eps), head.data()), raw = head.data();
            rotate(raw, c, s, hd, interleaved, k_base + at);
            std::copy_n(part[2] + r * part_stride[2] + i * hd, hd, v_base + at);
        }
    }
    TORCH_CHECK(lucidlm_decode_attention(q.data_ptr<float>(), k_base, v_base,
                                         reinterpret_cast<const uint8_t *>(mask.data_ptr<bool>()), z.data_ptr<float>(),
                                         B, T, n_kv, n_heads / n_kv, S, hd, k_cache.stride(0), k_cache.stride(1),
                                         k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                         static_cast<float>(scale)) == 0,
                "decode_block: out of memory for the attention scores");
    o.mm(z.data_ptr<float>(), br, N);
    if (post1) lucidlm_rms_norm_rows(br, post1, N, D, static_cast<float>(eps1_post), br);
    const float *x_data = x.data_ptr<float>();
    for (int64_t i = 0; i < N * D; i++) stream[i] = x_data[i] + br[i];

    // MLP
    lucidlm_rms_norm_rows(stream, ln2.data_ptr<float>(), N, D, static_cast<float>(eps2), h);
    at::Tensor gate, up;  // (N, d_mlp) each: views of the fused output, or the two outputs
    if (fused_gate_up) {
        at::Tensor both = at::empty({N, 2 * d_mlp}, options);
        gate_up_mms[0].mm(h, both.data_ptr<float>(), N);
        gate = both.narrow(1, 0, d_mlp), up = both.narrow(1, d_mlp, d_mlp);
    } else {
        gate = at::empty({N, d_mlp}, options), up = at::empty({N, d_mlp}, options);
        gate_up_mms[0].mm(h, gate.data_ptr<float>(), N);
        gate_up_mms[1].mm(h, up.data_ptr<float>(), N);
    }
    // torch's own activation on the same (N, d_mlp) view of the gate as model/mlp.py's: its
    // vectorized exp and tanh, not libm's, so the same bits. Below torch's grain size its call
    // runs on one thread while the other waits (~6 us a layer at 8 rows of SmolLM2's 1536), so
    // the rows are shared out here, each share through the same call: where every row starts a
    // whole number of torch's vector steps (32 floats at most) from the first, a share is cut
    // exactly where the whole call's loop would be, and gives the same bits.
    at::Tensor hidden = at::empty({N, d_mlp}, options);
    const auto activate = [&](int64_t b0, int64_t b1) {
        at::Tensor rows = hidden.narrow(0, b0, b1 - b0), gates = gate.narrow(0, b0, b1 - b0);
        activation == 0 ? at::silu_out(rows, gates) : at::gelu_out(rows, gates, "tanh");
        float *hid = rows.data_ptr<float>();
        for (int64_t b = b0; b < b1; b++) {
            const float *u = up.data_ptr<float>() + b * up.stride(0);
            for (int64_t i = 0; i < d_mlp; i++) hid[(b - b0) * d_mlp + i] *= u[i];
        }
    };
    if (N > 1 && d_mlp % 32 == 0 && N * d_mlp < at::internal::GRAIN_SIZE)
        at::parallel_for(0, N, 1, activate);
    else
        activate(0, N);
    down.mm(hidden.data_ptr<float>(), br, N);
    if (post2) lucidlm_rms_norm_rows(br, post2, N, D, static_cast<float>(eps2_post), br);
    for (int64_t i = 0; i < N * D; i++) stream[i] += br[i];
    return out;
}

// x (B, T, D) -> the output of n_layers blocks' decode steps, one after the other: decode_block
// above for each layer, in one call. Why: at SmolLM2's size a layer's step is ~140 us of
// arithmetic at batch 1, and each decode_block call from Python (the module call, the checks of
// model/decode_block.py, boxing its 26 arguments) adds ~30 us more: ~1 ms of a 7 ms token. The
// per-layer arguments of decode_block come flattened, layer after layer:
//     norms          ln1, ln2 (2 a layer)
//     optional_norms q_norm, k_norm, ln1_post, ln2_post (4 a layer; None where absent)
//     matmuls        the operands of qkv, o, gate_up, down, as many as matmul_counts says
//     matmul_counts  how many tensors each of those four takes (4 a layer)
//     cos, sin, masks, k_caches, v_caches (1 a layer: local and global layers differ)
//     floats         eps1, qk_eps, scale, eps1_post, eps2, eps2_post (6 a layer)
//     ints           interleaved, n_heads, activation (3 a layer)
// and each layer is checked by decode_block as it comes.
static at::Tensor decode_stack(const at::Tensor &x_in, at::TensorList norms,
                               const c10::List<std::optional<at::Tensor>> &optional_norms, at::TensorList matmuls,
                               at::IntArrayRef matmul_counts, at::TensorList cos, at::TensorList sin,
                               at::TensorList masks, at::TensorList k_caches, at::TensorList v_caches,
                               const at::Tensor &input_pos, at::ArrayRef<double> floats, at::IntArrayRef ints) {
    const size_t L = k_caches.size();
    TORCH_CHECK(norms.size() == 2 * L && optional_norms.size() == 4 * L && matmul_counts.size() == 4 * L
                    && cos.size() == L && sin.size() == L && masks.size() == L && v_caches.size() == L
                    && floats.size() == 6 * L && ints.size() == 3 * L,
                "decode_stack: for ", L, " layers (one k cache each) it takes 2 norms, 4 optional norms, 4 matmul "
                "counts, one cos, sin, mask and v cache, 6 floats and 3 ints a layer; got ", norms.size(), ", ",
                optional_norms.size(), ", ", matmul_counts.size(), ", ", cos.size(), ", ", sin.size(), ", ",
                masks.size(), ", ", v_caches.size(), ", ", floats.size(), ", ", ints.size());
    int64_t total = 0;
    for (const int64_t count : matmul_counts) {
        TORCH_CHECK(count >= 0, "decode_stack: a matmul count is negative (", count, ")");
        total += count;
    }
    TORCH_CHECK(total == static_cast<int64_t>(matmuls.size()), "decode_stack: the matmul counts add up to ", total,
                " tensors, ", matmuls.size(), " given");
    at::Tensor x = x_in;
    size_t at = 0;  // the next layer's first matmul operand
    for (size_t i = 0; i < L; i++) {
        at::TensorList part[4];
        for (int j = 0; j < 4; j++) {
            part[j] = matmuls.slice(at, matmul_counts[4 * i + j]);
            at += matmul_counts[4 * i + j];
        }
        const double *f = floats.data() + 6 * i;
        const int64_t *n = ints.data() + 3 * i;
        try {
            x = decode_block(x, norms[2 * i], f[0], part[0], optional_norms.get(4 * i), optional_norms.get(4 * i + 1),
                             f[1], cos[i], sin[i], n[0] != 0, k_caches[i], v_caches[i], input_pos, masks[i], f[2],
                             n[1], part[1], optional_norms.get(4 * i + 2), f[3], norms[2 * i + 1], f[4], part[2], n[2],
                             part[3], optional_norms.get(4 * i + 3), f[5]);
        } catch (const c10::Error &error) {  // which layer, then decode_block's own words
            TORCH_CHECK(false, "decode_stack: layer ", i, ": ", error.what_without_backtrace());
        }
    }
    return x;
}

TORCH_LIBRARY_FRAGMENT(lucidlm, m) {
    m.def("decode_block(Tensor x, Tensor ln1, float eps1, Tensor[] qkv, Tensor? q_norm, Tensor? k_norm, float qk_eps, "
          "Tensor cos, Tensor sin, bool interleaved, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor input_pos, "
          "Tensor mask, float scale, int n_heads, Tensor[] o, Tensor? ln1_post, float eps1_post, Tensor ln2, "
          "float eps2, Tensor[] gate_up, int activation, Tensor[] down, Tensor? ln2_post, float eps2_post) -> Tensor");
    m.def("decode_stack(Tensor x, Tensor[] norms, Tensor?[] optional_norms, Tensor[] matmuls, int[] matmul_counts, "
          "Tensor[] cos, Tensor[] sin, Tensor[] masks, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
          "Tensor input_pos, float[] floats, int[] ints) -> Tensor");
}

TORCH_LIBRARY_IMPL(lucidlm, CPU, m) {
    m.impl("decode_block", decode_block);
    m.impl("decode_stack", decode_stack);
}
