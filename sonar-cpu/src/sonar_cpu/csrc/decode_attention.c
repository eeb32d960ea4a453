/* Decode attention over the paged KV cache in float32: each sequence's one new query token
 * attends its cached tokens (the new one written already), read in place through its block
 * table (grouped-query heads read their KV head's rows).
 *
 * The cache is [2, num_blocks, block_size, num_kv_heads, head_dim]: keys, then values. Work
 * is split over OpenMP threads by (sequence, query head). Softmax is the usual max-shifted
 * one, in float32, with a vectorized exp accurate to a few ulps. */
#include <math.h>
#include <stdlib.h>
#include <omp.h>

#include "simd.h"

/* exp(x) for eight floats (Cody-Waite reduction by ln 2, a degree-6 polynomial, 2^n by the
 * exponent bits); inputs below -87 give 0 */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float dot(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out [num_seqs, num_heads, head_dim] for query [num_seqs, num_heads, head_dim]: sequence s
 * attends positions [max(0, seq_lens[s] - window), seq_lens[s]) (window <= 0: all); each scaled
 * score s becomes softcap * tanh(s / softcap) where softcap > 0 (Gemma 2). Work is split by
 * (sequence, query head): a step of one sequence still spreads over every thread. */
int paged_decode_attention(const float *query, const float *cache, int64_t num_cache_blocks, int block_size,
                           int num_kv_heads, int head_dim, int num_heads, const int32_t *block_tables,
                           int64_t table_stride, const int32_t *seq_lens, int64_t num_seqs, int window, float scale,
                           float softcap, float *out, int num_threads) {
    int group = num_heads / num_kv_heads;
    if (group < 1 || num_heads % num_kv_heads) return -1;
    int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const float *values = cache + num_cache_blocks * block_size * token_stride;
    int64_t units = num_seqs * num_heads;
    int max_len = 0;
    for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > units) nt = (int)units;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        float *scores = malloc(sizeof(float) * ((int64_t)max_len + 8));
        float *acc = malloc(sizeof(float) * head_dim);
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < units; unit++) {
            if (!scores || !acc) continue;
            int64_t s = unit / num_heads;
            int head = (int)(unit % num_heads), kv_head = head / group;
            int len = seq_lens[s];
            int start = window > 0 && len > window ? len - window : 0;
            int span = len - start;
            const int32_t *table = block_tables + s * table_stride;
            const float *q = query + (s * num_heads + head) * head_dim;
            const float *keys = cache + (int64_t)kv_head * head_dim, *vals = values + (int64_t)kv_head * head_dim;
            float top = -INFINITY;
            for (int t = 0; t < span; t++) {
                int position = start + t;
                int64_t row = ((int64_t)table[position / block_size] * block_size + position % block_size) * token_stride;
                float score = dot(q, keys + row, head_dim) * scale;
                if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
                scores[t] = score;
                top = score > top ? score : top;
            }
            __m256 shift = _mm256_set1_ps(top), total = _mm256_setzero_ps();
            int t = 0;
            for (; t + 8 <= span; t += 8) {
                __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
                _mm256_storeu_ps(scores + t, p);
                total = _mm256_add_ps(total, p);
            }
            float sum = hsum(total);
            for (; t < span; t++) {
                scores[t] = expf(scores[t] - top);
                sum += scores[t];
            }
            for (int i = 0; i < head_dim; i++) acc[i] = 0.0f;
            for (t = 0; t < span; t++) {
                int position = start + t;
                int64_t row = ((int64_t)table[position / block_size] * block_size + position % block_size) * token_stride;
                const float *v = vals + row;
                __m256 pv = _mm256_set1_ps(scores[t]);
                int i = 0;
                for (; i + 8 <= head_dim; i += 8)
                    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
                for (; i < head_dim; i++) acc[i] += scores[t] * v[i];
            }
            float inverse = 1.0f / sum;
            float *o = out + (s * num_heads + head) * head_dim;
            for (int i = 0; i < head_dim; i++) o[i] = acc[i] * inverse;
        }
        free(scores);
        free(acc);
    }
    return failed ? -2 : 0;
}
