/* Row-wise selection over float32 logits: the index of each row's largest value, as torch's
 * argmax answers it (the first index on ties; a NaN counts as the largest, the first one wins).
 *
 * Two passes over each row: the maximum (and whether there is a NaN), then the first index that
 * holds it. A row of a large vocabulary stays in the core's cache between the passes. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

static int64_t row_argmax(const float *x, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256 unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_max_ps(best, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best);
    float top = lanes[0];
    for (int j = 1; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    int has_nan = _mm256_movemask_ps(unordered) != 0;
    for (int64_t j = i; j < n; j++) {
        if (x[j] != x[j]) has_nan = 1;
        else if (x[j] > top) top = x[j];
    }
    if (has_nan) {
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    }
    __m256 wanted = _mm256_set1_ps(top);
    for (i = 0; i + 8 <= n; i += 8) {
        int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), wanted, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz(hits);
    }
    for (; i < n; i++)
        if (x[i] == top) return i;
    return 0; /* only an empty row gets here */
}

/* out[r] = the argmax of row r of the contiguous [rows, n] x */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
    int nt = rows < num_threads ? (int)rows : num_threads;
#pragma omp parallel for num_threads(nt < 1 ? 1 : nt) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * n, n);
}
