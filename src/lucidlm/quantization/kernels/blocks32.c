/* lucidlm's CPU matmul for 4-bit weights in groups of 32: y = x @ W^T.
 *
 * The weights are int4 codes q in 0..15 with one scale s and one zero z per row and group of
 * 32 input columns (lucidlm's int4 scheme, quantization/int4.py):
 *
 *     W[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g],        g = k / 32
 *
 * As llama.cpp does for Q4_1, each row of x is quantized to int8 per group of 32, so that a
 * group's dot product is an integer one, done 4 bytes at a time by AVX-512 VNNI (vpdpbusd:
 * unsigned byte x signed byte, summed in int32). Unlike llama.cpp, x gets two int8 codes
 * (quantize_row): x ~ a r1 + (a / 254) r2, which keeps it as precise as a bfloat16 input
 * (one int8 code alone flipped the embedded model's greedy answers):
 *
 *     sum_k W[n, k] x[k]  ~  sum_g  s a (sum_j q r1 + sum_j q r2 / 254)  +  (z - 8 s) sum_j x
 *
 * Layout ("blocks"): rows in blocks of 16, one 512-bit lane per row, so every instruction
 * works on 16 rows and no horizontal sum is ever needed. For row block b and group g the
 * 32 codes of each row take 4 vectors of 64 bytes (256 bytes); in vector t, lane i (row
 * 16 b + i) holds 4 bytes j = 0..3 whose low nibble is the code of column 32 g + 4 t + j and
 * whose high nibble that of column 32 g + 16 + 4 t + j.  s and z are bfloat16, [b][g][16].
 *
 * int8 weights in groups of 32 (GGUF's Q8_0, lucidlm's int8 per group): W = s q, q in
 * -127..127, 8 vectors per group (vector t: columns 4t..4t+3), s float32 (Q8_0's float16
 * scales exactly: rounded to bfloat16 they flipped the embedded model's sampled answers). vpdpbusd's unsigned side is
 * then x's codes shifted by 128: sum q r = sum q (r + 128) - 128 sum q, with sum q per row
 * and group stored beside the scales (as float32, exact).
 *
 * Threads: OpenMP over row blocks. torch ships the libgomp this library links against, so
 * both share one thread pool and torch.set_num_threads governs both.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS_AT_ONCE 8 /* activation rows sharing one unpacking of the weights */

/* bfloat16 <-> float32: bf16 is the top half of a float32 */
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 load_x16(const void *x, int bf16, size_t i) {
    return bf16 ? load_bf16x16((const uint16_t *)x + i) : _mm512_loadu_ps((const float *)x + i);
}

/* One row of x (K values) -> per group of 32: int8 codes r1 with scale a (round(x / a),
 * a = max|x| / 127), int8 codes r2 of what r1 misses with scale a / 254 (the remainder is
 * within a / 2, so it fits -127..127), and sum(x) in float32. x ~ a r1 + (a / 254) r2 is
 * then as precise as 16-bit codes: a bfloat16 input is kept to its own rounding. */
static void quantize_row(const void *x, int bf16, int K, int8_t *codes, int8_t *rest, float *scale, float *sum,
                         int shift) {
    const __m128i flip = _mm_set1_epi8(shift ? (char)0x80 : 0);
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int g = 0; g < K / 32; g++) {
        __m512 v[2] = {load_x16(x, bf16, 32 * (size_t)g), load_x16(x, bf16, 32 * (size_t)g + 16)};
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], abs_mask), _mm512_and_ps(v[1], abs_mask)));
        float a = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int h = 0; h < 2; h++) {
            __m512i r1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv))); /* round half to even */
            __m512 miss = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(r1), _mm512_set1_ps(a), v[h]);
            __m512i r2 = _mm512_cvtps_epi32(_mm512_mul_ps(miss, _mm512_set1_ps(inv * 254.0f)));
            _mm_storeu_si128((__m128i *)(codes + 32 * g + 16 * h), _mm_xor_si128(_mm512_cvtsepi32_epi8(r1), flip));
            _mm_storeu_si128((__m128i *)(rest + 32 * g + 16 * h), _mm_xor_si128(_mm512_cvtsepi32_epi8(r2), flip));
        }
        scale[g] = a;
        sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    }
}

static inline void store_y16(void *y, int bf16, size_t i, __m512 v) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps((float *)y + i, v);
}

/* sum over the group of q * r for 16 rows at once: w the int4 codes as above, r x's 32 int8 codes */
static inline __m512i group_dot(const __m512i *w, const int8_t *r) {
    const int32_t *a = (const int32_t *)r; /* 4 codes of x per int32, broadcast to every row */
    __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(a[0]));
    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(a[1]));
    d0 = _mm512_dpbusd_epi32(d0, w[2], _mm512_set1_epi32(a[2]));
    d1 = _mm512_dpbusd_epi32(d1, w[3], _mm512_set1_epi32(a[3]));
    d0 = _mm512_dpbusd_epi32(d0, w[4], _mm512_set1_epi32(a[4]));
    d1 = _mm512_dpbusd_epi32(d1, w[5], _mm512_set1_epi32(a[5]));
    d0 = _mm512_dpbusd_epi32(d0, w[6], _mm512_set1_epi32(a[6]));
    d1 = _mm512_dpbusd_epi32(d1, w[7], _mm512_set1_epi32(a[7]));
    return _mm512_add_epi32(d0, d1); /* exact */
}

/* sum over the group of q * (r + 128) for 16 rows: w the 8 vectors of int8 codes, u x's codes + 128 */
static inline __m512i group_dot_int8(const __m512i *w, const int8_t *u) {
    const int32_t *a = (const int32_t *)u;
    __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(a[0]), w[0]);
    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(a[1]), w[1]);
    for (int t = 2; t < 8; t += 2) {
        d0 = _mm512_dpbusd_epi32(d0, _mm512_set1_epi32(a[t]), w[t]);
        d1 = _mm512_dpbusd_epi32(d1, _mm512_set1_epi32(a[t + 1]), w[t + 1]);
    }
    return _mm512_add_epi32(d0, d1);
}

/* int8 weights: 16 rows (block b) x up to ROWS_AT_ONCE rows of x (codes shifted by 128). */
static void block_rows_int8(const int8_t *codes, const float *s, const float *qsum, int G, const int8_t *xq,
                            const int8_t *xr, const float *xa, int rows, int K, void *y, int bf16, size_t N, size_t n0) {
    __m512 acc[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i w[8];
        for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512((const void *)(codes + 512 * (size_t)g + 64 * t));
        __m512 sv = _mm512_loadu_ps(s + 16 * (size_t)g), shift = _mm512_mul_ps(_mm512_set1_ps(128.0f),
                                                                             _mm512_loadu_ps(qsum + 16 * (size_t)g));
        for (int r = 0; r < rows; r++) {
            size_t at = (size_t)r * K + 32 * (size_t)g;
            float a = xa[(size_t)r * G + g];
            __m512 main = _mm512_sub_ps(_mm512_cvtepi32_ps(group_dot_int8(w, xq + at)), shift); /* sum q r1, exact */
            __m512 rest = _mm512_sub_ps(_mm512_cvtepi32_ps(group_dot_int8(w, xr + at)), shift);
            acc[r] = _mm512_fmadd_ps(main, _mm512_mul_ps(sv, _mm512_set1_ps(a)), acc[r]);
            acc[r] = _mm512_fmadd_ps(rest, _mm512_mul_ps(sv, _mm512_set1_ps(a / 254.0f)), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_y16(y, bf16, (size_t)r * N + n0, acc[r]);
}

/* int4 weights: 16 rows (block b) x up to ROWS_AT_ONCE rows of x. */
static void block_rows(const uint8_t *codes, const uint16_t *s, const uint16_t *z, int G, const int8_t *xq,
                       const int8_t *xr, const float *xa, const float *xsum, int rows, int K, void *y, int bf16,
                       size_t N, size_t n0) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i w[8]; /* w[t]: columns 4t..4t+3 of the group, w[t + 4]: columns 16 + 4t.. */
        for (int t = 0; t < 4; t++) {
            __m512i v = _mm512_loadu_si512((const void *)(codes + 256 * (size_t)g + 64 * t));
            w[t] = _mm512_and_si512(v, low4);
            w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        __m512 sv = load_bf16x16(s + 16 * (size_t)g), zv = load_bf16x16(z + 16 * (size_t)g);
        __m512 mv = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sv, zv); /* z - 8 s: the weight of code 0 */
        for (int r = 0; r < rows; r++) {
            size_t at = (size_t)r * K + 32 * (size_t)g;
            float a = xa[(size_t)r * G + g];
            __m512 main = _mm512_cvtepi32_ps(group_dot(w, xq + at)), rest = _mm512_cvtepi32_ps(group_dot(w, xr + at));
            acc[r] = _mm512_fmadd_ps(main, _mm512_mul_ps(sv, _mm512_set1_ps(a)), acc[r]);
            acc[r] = _mm512_fmadd_ps(rest, _mm512_mul_ps(sv, _mm512_set1_ps(a / 254.0f)), acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[(size_t)r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_y16(y, bf16, (size_t)r * N + n0, acc[r]);
}

/* y (M, N) = x (M, K) @ W^T; x and y float32 (bf16 = 0) or bfloat16 (bf16 = 1); N a multiple
 * of 16, K of 32. int4: codes (N/16, G, 256) bytes, extra = z (bf16, as s); int8: codes
 * (N/16, G, 512), s and extra = sum q float32. Returns 0, or -1 when out of memory. */
static int blocks_mm(int int8, const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N, const void *codes,
                     const void *s, const void *extra) {
    int G = (int)(K / 32);
    int8_t *xq = malloc((size_t)M * K), *xr = malloc((size_t)M * K);
    float *xa = malloc(sizeof(float) * M * G), *xsum = malloc(sizeof(float) * M * G);
    if (!xq || !xr || !xa || !xsum) { free(xq); free(xr); free(xa); free(xsum); return -1; }
    for (int64_t r = 0; r < M; r++)
        quantize_row((const char *)x + (size_t)r * K * (bf16 ? 2 : 4), bf16, (int)K, xq + r * K, xr + r * K, xa + r * G,
                     xsum + r * G, int8);
    int64_t blocks = N / 16, chunks = (M + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
    size_t block_bytes = (size_t)G * (int8 ? 512 : 256);
    #pragma omp parallel for schedule(static) collapse(2) if (blocks * chunks > 1)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t r0 = c * ROWS_AT_ONCE, rows = M - r0 < ROWS_AT_ONCE ? M - r0 : ROWS_AT_ONCE;
            void *yc = (char *)y + (size_t)r0 * N * (bf16 ? 2 : 4);
            if (int8)
                block_rows_int8((const int8_t *)codes + b * block_bytes, (const float *)s + (size_t)b * G * 16, (const float *)extra + (size_t)b * G * 16, G,
                                xq + r0 * K, xr + r0 * K, xa + r0 * G, (int)rows, (int)K, yc, bf16, (size_t)N,
                                (size_t)b * 16);
            else
                block_rows((const uint8_t *)codes + b * block_bytes, (const uint16_t *)s + (size_t)b * G * 16, (const uint16_t *)extra + (size_t)b * G * 16, G,
                           xq + r0 * K, xr + r0 * K, xa + r0 * G, xsum + r0 * G, (int)rows, (int)K, yc, bf16, (size_t)N,
                           (size_t)b * 16);
        }
    free(xq); free(xr); free(xa); free(xsum);
    return 0;
}

int lucidlm_int4_blocks_mm(const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N, const uint8_t *codes,
                           const uint16_t *s, const uint16_t *z) {
    return blocks_mm(0, x, y, bf16, M, K, N, codes, s, z);
}

int lucidlm_int8_blocks_mm(const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N, const int8_t *codes,
                           const float *s, const float *qsum) {
    return blocks_mm(1, x, y, bf16, M, K, N, codes, s, qsum);
}
