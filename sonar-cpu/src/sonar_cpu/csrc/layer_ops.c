/* A decoder layer's small float32 operations, each one call instead of several tensor
 * operations: RMSNorm (with the residual add before it) and the neox rotary rotation.
 *
 * Built with -ffp-contract=off, so every product and sum rounds as its own operation: the
 * rotation rounds exactly as the tensor operations it replaces (bit for bit); the norm's sum of
 * squares runs in another order than torch's mean (a few ulps). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

static inline float sum_of_squares(const float *x, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(b, b));
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
    }
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; i < n; i++) total += x[i] * x[i];
    return total;
}

/* residual += x (when x is not NULL), then out = residual / sqrt(mean(residual^2) + eps) * weight,
 * for `rows` contiguous rows of `dim` */
void add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
                  float eps, int num_threads) {
    int nt = rows < num_threads ? (int)rows : num_threads;
#pragma omp parallel for num_threads(nt < 1 ? 1 : nt) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * dim;
        if (x) {
            const float *a = x + r * dim;
            for (int64_t i = 0; i < dim; i++) h[i] = h[i] + a[i];
        }
        float inverse = 1.0f / sqrtf(sum_of_squares(h, dim) / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = (h[i] * inverse) * weight[i];
    }
}

/* in place, for each token t and head: x[:half] = x[:half] cos - x[half:2 half] sin and
 * x[half:2 half] = x[half:2 half] cos + x[:half] sin (the old values on the right), with cos/sin
 * [tokens, half]; heads of head_dim floats, head after head, tokens token_stride apart */
static void rotate(float *x, int64_t tokens, int64_t token_stride, int heads, int head_dim, int half, const float *cos,
                   const float *sin) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * token_stride + (int64_t)h * head_dim, *x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                float b_sin = b * s[i], a_sin = a * s[i];
                x1[i] = a * c[i] - b_sin;
                x2[i] = b * c[i] + a_sin;
            }
        }
    }
}

void rotary_neox(float *query, int64_t query_stride, int num_heads, float *key, int64_t key_stride, int num_kv_heads,
                 int head_dim, int half, const float *cos, const float *sin, int64_t tokens) {
    rotate(query, tokens, query_stride, num_heads, head_dim, half, cos, sin);
    rotate(key, tokens, key_stride, num_kv_heads, head_dim, half, cos, sin);
}

/* out [rows, dim] = silu(gate) * up for gate_up [rows, 2 dim] (gate then up in each row);
 * silu(g) = g / (1 + exp(-g)) */
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t dim, int num_threads) {
    int nt = rows < num_threads ? (int)rows : num_threads;
#pragma omp parallel for num_threads(nt < 1 ? 1 : nt) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * dim, *u = g + dim;
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* the step's new keys and values into the cache [2, num_blocks * block_size, num_kv_heads *
 * head_dim] at their slots (a slot outside the cache is skipped); token t's key row starts at
 * key + t * key_stride */
void write_kv(const float *key, int64_t key_stride, const float *value, int64_t value_stride, float *cache,
              int64_t cache_slots, int64_t row, const int64_t *slots, int64_t tokens) {
    float *values = cache + cache_slots * row;
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0 || slots[t] >= cache_slots) continue;
        const float *k = key + t * key_stride, *v = value + t * value_stride;
        float *kc = cache + slots[t] * row, *vc = values + slots[t] * row;
        for (int64_t i = 0; i < row; i++) kc[i] = k[i];
        for (int64_t i = 0; i < row; i++) vc[i] = v[i];
    }
}
