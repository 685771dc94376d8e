/* RMSNorm of float32 rows: out = x / sqrt(mean(x^2) + eps) * w, the sum of squares in float32
 * as torch's CPU rms_norm keeps it.
 *
 * Why by hand: torch 2.13's CPU rms_norm is a chain of small ops (square, mean, add, rsqrt,
 * two multiplies) that costs ~10 us a call on one thread and ~18 on two, where the mean opens a
 * parallel region; an eager SmolLM2 decode step calls it 61 times on rows of 576 floats, which
 * one pass over the row handles in well under a microsecond. Threads: OpenMP over rows, for a
 * prompt's many rows only.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "horizontal8.h"

static void row_rms_norm(const float *x, const float *w, int64_t D, float eps, float *out) {
    /* two chains of partial sums, so that one addition need not wait for the last */
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        sum0 = _mm256_fmadd_ps(a, a, sum0);
        sum1 = _mm256_fmadd_ps(b, b, sum1);
    }
    if (i + 8 <= D) {
        __m256 a = _mm256_loadu_ps(x + i);
        sum0 = _mm256_fmadd_ps(a, a, sum0);
        i += 8;
    }
    float squares = hsum8(_mm256_add_ps(sum0, sum1));
    for (; i < D; i++) squares += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(squares / (float)D + eps);  /* 1 / rms(x) */
    const __m256 scale = _mm256_set1_ps(inverse);
    for (i = 0; i + 8 <= D; i += 8)  /* (x * (1 / rms)) * w, torch's order */
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale), _mm256_loadu_ps(w + i)));
    for (; i < D; i++) out[i] = x[i] * inverse * w[i];
}

/* x (B, D) float32 rows, contiguous, D >= 1; w (D,) -> out (B, D) */
void lucidlm_rms_norm_rows(const float *x, const float *w, int64_t B, int64_t D, float eps, float *out) {
    #pragma omp parallel for schedule(static) if (B > 1 && B * D >= (1 << 16))
    for (int64_t b = 0; b < B; b++) row_rms_norm(x + b * D, w, D, eps, out + b * D);
}
