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

/* four dot products of q with four rows, their sums in out[0..3] (n a multiple of 8) */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int n,
                        float out[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
    }
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* positions walked in order through a block table without a division per position: the
 * row (in floats) of the current position */
typedef struct {
    const int32_t *table;
    int block_size, block, offset;
    int64_t token_stride;
} cursor_t;

static inline cursor_t cursor_at(const int32_t *table, int block_size, int64_t token_stride, int p) {
    cursor_t c = {table, block_size, p / block_size, p % block_size, token_stride};
    return c;
}

static inline int64_t cursor_row(const cursor_t *c) {
    return ((int64_t)c->table[c->block] * c->block_size + c->offset) * c->token_stride;
}

static inline void cursor_next(cursor_t *c) {
    if (++c->offset == c->block_size) {
        c->offset = 0;
        c->block++;
    }
}

/* scaled (and capped) scores of q against positions [start, start + span): scores[0..span) */
static void head_scores(const float *q, const float *keys, const int32_t *table, int block_size, int64_t token_stride,
                        int head_dim, int start, int span, float scale, float softcap, float *scores) {
    cursor_t c = cursor_at(table, block_size, token_stride, start);
    int t = 0;
    if (head_dim % 8 == 0) {
        for (; t + 4 <= span; t += 4) {
            const float *k0 = keys + cursor_row(&c);
            cursor_next(&c);
            const float *k1 = keys + cursor_row(&c);
            cursor_next(&c);
            const float *k2 = keys + cursor_row(&c);
            cursor_next(&c);
            const float *k3 = keys + cursor_row(&c);
            cursor_next(&c);
            dot4(q, k0, k1, k2, k3, head_dim, scores + t);
        }
    }
    for (; t < span; t++, cursor_next(&c)) scores[t] = dot(q, keys + cursor_row(&c), head_dim);
    for (t = 0; t < span; t++) {
        float score = scores[t] * scale;
        scores[t] = softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
    }
}

/* o[0..head_dim) = sum over t of weights[t] * value row of position start + t, times inverse;
 * 64 output columns at a time held in eight registers */
static void weighted_values(const float *weights, const float *vals, const int32_t *table, int block_size,
                            int64_t token_stride, int head_dim, int start, int span, float inverse, float *o) {
    int d0 = 0;
    for (; d0 + 64 <= head_dim; d0 += 64) {
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
        __m256 c4 = _mm256_setzero_ps(), c5 = _mm256_setzero_ps(), c6 = _mm256_setzero_ps(), c7 = _mm256_setzero_ps();
        cursor_t c = cursor_at(table, block_size, token_stride, start);
        for (int t = 0; t < span; t++, cursor_next(&c)) {
            const float *v = vals + cursor_row(&c) + d0;
            __m256 w = _mm256_set1_ps(weights[t]);
            c0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), c0);
            c1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), c1);
            c2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), c2);
            c3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), c3);
            c4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), c4);
            c5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), c5);
            c6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), c6);
            c7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), c7);
        }
        __m256 inv = _mm256_set1_ps(inverse);
        _mm256_storeu_ps(o + d0, _mm256_mul_ps(c0, inv));
        _mm256_storeu_ps(o + d0 + 8, _mm256_mul_ps(c1, inv));
        _mm256_storeu_ps(o + d0 + 16, _mm256_mul_ps(c2, inv));
        _mm256_storeu_ps(o + d0 + 24, _mm256_mul_ps(c3, inv));
        _mm256_storeu_ps(o + d0 + 32, _mm256_mul_ps(c4, inv));
        _mm256_storeu_ps(o + d0 + 40, _mm256_mul_ps(c5, inv));
        _mm256_storeu_ps(o + d0 + 48, _mm256_mul_ps(c6, inv));
        _mm256_storeu_ps(o + d0 + 56, _mm256_mul_ps(c7, inv));
    }
    for (; d0 + 8 <= head_dim; d0 += 8) {  /* what is left of the columns, eight at a time */
        __m256 acc = _mm256_setzero_ps();
        cursor_t c = cursor_at(table, block_size, token_stride, start);
        for (int t = 0; t < span; t++, cursor_next(&c))
            acc = _mm256_fmadd_ps(_mm256_set1_ps(weights[t]), _mm256_loadu_ps(vals + cursor_row(&c) + d0), acc);
        _mm256_storeu_ps(o + d0, _mm256_mul_ps(acc, _mm256_set1_ps(inverse)));
    }
    if (d0 == head_dim) return;
    for (int i = d0; i < head_dim; i++) o[i] = 0.0f;
    cursor_t c = cursor_at(table, block_size, token_stride, start);
    for (int t = 0; t < span; t++, cursor_next(&c)) {
        const float *v = vals + cursor_row(&c);
        for (int i = d0; i < head_dim; i++) o[i] += weights[t] * v[i];
    }
    for (int i = d0; i < head_dim; i++) o[i] *= inverse;
}

/* out [num_seqs, num_heads, head_dim] for query [num_seqs, num_heads, head_dim]: sequence s
 * attends positions [max(0, seq_lens[s] - window), seq_lens[s]) (window <= 0: all); each scaled
 * score s becomes softcap * tanh(s / softcap) where softcap > 0 (Gemma 2). Work is split by
 * (sequence, query head): a step of one sequence still spreads over every thread, and the
 * query heads of one KV head fall to the same thread in turn, so its rows are read from memory
 * once and from cache after. Scores come four positions at a time; each 64 output columns
 * accumulate in registers. */
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
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < units; unit++) {
            if (!scores) continue;
            int64_t s = unit / num_heads;
            int head = (int)(unit % num_heads), kv_head = head / group;
            int len = seq_lens[s];
            int start = window > 0 && len > window ? len - window : 0;
            int span = len - start;
            const int32_t *table = block_tables + s * table_stride;
            const float *q = query + (s * num_heads + head) * head_dim;
            const float *keys = cache + (int64_t)kv_head * head_dim, *vals = values + (int64_t)kv_head * head_dim;
            head_scores(q, keys, table, block_size, token_stride, head_dim, start, span, scale, softcap, scores);
            float top = -INFINITY;
            for (int t = 0; t < span; t++) top = scores[t] > top ? scores[t] : top;
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
            weighted_values(scores, vals, table, block_size, token_stride, head_dim, start, span, 1.0f / sum,
                            out + (s * num_heads + head) * head_dim);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
