/* blocks32.c's inner loops for AVX-512 (F, BW, VL) with VNNI and BF16: one 512-bit vector holds
 * a row block's 16 output rows, and vpdpbusd takes 4 bytes of each row's dot product per lane
 * in one instruction. The layout and the arithmetic are in blocks32.c's comment. */
#define ROWS_AT_ONCE 8 /* activation rows sharing one unpacking of the weights */
#define SHIFT_INT8_CODES 1 /* vpdpbusd's unsigned side is x: int8 codes + 128 */
/* Groups ahead whose weights, scales and zeros (or code sums) each group's pass asks L2 for:
 * ~5 KB of int4 codes, ~100 ns of DRAM latency at this loop's pace. SmolLM2's 211 matrices in
 * one process, variants alternating (AMD EPYC Zen 4, 2 threads, medians, 2026-11-26): at batch
 * 1 the int4 ones 4.56 -> 3.72 ms and the int8 token table 2.34 -> 1.85 ms when asking L1; asking
 * L2 instead, against L1 in another run, 4.15 -> 3.58 and 2.10 -> 1.36 ms (L1 fills crowd out
 * the loop's own loads). At batch 8 -14 % (L1), the same again with L2. 8, 24 and 32 groups
 * ahead did no better. */
#define PREFETCH_GROUPS 16

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
 * then as precise as 16-bit codes: a bfloat16 input is kept to its own rounding. Stored per
 * group: the unit u = a / 254, in which x ~ u (254 r1 + r2). */
static void quantize_row(const void *x, int bf16, int K, int8_t *codes, int8_t *rest, float *unit, float *sum,
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
        unit[g] = a / 254.0f;
        sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    }
}

static inline void store_y16(void *y, int bf16, size_t i, __m512 v) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps((float *)y + i, v);
}

/* acc += w . broadcast(*p), 16 lanes of 4 bytes: vpdpbusd with x's 4 codes as its embedded
 * broadcast ({1to16}), which gcc does not fold from _mm512_set1_epi32 on its own: a separate
 * vpbroadcastd per multiply cost 3-4 % of the int4 matmul time (AMD EPYC Zen 4, one thread). */
#define DPBUSD_BROADCAST(acc, w, p) \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(p)))

/* sum over the group of q * r for 16 rows at once: w the int4 codes as above, r x's 32 int8 codes */
static inline __m512i group_dot(const __m512i *w, const int8_t *r) {
    const int32_t *a = (const int32_t *)r; /* 4 codes of x per int32, broadcast to every row */
    __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
    for (int t = 0; t < 8; t += 2) {
        DPBUSD_BROADCAST(d0, w[t], a + t);
        DPBUSD_BROADCAST(d1, w[t + 1], a + t + 1);
    }
    return _mm512_add_epi32(d0, d1); /* exact */
}

/* 254 main + rest in int32: the sums of x's two codes joined into one (blocks32.c) */
static inline __m512i joined_sums(__m512i main, __m512i rest) {
    return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(main, 8), _mm512_slli_epi32(main, 1)), rest);
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
                            const int8_t *xr, const float *xu, int rows, int K, void *y, int bf16, size_t N, size_t n0) {
    __m512 acc[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i w[8];
        prefetch_lines_l2(codes + 512 * (size_t)(g + PREFETCH_GROUPS), 8);
        prefetch_lines_l2(s + 16 * (size_t)(g + PREFETCH_GROUPS), 1);
        prefetch_lines_l2(qsum + 16 * (size_t)(g + PREFETCH_GROUPS), 1);
        for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512((const void *)(codes + 512 * (size_t)g + 64 * t));
        /* sum q (r + 128) = sum q r + 128 sum q for either code: 255 x 128 sum q comes off the joined sum */
        __m512 sv = _mm512_loadu_ps(s + 16 * (size_t)g);
        __m512i shift = _mm512_mullo_epi32(_mm512_cvtps_epi32(_mm512_loadu_ps(qsum + 16 * (size_t)g)),
                                           _mm512_set1_epi32(255 * 128));
        for (int r = 0; r < rows; r++) {
            size_t at = (size_t)r * K + 32 * (size_t)g;
            __m512i joined = _mm512_sub_epi32(joined_sums(group_dot_int8(w, xq + at), group_dot_int8(w, xr + at)), shift);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined), _mm512_mul_ps(sv, _mm512_set1_ps(xu[(size_t)r * G + g])),
                                     acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_y16(y, bf16, (size_t)r * N + n0, acc[r]);
}

/* int4 weights: 16 rows (block b) x up to ROWS_AT_ONCE rows of x. */
static void block_rows(const uint8_t *codes, const uint16_t *s, const uint16_t *z, int G, const int8_t *xq,
                       const int8_t *xr, const float *xu, const float *xsum, int rows, int K, void *y, int bf16,
                       size_t N, size_t n0) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i w[8]; /* w[t]: columns 4t..4t+3 of the group, w[t + 4]: columns 16 + 4t.. */
        prefetch_lines_l2(codes + 256 * (size_t)(g + PREFETCH_GROUPS), 4);
        prefetch_lines_l2(s + 16 * (size_t)(g + PREFETCH_GROUPS), 1);
        prefetch_lines_l2(z + 16 * (size_t)(g + PREFETCH_GROUPS), 1);
        for (int t = 0; t < 4; t++) {
            __m512i v = _mm512_loadu_si512((const void *)(codes + 256 * (size_t)g + 64 * t));
            w[t] = _mm512_and_si512(v, low4);
            w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        __m512 sv = load_bf16x16(s + 16 * (size_t)g), zv = load_bf16x16(z + 16 * (size_t)g);
        __m512 mv = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sv, zv); /* z - 8 s: the weight of code 0 */
        for (int r = 0; r < rows; r++) {
            size_t at = (size_t)r * K + 32 * (size_t)g;
            __m512i joined = joined_sums(group_dot(w, xq + at), group_dot(w, xr + at));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(joined), _mm512_mul_ps(sv, _mm512_set1_ps(xu[(size_t)r * G + g])),
                                     acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[(size_t)r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_y16(y, bf16, (size_t)r * N + n0, acc[r]);
}


/* The loader's Q4 pass (lucidlm_q4_blocks in blocks32.c), a tile at a time: the 16 blocks of one
 * row block and group, block i at p[i]. The layout's vector t holds 32-bit word t of each row's
 * 16 nibble bytes, so a tile is a 16 x 4 matrix of words to transpose: four registers of four
 * rows (one per 128-bit lane), then two-table permutes; the scales come through the same
 * transpose of each block's first word (d | m << 16). Returns how many of the blocks have a NaN
 * or infinite d or m. Measured on SmolLM2's 210 Q4_1 matrices (Zen 4, one thread, pages mapped):
 * 13.4 ms, against 29-39 ms for the scalar tiles (blocks32_avx2.h) and 41 ms with a gather per
 * vector. */
static inline __m512i four_rows(const uint8_t *const *p, int at) {  /* 16 bytes of p[0..3] + at, a lane each */
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[0] + at)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[1] + at)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[2] + at)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[3] + at)), 3);
}

/* word t of each of the 16 rows held four to a register in q[0..3] */
static inline __m512i column_of_rows(const __m512i q[4], int t) {
    /* element i < 8 of the pair (q[0], q[1]) at index 4 i + t is word t of row i (rows 8.. likewise) */
    const __m512i pick = _mm512_add_epi32(_mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28),
                                          _mm512_set1_epi32(t));
    __m512i low = _mm512_permutex2var_epi32(q[0], pick, q[1]), high = _mm512_permutex2var_epi32(q[2], pick, q[3]);
    return _mm512_inserti64x4(low, _mm512_castsi512_si256(high), 1);
}

static inline __mmask16 nonfinite_halves(__m512i halves) {  /* a float16 in each lane's low 16 bits */
    const __m512i exponent = _mm512_set1_epi32(0x7c00);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(halves, exponent), exponent);
}

static inline int q4_tile(const uint8_t *const p[16], int nibbles, uint8_t *codes, uint16_t *s, uint16_t *z) {
    __m512i q[4];
    for (int k = 0; k < 4; k++) q[k] = four_rows(p + 4 * k, nibbles);
    for (int t = 0; t < 4; t++) _mm512_storeu_si512((void *)(codes + 64 * t), column_of_rows(q, t));
    for (int k = 0; k < 4; k++) q[k] = four_rows(p + 4 * k, 0);
    __m512i dm = column_of_rows(q, 0);  /* d | m << 16 (Q4_0: d | its first code bytes) */
    __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)), zero = _mm512_setzero_ps();
    __mmask16 bad = nonfinite_halves(dm);
    if (nibbles == 4) {
        __m512i m = _mm512_srli_epi32(dm, 16);
        zero = _mm512_add_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(m)), _mm512_mul_ps(_mm512_set1_ps(8.0f), d));
        bad |= nonfinite_halves(m);
    }
    /* rounded to nearest even as bf16_from_float does; float16 inputs give no bfloat16 subnormal */
    _mm256_storeu_si256((__m256i *)s, (__m256i)_mm512_cvtneps_pbh(d));
    _mm256_storeu_si256((__m256i *)z, (__m256i)_mm512_cvtneps_pbh(zero));
    return __builtin_popcount(bad);
}

/* The loader's Q8_0 pass (lucidlm_q8_blocks), a tile at a time as q4_tile: 34-byte blocks (f16 d,
 * 32 int8 codes), a 16 x 8 matrix of words, transposed in two halves of four words. SmolLM2's
 * token table (49152 x 576): 8.5 ms, against 35-38 ms for the scalar tiles. */
static inline int q8_tile(const uint8_t *const p[16], int8_t *codes, float *s, float *sums) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i sum = _mm512_setzero_si512(), q[4];
    for (int half = 0; half < 2; half++) {
        for (int k = 0; k < 4; k++) q[k] = four_rows(p + 4 * k, 2 + 16 * half);
        for (int t = 0; t < 4; t++) {
            __m512i v = column_of_rows(q, t);
            _mm512_storeu_si512((void *)(codes + 64 * (4 * half + t)), v);
            sum = _mm512_dpbusd_epi32(sum, ones, v);  /* + each lane's 4 signed codes (unsigned 1 x signed code) */
        }
    }
    for (int k = 0; k < 4; k++) q[k] = four_rows(p + 4 * k, 0);
    __m512i d = column_of_rows(q, 0);  /* d | its first two codes << 16 */
    _mm512_storeu_ps(s, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d)));
    _mm512_storeu_ps(sums, _mm512_cvtepi32_ps(sum));
    return __builtin_popcount(nonfinite_halves(d));
}
