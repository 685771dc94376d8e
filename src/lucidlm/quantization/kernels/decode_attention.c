/* One decode step's attention on the CPU: each row's new query against its KV cache.
 *
 * The same arithmetic as model/attention.py's _single_query_attention (grouped-query: the G
 * query heads of kv head h share its keys and values), in float32:
 *
 *     scores[s] = scale * q . k[s]      for the slots s the mask lets in
 *     p = softmax(scores)               (masked slots get exactly 0)
 *     out = sum_s p[s] v[s]
 *
 * Why by hand: a decode step's attention is a few small loops (SmolLM2 at batch 1: 9 heads x
 * up to a few hundred slots x 64), and torch.compile made it a matmul call plus a fused softmax
 * and sum, ~20 us a layer at batch 1 and ~150 us at batch 8 with a 128-slot cache (AMD EPYC,
 * 2 threads), mostly call and thread overhead, every slot of the cache included. Here only the
 * slots between a row's first and last allowed one are read (left padding and the cache's
 * unwritten tail are skipped; a masked slot inside that range is computed and zeroed), and a
 * layer costs a few microseconds.
 *
 * Layout: q and out (B, T, H, G, D) contiguous: T queries a row (a decode step's one, or the
 * few tokens speculative decoding checks at once), each with its own mask row; k and v
 * (B, H, S, D) with any batch, head and slot strides (a slice of the cache, or one new token's
 * keys), each slot's D values contiguous; mask (B, T, S) bytes, 1 = may attend. A query whose
 * mask ends at its own slot reads exactly what it would have read had it come alone, one step
 * after the query before it: the slots later queries wrote past it are never touched. D a multiple of 8. A row whose mask lets nothing in gets NaN, as a softmax over
 * nothing does in torch. Threads: OpenMP over (row, kv head) once the work is large enough to
 * pay for waking them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "horizontal8.h"

/* e^x for 8 floats, within ~2 ulp over the range a softmax needs (x <= 0): x = n ln2 + r,
 * |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7, times 2^n built in the exponent bits.
 * Below -87.3 the result is 0 (e^x would be a denormal). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts: exact n * hi */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int64_t i = 8; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

/* scale * (q . k[s]) for the 8 slots s0..s0+7, as one vector: each slot's products summed in
 * its own register, then the 8 registers folded together (horizontal adds), instead of a
 * horizontal sum per slot. */
static inline __m256 scores8(const float *q, const float *k, int64_t ks, int64_t s0, int64_t D, __m256 scale) {
    __m256 a[8];  /* 8 independent running sums, kept in registers (the slot loop is unrolled) */
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qd = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + (s0 + i) * ks + d), a[i]);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  /* slots 0-3, each lane half */
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));  /* slots 4-7 */
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    return _mm256_mul_ps(sums, scale);
}

/* out (D,) = inv * sum over [first, last) of p[t] v[t]. 64 columns at a time, in 8 running
 * sums: one sum per 8 columns would be a chain of dependent multiply-adds as long as the cache. */
static void weighted_values(const float *p, const float *v, int64_t vs, float *out, int64_t first, int64_t last,
                            int64_t D, float inv) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t t = first; t < last; t++) {
            __m256 pt = _mm256_set1_ps(p[t]);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + t * vs + d + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + d + 8 * j, _mm256_mul_ps(acc[j], _mm256_set1_ps(inv)));
    }
    for (; d < D; d += 8) {  /* head sizes that are not a multiple of 64 */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = first; t < last; t++) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v + t * vs + d), acc);
        _mm256_storeu_ps(out + d, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
    }
}

/* One row b and kv head h: the G queries q (G, D) -> out (G, D); p is scratch for G x S floats. */
static void one_head(const float *q, const float *k, int64_t ks, const float *v, int64_t vs, const uint8_t *mask,
                     float *out, int64_t G, int64_t S, int64_t D, float scale, float *p) {
    int64_t first = 0, last = S;  /* the slots the mask lets in lie within [first, last) */
    while (first < S && !mask[first]) first++;
    while (last > first && !mask[last - 1]) last--;
    if (first == last) {
        for (int64_t i = 0; i < G * D; i++) out[i] = NAN;
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * S;
        const __m256 none = _mm256_set1_ps(-INFINITY);
        __m256 tops = none;
        int64_t s = first;
        for (; s + 8 <= last; s += 8) {
            __m256i allowed = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mask + s)));
            __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(allowed, _mm256_setzero_si256()));
            __m256 x = _mm256_blendv_ps(none, scores8(q + g * D, k, ks, s, D, _mm256_set1_ps(scale)), keep);
            _mm256_storeu_ps(pg + s, x);
            tops = _mm256_max_ps(tops, x);
        }
        float top = hmax8(tops);
        for (; s < last; s++) {
            pg[s] = mask[s] ? scale * dot(q + g * D, k + s * ks, D) : -INFINITY;
            top = pg[s] > top ? pg[s] : top;
        }
        /* exp(score - top) over [first, last), 8 at a time; masked slots stay exactly 0 */
        __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
        for (s = first; s + 8 <= last; s += 8) {
            __m256 x = _mm256_loadu_ps(pg + s);
            __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, shift)),
                                     _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
            _mm256_storeu_ps(pg + s, e);
            total = _mm256_add_ps(total, e);
        }
        float sum = hsum8(total);
        for (; s < last; s++) {
            float x = pg[s];
            pg[s] = x == -INFINITY ? 0.0f : expf(x - top);
            sum += pg[s];
        }
        weighted_values(pg, v, vs, out + g * D, first, last, D, 1.0f / sum);
    }
}

/* Returns 0, or -1 when out of memory. */
int lucidlm_decode_attention(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                             int64_t B, int64_t T, int64_t H, int64_t G, int64_t S, int64_t D, int64_t k_batch,
                             int64_t k_head, int64_t k_slot, int64_t v_batch, int64_t v_head, int64_t v_slot,
                             float scale) {
    const int64_t R = B * T;  /* queries: row b's t-th is r = b * T + t, against row b's keys */
    float *p = malloc(sizeof(float) * R * H * G * S);  /* each (query, head) its own scores */
    if (!p) return -1;
    /* 2^16: 8 rows of SmolLM2 over a 47-slot cache (bench_generation's batch 8) took 21-31 us on
     * one thread and 12-17 us on two, 1 row over 256 slots 15-16 -> 11.6 us; 2^18 had left both
     * on one thread while the other waited (AMD EPYC Zen 4, 2026-11-27). */
    #pragma omp parallel for schedule(static) collapse(2) if (R * H * G * S * D >= (1 << 16))
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < H; h++)
            one_head(q + (r * H + h) * G * D, k + (r / T) * k_batch + h * k_head, k_slot,
                     v + (r / T) * v_batch + h * v_head, v_slot, mask + r * S, out + (r * H + h) * G * D, G, S, D,
                     scale, p + (r * H + h) * G * S);
    free(p);
    return 0;
}
