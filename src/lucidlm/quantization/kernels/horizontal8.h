/* The sum and the maximum of a 256-bit vector's 8 floats (AVX), for the AVX2 loops and the
 * decode attention loop. */
#ifndef LUCIDLM_HORIZONTAL8_H
#define LUCIDLM_HORIZONTAL8_H
#include <immintrin.h>

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

#endif
