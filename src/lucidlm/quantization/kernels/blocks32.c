/* lucidlm's CPU matmul for 4-bit weights in groups of 32: y = x @ W^T.
 *
 * The weights are int4 codes q in 0..15 with one scale s and one zero z per row and group of
 * 32 input columns (lucidlm's int4 scheme, quantization/int4.py):
 *
 *     W[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g],        g = k / 32
 *
 * As llama.cpp does for Q4_1, each row of x is quantized to int8 per group of 32, so that a
 * group's dot product is an integer one, done 4 bytes at a time by AVX-512 VNNI (vpdpbusd:
 * unsigned byte x signed byte, summed in int32), or by AVX2's two-step equivalent. Unlike
 * llama.cpp, x gets two int8 codes (quantize_row): x ~ a r1 + (a / 254) r2, which keeps it as
 * precise as a bfloat16 input (one int8 code alone flipped the embedded model's greedy answers):
 *
 *     sum_k W[n, k] x[k]  ~  sum_g  s u (254 sum_j q r1 + sum_j q r2)  +  (z - 8 s) sum_j x,   u = a / 254
 *
 * The two integer sums are joined in int32 before the one float step: 254 * 60960 + 60960 is
 * below 2^24, so the joined sum is exact in float32 too, and the loop keeps no division. With
 * AVX-512's embedded broadcast of x's codes (blocks32_avx512.h) this took 16-21 % off the int4
 * matmul time at batch 8 and 9-11 % off the int8 one, against a float step per code
 * (SmolLM2's matrices, bench_kernel_ab.py, medians, one and two threads, AMD EPYC Zen 4,
 * 2026-11-27; batch 1, bound by memory, unchanged), and it is no less precise.
 *
 * Layout ("blocks"): rows in blocks of 16, one 32-bit lane of a 512-bit vector per row, so
 * every instruction works on 16 rows (8 with AVX2, which takes a vector in two halves) and no horizontal sum is ever needed. For row block b and group g the
 * 32 codes of each row take 4 vectors of 64 bytes (256 bytes); in vector t, lane i (row
 * 16 b + i) holds 4 bytes j = 0..3 whose low nibble is the code of column 32 g + 4 t + j and
 * whose high nibble that of column 32 g + 16 + 4 t + j.  s and z are bfloat16, [b][g][16].
 *
 * int8 weights in groups of 32 (GGUF's Q8_0, lucidlm's int8 per group): W = s q, q in
 * -127..127, 8 vectors per group (vector t: columns 4t..4t+3), s float32 (Q8_0's float16
 * scales exactly: rounded to bfloat16 they flipped the embedded model's sampled answers).
 * With AVX-512, vpdpbusd's unsigned side is then x's codes shifted by 128:
 * sum q r = sum q (r + 128) - 128 sum q, with sum q per row and group stored beside the
 * scales (as float32, exact; the AVX2 loops do not need it). The joined sum stays in int32
 * there as well: at most 254 * 32 * 128 * 255 + ... < 2^31.
 *
 * The loops exist twice, for AVX-512 VNNI (blocks32_avx512.h) and for AVX2 (blocks32_avx2.h).
 *
 * Threads: OpenMP over row blocks. torch ships the libgomp this library links against, so
 * both share one thread pool and torch.set_num_threads governs both.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ask for n 64-byte lines from p on: the weights a few groups ahead of the loop (each ISA's
 * PREFETCH_GROUPS), as the hardware prefetcher alone left the batch-1 matmul short of the memory
 * bandwidth; a prefetch never faults, so running past the end of a matrix is harmless. Into L1
 * (prefetch_lines: the AVX2 loops, measured on an AVX2-only EPYC) or into L2 only
 * (prefetch_lines_l2: the AVX-512 loops; see PREFETCH_GROUPS there). */
static inline void prefetch_lines(const void *p, int n) {
    for (int i = 0; i < n; i++) _mm_prefetch((const char *)p + 64 * i, _MM_HINT_T0);
}

static inline void prefetch_lines_l2(const void *p, int n) {
    for (int i = 0; i < n; i++) _mm_prefetch((const char *)p + 64 * i, _MM_HINT_T1);
}

/* The inner loops, for the CPU it is compiled for (-march=native): quantize_row, block_rows
 * (int4), block_rows_int8, ROWS_AT_ONCE, SHIFT_INT8_CODES and PREFETCH_GROUPS, and the loader's
 * q4_tile and q8_tile. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BF16__)
#include "blocks32_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "blocks32_avx2.h"
#else
#error "lucidlm's blocks kernels need AVX-512 VNNI + BF16, or AVX2 + FMA + F16C"
#endif

/* y (M, N) = x (M, K) @ W^T; x and y float32 (bf16 = 0) or bfloat16 (bf16 = 1); N a multiple
 * of 16, K of 32. int4: codes (N/16, G, 256) bytes, extra = z (bf16, as s); int8: codes
 * (N/16, G, 512), s and extra = sum q float32. Returns 0, or -1 when out of memory. */
static int blocks_mm(int int8, const void *x, void *y, int bf16, int64_t M, int64_t K, int64_t N, const void *codes,
                     const void *s, const void *extra) {
    int G = (int)(K / 32);
    int8_t *xq = malloc((size_t)M * K), *xr = malloc((size_t)M * K);
    float *xu = malloc(sizeof(float) * M * G), *xsum = malloc(sizeof(float) * M * G);
    if (!xq || !xr || !xu || !xsum) { free(xq); free(xr); free(xu); free(xsum); return -1; }
    int64_t blocks = N / 16, chunks = (M + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
    size_t block_bytes = (size_t)G * (int8 ? 512 : 256);
    /* One parallel region: the threads quantize x's rows between them (8 rows at a batch-8 step:
     * -3 % of its matmul time against one thread quantizing them all, benchmarks/bench_kernel_ab.py,
     * AMD EPYC Zen 4, 2026-11-26), and the implicit barrier of that loop has every row's codes
     * ready before the row blocks are shared out. */
    #pragma omp parallel if (blocks * chunks > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            quantize_row((const char *)x + (size_t)r * K * (bf16 ? 2 : 4), bf16, (int)K, xq + r * K, xr + r * K, xu + r * G,
                         xsum + r * G, int8 && SHIFT_INT8_CODES);
        #pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t c = 0; c < chunks; c++) {
                int64_t r0 = c * ROWS_AT_ONCE, rows = M - r0 < ROWS_AT_ONCE ? M - r0 : ROWS_AT_ONCE;
                void *yc = (char *)y + (size_t)r0 * N * (bf16 ? 2 : 4);
                if (int8)
                    block_rows_int8((const int8_t *)codes + b * block_bytes, (const float *)s + (size_t)b * G * 16, (const float *)extra + (size_t)b * G * 16, G,
                                    xq + r0 * K, xr + r0 * K, xu + r0 * G, (int)rows, (int)K, yc, bf16, (size_t)N,
                                    (size_t)b * 16);
                else
                    block_rows((const uint8_t *)codes + b * block_bytes, (const uint16_t *)s + (size_t)b * G * 16, (const uint16_t *)extra + (size_t)b * G * 16, G,
                               xq + r0 * K, xr + r0 * K, xu + r0 * G, xsum + r0 * G, (int)rows, (int)K, yc, bf16, (size_t)N,
                               (size_t)b * 16);
            }
    }
    free(xq); free(xr); free(xu); free(xsum);
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

/* The blocks layout from a matrix's groups, one pass (the loader's reordering of every weight;
 * torch's strided byte copies took ~150 ms for the embedded model's token table alone):
 * src holds N rows (N a multiple of 16) of G groups of W bytes (W a multiple of 4: 16 nibble
 * bytes of int4 codes, 32 int8 codes), row r's group g at src + r * row_stride + g *
 * group_stride. dst (N/16, G, 16 W): for row block b and group g, W/4 vectors of 16 lanes x
 * 4 bytes, lane i of vector t holding bytes 4t..4t+3 of row 16 b + i's group g. A row block's
 * 16 source rows stay in L1 while all their groups are written in order. */
void lucidlm_lanes_from_groups(const uint8_t *src, int64_t N, int64_t G, int64_t W, int64_t row_stride,
                               int64_t group_stride, uint8_t *dst) {
    int64_t vectors = W / 4;
    for (int64_t b = 0; b < N / 16; b++)
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *group = src + b * 16 * row_stride + g * group_stride;
            uint8_t *out = dst + (b * G + g) * 16 * W;
            for (int64_t t = 0; t < vectors; t++)
                for (int i = 0; i < 16; i++)
                    memcpy(out + t * 64 + i * 4, group + i * row_stride + t * 4, 4);
        }
}

/* Each row's sum of int8 codes per group of 32 (exact in float32), in the lanes of the blocks
 * layout: dst (N/16, G, 16), lane i of row block b and group g for row 16 b + i; src as in
 * lucidlm_lanes_from_groups with W = 32. The AVX-512 loops need them (SHIFT_INT8_CODES). */
void lucidlm_int8_group_sums(const int8_t *src, int64_t N, int64_t G, int64_t row_stride, int64_t group_stride,
                             float *dst) {
    for (int64_t b = 0; b < N / 16; b++)
        for (int64_t g = 0; g < G; g++)
            for (int i = 0; i < 16; i++) {
                const int8_t *codes = src + (b * 16 + i) * row_stride + g * group_stride;
                int32_t sum = 0;
                for (int j = 0; j < 32; j++) sum += codes[j];
                dst[(b * G + g) * 16 + i] = (float)sum;
            }
}

/* The 16 source rows of output row block b: rows[16 b + i] (rows NULL: 16 b + i), each at
 * src + r * row_stride. */
static void row_block_sources(const uint8_t *src, int64_t b, int64_t row_stride, const int64_t *rows,
                              const uint8_t *row[16]) {
    for (int i = 0; i < 16; i++) row[i] = src + (rows ? rows[b * 16 + i] : b * 16 + i) * row_stride;
}

/* A GGUF Q4_0 (18-byte blocks: f16 d, 16 nibble bytes) or Q4_1 (20 bytes: f16 d, f16 m, 16
 * nibble bytes) matrix -> the int4 blocks layout, one pass: codes as lucidlm_lanes_from_groups
 * lays out the nibble bytes (which are already the layout's bytes: byte i holds column i low,
 * 16 + i high), s = d and z = m + 8 d (Q4_0: 0), computed in float32 and rounded to bfloat16,
 * in lanes (N/16, G, 16). src holds N rows of G blocks, row r at src + r * row_stride; output
 * row n reads source row rows[n] (rows NULL: n), which un-permutes LLaMA's Q/K rows exactly.
 * Returns how many blocks have a d or m that is NaN or infinite (all exponent bits set): the
 * loader's finiteness check of the file's scales, made in this pass instead of another one. */
int64_t lucidlm_q4_blocks(const uint8_t *src, int64_t block_bytes, int64_t N, int64_t G, int64_t row_stride,
                          const int64_t *rows, uint8_t *codes, uint16_t *s, uint16_t *z) {
    int64_t nonfinite = 0;
    for (int64_t b = 0; b < N / 16; b++) {
        const uint8_t *row[16], *block[16];
        row_block_sources(src, b, row_stride, rows, row);
        for (int64_t g = 0, lanes = b * G * 16; g < G; g++, lanes += 16) {
            for (int i = 0; i < 16; i++) block[i] = row[i] + g * block_bytes;
            nonfinite += q4_tile(block, (int)block_bytes - 16, codes + 16 * lanes, s + lanes, z + lanes);
        }
    }
    return nonfinite;
}

/* A GGUF Q8_0 matrix (34-byte blocks: f16 d, 32 int8 codes) -> the int8 blocks layout, one pass:
 * codes as lucidlm_lanes_from_groups lays them out (W = 32), d in float32 (exact) and each row's
 * code sum per group as lucidlm_int8_group_sums computes it, both in lanes (N/16, G, 16). src,
 * row_stride and rows as in lucidlm_q4_blocks. Returns how many blocks have a NaN or infinite d. */
int64_t lucidlm_q8_blocks(const uint8_t *src, int64_t N, int64_t G, int64_t row_stride, const int64_t *rows,
                          int8_t *codes, float *s, float *sums) {
    int64_t nonfinite = 0;
    for (int64_t b = 0; b < N / 16; b++) {
        const uint8_t *row[16], *block[16];
        row_block_sources(src, b, row_stride, rows, row);
        for (int64_t g = 0, lanes = b * G * 16; g < G; g++, lanes += 16) {
            for (int i = 0; i < 16; i++) block[i] = row[i] + g * 34;
            nonfinite += q8_tile(block, codes + 32 * lanes, s + lanes, sums + lanes);
        }
    }
    return nonfinite;
}
