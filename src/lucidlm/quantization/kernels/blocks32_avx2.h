/* blocks32.c's inner loops for AVX2 with FMA and F16C (CPUs without AVX-512 VNNI: AMD Zen 1-3,
 * Intel before Ice Lake, or Alder Lake's cores). Same layout, same arithmetic and the same
 * input codes as the AVX-512 loops, so both give the same numbers up to float32 summation order.
 *
 * A 256-bit vector holds half of a row block: the first 32 bytes of each 64-byte vector t are
 * rows 0..7, the last 32 rows 8..15. Each half is done in turn (its second pass reads the block
 * from L1), except for a single row of x, where both go together (block_one_row, block_one_row_int8). AVX2 has no
 * vpdpbusd; its two-step form is vpmaddubsw (unsigned byte x signed byte, adjacent pairs summed
 * into int16) then vpmaddwd with ones (adjacent int16 summed into int32):
 *
 *   int4: codes 0..15 times x's codes -127..127: a pair is at most 3810 in magnitude, so all 8
 *         vectors of a group add up in int16 (at most 30480) and only one vpmaddwd is needed.
 *   int8: both sides are signed; vpmaddubsw takes |q| and x's code with q's sign
 *         (vpsignb), pairs reach 32512, so each vector goes to int32 at once. x's codes are
 *         not shifted (no code sums needed). */
#include "horizontal8.h"

#define ROWS_AT_ONCE 8 /* as with AVX-512: the accumulators spill a little, but 8 rows share one unpacking of the weights */
#define SHIFT_INT8_CODES 0
#define PREFETCH_GROUPS 4 /* groups ahead that the first half's pass asks the cache for (5-10 % at batch 1) */

static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 load_x8(const void *x, int bf16, size_t i) {
    return bf16 ? load_bf16x8((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
}

/* 8 int32 in -127..127 -> 8 int8 stored at p */
static inline void store_int8x8(int8_t *p, __m256i v) {
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}

/* One row of x -> per group of 32: codes r1 (scale a), codes r2 of what r1 misses (scale
 * a / 254), the unit a / 254 and sum(x); as quantize_row in blocks32_avx512.h (shift is 0 here). */
static void quantize_row(const void *x, int bf16, int K, int8_t *codes, int8_t *rest, float *unit, float *sum,
                         int shift) {
    (void)shift;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int g = 0; g < K / 32; g++) {
        __m256 v[4];
        for (int h = 0; h < 4; h++) v[h] = load_x8(x, bf16, 32 * (size_t)g + 8 * h);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
        float amax = hmax8(m), a = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int h = 0; h < 4; h++) {
            __m256i r1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], _mm256_set1_ps(inv))); /* round half to even */
            __m256 miss = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(r1), _mm256_set1_ps(a), v[h]);
            __m256i r2 = _mm256_cvtps_epi32(_mm256_mul_ps(miss, _mm256_set1_ps(inv * 254.0f)));
            store_int8x8(codes + 32 * g + 8 * h, r1);
            store_int8x8(rest + 32 * g + 8 * h, r2);
        }
        unit[g] = a / 254.0f;
        sum[g] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
}

/* float32 -> bfloat16, rounding to nearest even (what AVX-512 BF16's vcvtneps2bf16 does for
 * finite values) */
static inline void store_y8(void *y, int bf16, size_t i, __m256 v) {
    if (bf16) {
        __m256i b = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
        _mm_storeu_si128((__m128i *)((uint16_t *)y + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    } else {
        _mm256_storeu_ps((float *)y + i, v);
    }
}

/* sum over the group of q * r for 8 rows: w the int4 codes (8 vectors), r x's 32 int8 codes */
static inline __m256i group_dot(const __m256i *w, const int8_t *r) {
    const int32_t *a = (const int32_t *)r; /* 4 codes of x per int32, broadcast to every row */
    __m256i p0 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(a[0]));
    __m256i p1 = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(a[1]));
    for (int t = 2; t < 8; t += 2) {
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(a[t])));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[t + 1], _mm256_set1_epi32(a[t + 1])));
    }
    return _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1)); /* exact: |sum| <= 30480 */
}

/* 254 main + rest in int32: the sums of x's two codes joined into one (blocks32.c) */
static inline __m256i joined_sums(__m256i main, __m256i rest) {
    return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(main, 8), _mm256_slli_epi32(main, 1)), rest);
}

/* sum over the group of q * r for 8 rows: wabs |q| (8 vectors), w q, r x's 32 int8 codes */
static inline __m256i group_dot_int8(const __m256i *wabs, const __m256i *w, const int8_t *r) {
    const int32_t *a = (const int32_t *)r;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
    for (int t = 0; t < 8; t += 2) {
        __m256i p0 = _mm256_maddubs_epi16(wabs[t], _mm256_sign_epi8(_mm256_set1_epi32(a[t]), w[t]));
        __m256i p1 = _mm256_maddubs_epi16(wabs[t + 1], _mm256_sign_epi8(_mm256_set1_epi32(a[t + 1]), w[t + 1]));
        d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(p0, ones));
        d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(p1, ones));
    }
    return _mm256_add_epi32(d0, d1);
}

/* int8 weights, one row of x (a decode step at batch 1): both halves of the row block in one
 * pass over the groups, as block_one_row does for int4, so that each broadcast of x's codes
 * serves 16 rows; the same numbers as block_rows_int8 (exact integer sums, the float steps in
 * the same order). The embedded model's 49152 x 576 unembedding: 2.19 -> 1.74 ms (min; medians
 * 2.42 -> 1.93) a step, bench_kernel_ab.py --batch 1 --threads 2, AVX2-only AMD EPYC, 2026-11-28. */
static void block_one_row_int8(const int8_t *codes, const float *s, int G, const int8_t *xq, const int8_t *xr,
                               const float *xu, void *y, int bf16, size_t n0) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  /* rows 0..7, rows 8..15 */
    for (int g = 0; g < G; g++) {
        const int8_t *group = codes + 512 * (size_t)g;
        prefetch_lines(codes + 512 * (size_t)(g + PREFETCH_GROUPS), 8);
        const int32_t *a = (const int32_t *)(xq + 32 * (size_t)g), *b = (const int32_t *)(xr + 32 * (size_t)g);
        __m256i main[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, rest[2] = {main[0], main[1]};
        for (int t = 0; t < 8; t++) {
            __m256i at = _mm256_set1_epi32(a[t]), bt = _mm256_set1_epi32(b[t]);
            for (int h = 0; h < 2; h++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(group + 64 * t + 32 * h));
                __m256i wabs = _mm256_abs_epi8(w);  /* as group_dot_int8: |q| times x's code with q's sign */
                main[h] = _mm256_add_epi32(main[h], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(at, w)), ones));
                rest[h] = _mm256_add_epi32(rest[h], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(bt, w)), ones));
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 sv = _mm256_loadu_ps(s + 16 * (size_t)g + 8 * h);
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined_sums(main[h], rest[h])),
                                     _mm256_mul_ps(sv, _mm256_set1_ps(xu[g])), acc[h]);
        }
    }
    store_y8(y, bf16, n0, acc[0]);
    store_y8(y, bf16, n0 + 8, acc[1]);
}

/* int8 weights: 16 rows (block b, one half at a time) x up to ROWS_AT_ONCE rows of x. */
static void block_rows_int8(const int8_t *codes, const float *s, const float *qsum, int G, const int8_t *xq,
                            const int8_t *xr, const float *xu, int rows, int K, void *y, int bf16, size_t N, size_t n0) {
    (void)qsum;
    if (rows == 1) {
        block_one_row_int8(codes, s, G, xq, xr, xu, y, bf16, n0);
        return;
    }
    for (int h = 0; h < 2; h++) {
        __m256 acc[ROWS_AT_ONCE];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m256i w[8], wabs[8];
            if (h == 0) prefetch_lines(codes + 512 * (size_t)(g + PREFETCH_GROUPS), 8);
            for (int t = 0; t < 8; t++) {
                w[t] = _mm256_loadu_si256((const __m256i *)(codes + 512 * (size_t)g + 64 * t + 32 * h));
                wabs[t] = _mm256_abs_epi8(w[t]); /* -128 becomes 128 as an unsigned byte: still exact */
            }
            __m256 sv = _mm256_loadu_ps(s + 16 * (size_t)g + 8 * h);
            for (int r = 0; r < rows; r++) {
                size_t at = (size_t)r * K + 32 * (size_t)g;
                __m256i joined = joined_sums(group_dot_int8(wabs, w, xq + at), group_dot_int8(wabs, w, xr + at));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined), _mm256_mul_ps(sv, _mm256_set1_ps(xu[(size_t)r * G + g])),
                                         acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) store_y8(y, bf16, (size_t)r * N + n0 + 8 * h, acc[r]);
    }
}

/* int4 weights, one row of x (a decode step at batch 1): both halves of the row block in one
 * pass over the groups, so that each broadcast of x's codes serves 16 rows instead of 8. At one
 * row the loop is bound by the CPU's shuffle ports, which the broadcasts occupy, not by the
 * multiplies; this pass is 12-17 % faster than two (AMD EPYC, one thread, SmolLM2's matrices),
 * with the same numbers: the integer sums are exact and the float steps keep their order. */
static void block_one_row(const uint8_t *codes, const uint16_t *s, const uint16_t *z, int G, const int8_t *xq,
                          const int8_t *xr, const float *xu, const float *xsum, void *y, int bf16, size_t n0) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  /* rows 0..7, rows 8..15 */
    for (int g = 0; g < G; g++) {
        const uint8_t *group = codes + 256 * (size_t)g;
        prefetch_lines(codes + 256 * (size_t)(g + PREFETCH_GROUPS), 4);
        const int32_t *a = (const int32_t *)(xq + 32 * (size_t)g), *b = (const int32_t *)(xr + 32 * (size_t)g);
        /* q . r1 and q . r2 per half, in int16 pairs as group_dot sums them (at most 30480) */
        __m256i main[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, rest[2] = {main[0], main[1]};
        for (int t = 0; t < 4; t++) {
            __m256i a_low = _mm256_set1_epi32(a[t]), a_high = _mm256_set1_epi32(a[t + 4]);
            __m256i b_low = _mm256_set1_epi32(b[t]), b_high = _mm256_set1_epi32(b[t + 4]);
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(group + 64 * t + 32 * h));
                __m256i low = _mm256_and_si256(v, low4), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                main[h] = _mm256_add_epi16(main[h], _mm256_add_epi16(_mm256_maddubs_epi16(low, a_low),
                                                                     _mm256_maddubs_epi16(high, a_high)));
                rest[h] = _mm256_add_epi16(rest[h], _mm256_add_epi16(_mm256_maddubs_epi16(low, b_low),
                                                                     _mm256_maddubs_epi16(high, b_high)));
            }
        }
        for (int h = 0; h < 2; h++) {  /* as block_rows: the same steps in the same order */
            __m256 sv = load_bf16x8(s + 16 * (size_t)g + 8 * h), zv = load_bf16x8(z + 16 * (size_t)g + 8 * h);
            __m256 mv = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), sv, zv);
            __m256i joined = joined_sums(_mm256_madd_epi16(main[h], ones), _mm256_madd_epi16(rest[h], ones));
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined), _mm256_mul_ps(sv, _mm256_set1_ps(xu[g])), acc[h]);
            acc[h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[g]), acc[h]);
        }
    }
    store_y8(y, bf16, n0, acc[0]);
    store_y8(y, bf16, n0 + 8, acc[1]);
}

/* int4 weights: 16 rows (block b, one half at a time) x up to ROWS_AT_ONCE rows of x. */
static void block_rows(const uint8_t *codes, const uint16_t *s, const uint16_t *z, int G, const int8_t *xq,
                       const int8_t *xr, const float *xu, const float *xsum, int rows, int K, void *y, int bf16,
                       size_t N, size_t n0) {
    if (rows == 1) {
        block_one_row(codes, s, z, G, xq, xr, xu, xsum, y, bf16, n0);
        return;
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        __m256 acc[ROWS_AT_ONCE];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m256i w[8]; /* w[t]: columns 4t..4t+3 of the group, w[t + 4]: columns 16 + 4t.. */
            if (h == 0) prefetch_lines(codes + 256 * (size_t)(g + PREFETCH_GROUPS), 4);
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 256 * (size_t)g + 64 * t + 32 * h));
                w[t] = _mm256_and_si256(v, low4);
                w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            __m256 sv = load_bf16x8(s + 16 * (size_t)g + 8 * h), zv = load_bf16x8(z + 16 * (size_t)g + 8 * h);
            __m256 mv = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), sv, zv); /* z - 8 s: the weight of code 0 */
            for (int r = 0; r < rows; r++) {
                size_t at = (size_t)r * K + 32 * (size_t)g;
                __m256i joined = joined_sums(group_dot(w, xq + at), group_dot(w, xr + at));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined), _mm256_mul_ps(sv, _mm256_set1_ps(xu[(size_t)r * G + g])),
                                         acc[r]);
                acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[(size_t)r * G + g]), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) store_y8(y, bf16, (size_t)r * N + n0 + 8 * h, acc[r]);
    }
}

/* float32 -> bfloat16, rounding to nearest even as torch's .to(torch.bfloat16) does; a NaN
 * stays a quiet NaN (its bits differ between torch's own vector and scalar paths; a file with
 * a NaN scale is refused anyway, weights/finite.py). */
static uint16_t bf16_from_float(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* The loader's passes (lucidlm_q4_blocks, lucidlm_q8_blocks in blocks32.c), a tile at a time: the
 * 16 blocks of one row block and group, block i at p[i], one by one (blocks32_avx512.h transposes
 * a tile in registers). Each returns how many of its blocks have a NaN or infinite scale. */
static inline int q4_tile(const uint8_t *const p[16], int nibbles, uint8_t *codes, uint16_t *s, uint16_t *z) {
    int nonfinite = 0;
    for (int i = 0; i < 16; i++) {
        for (int t = 0; t < 4; t++) memcpy(codes + t * 64 + i * 4, p[i] + nibbles + t * 4, 4);
        uint16_t half_d, half_m = 0;
        memcpy(&half_d, p[i], 2);
        float d = _cvtsh_ss(half_d), zero = 0.0f;
        if (nibbles == 4) {
            memcpy(&half_m, p[i] + 2, 2);
            zero = _cvtsh_ss(half_m) + 8.0f * d;  /* 8 d is exact: one rounding, fused or not */
        }
        nonfinite += (half_d & 0x7c00u) == 0x7c00u || (half_m & 0x7c00u) == 0x7c00u;
        s[i] = bf16_from_float(d);
        z[i] = bf16_from_float(zero);
    }
    return nonfinite;
}

static inline int q8_tile(const uint8_t *const p[16], int8_t *codes, float *s, float *sums) {
    int nonfinite = 0;
    for (int i = 0; i < 16; i++) {
        const int8_t *q = (const int8_t *)(p[i] + 2);
        for (int t = 0; t < 8; t++) memcpy(codes + t * 64 + i * 4, q + t * 4, 4);
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) sum += q[j];
        uint16_t half_d;
        memcpy(&half_d, p[i], 2);
        nonfinite += (half_d & 0x7c00u) == 0x7c00u;
        s[i] = _cvtsh_ss(half_d);
        sums[i] = (float)sum;
    }
    return nonfinite;
}
