/* Greedy decoding's pick: the index of each row's largest logit, as torch.argmax gives it on
 * the CPU -- the first index when several values are equal, and the first NaN when a row has
 * one (a NaN counts as the largest).
 *
 * Why by hand: torch's argmax over SmolLM2's 49152 logits takes ~45 us a row, one row after
 * another (8 rows: ~360 us, 3 % of a batch-8 decode step); a row is 192 KB that the
 * unembedding has just written, and two vector passes over it (the maximum, then where it first
 * is) take a few microseconds. Threads: OpenMP over rows.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "horizontal8.h"

static int64_t row_argmax(const float *x, int64_t V) {
    /* pass 1: the largest value, and whether any is NaN (max_ps would hide a NaN) */
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(top, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float best = hmax8(top);
    int nan = _mm256_movemask_ps(unordered) != 0;
    for (; i < V; i++) {
        nan |= isnan(x[i]);
        best = x[i] > best ? x[i] : best;
    }
    if (nan) {
        for (i = 0; i < V; i++)
            if (isnan(x[i])) return i;
    }
    /* pass 2: the first index holding it (-inf included: a row of -inf gives 0) */
    const __m256 wanted = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= V; i += 8) {
        int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), wanted, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz((unsigned)hits);
    }
    for (; i < V; i++)
        if (x[i] == best) return i;
    return 0; /* not reached: best is one of the row's values */
}

/* x (B, V) float32 rows, contiguous, V >= 1 -> out (B,) */
void lucidlm_argmax_rows(const float *x, int64_t B, int64_t V, int64_t *out) {
    #pragma omp parallel for schedule(static) if (B > 1 && B * V >= (1 << 16))
    for (int64_t b = 0; b < B; b++) out[b] = row_argmax(x + b * V, V);
}
