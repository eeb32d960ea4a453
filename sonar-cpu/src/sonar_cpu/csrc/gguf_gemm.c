/* GGUF block products with float32 activations: out[r, n] = sum_k x[r, k] * w[n, k] for
 * weights stored as llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks of 32 (fp16 scale [, fp16 min], codes).
 * Per block: sum((d q + m) x) = d sum(q x) + m sum(x); up to 8 activation rows per unpack. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, MAX_ROWS = 8 };

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float f16(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* the 32 codes of a block as four vectors of 8 floats, values 0..31 in order */
static inline void codes4(int type, const uint8_t *qs, __m256 q[4]) {
    if (type == Q8_0) {
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i))));
        return;
    }
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* rows [n0, n1) of the weight against nr <= MAX_ROWS activation rows */
static void tile(int type, const uint8_t *w, int64_t row_bytes, int64_t cols, const float *x, int64_t nr,
                 float *out, int64_t out_stride, int64_t n0, int64_t n1) {
    int64_t nb = cols / 32;
    int block = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34, head = type == Q4_1 ? 4 : 2;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc[MAX_ROWS], accm[MAX_ROWS];
        for (int r = 0; r < nr; r++) acc[r] = accm[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * block;
            __m256 q[4];
            codes4(type, blk + head, q);
            if (type == Q4_0) for (int i = 0; i < 4; i++) q[i] = _mm256_sub_ps(q[i], _mm256_set1_ps(8.0f));
            __m256 d = _mm256_set1_ps(f16(blk));
            __m256 m = _mm256_set1_ps(type == Q4_1 ? f16(blk + 2) : 0.0f);
            for (int r = 0; r < nr; r++) {
                const float *xb = x + r * cols + b * 32;
                __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
                __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
                __m256 dot = _mm256_mul_ps(q[0], x0);
                dot = _mm256_fmadd_ps(q[1], x1, dot);
                dot = _mm256_fmadd_ps(q[2], x2, dot);
                dot = _mm256_fmadd_ps(q[3], x3, dot);
                acc[r] = _mm256_fmadd_ps(d, dot, acc[r]);
                if (type == Q4_1)
                    accm[r] = _mm256_fmadd_ps(m, _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)), accm[r]);
            }
        }
        for (int r = 0; r < nr; r++) out[r * out_stride + n] = hsum(_mm256_add_ps(acc[r], accm[r]));
    }
}

typedef struct { int type; const uint8_t *w; int64_t row_bytes, rows, cols; const float *x; int64_t num_x; float *out;
                 int64_t n0, n1; } job_t;

static void *run_job(void *arg) {
    job_t *j = arg;
    for (int64_t r = 0; r < j->num_x; r += MAX_ROWS) {
        int64_t nr = j->num_x - r < MAX_ROWS ? j->num_x - r : MAX_ROWS;
        tile(j->type, j->w, j->row_bytes, j->cols, j->x + r * j->cols, nr, j->out + r * j->rows, j->rows, j->n0, j->n1);
    }
    return 0;
}

/* a persistent pool: workers spin on a generation counter a while, then sleep on a condition */
#define SPIN_ROUNDS 200000
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static int pool_size = 1;  /* threads including the caller */
static volatile int64_t generation = 0;
static volatile int pending = 0;
static job_t pool_jobs[64];

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    int64_t seen = 0;
    for (;;) {
        int spins = 0;
        while (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen) {
            if (++spins < SPIN_ROUNDS) { _mm_pause(); continue; }
            pthread_mutex_lock(&pool_lock);
            while (generation == seen) pthread_cond_wait(&pool_wake, &pool_lock);
            pthread_mutex_unlock(&pool_lock);
        }
        seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        run_job(&pool_jobs[id]);
        __atomic_sub_fetch(&pending, 1, __ATOMIC_ACQ_REL);
    }
    return 0;
}

static void grow_pool(int num_threads) {
    for (; pool_size < num_threads; pool_size++) {
        pthread_t tid;
        pthread_create(&tid, 0, worker, (void *)(intptr_t)pool_size);
        pthread_detach(tid);
    }
}

/* out [num_x, rows] = x [num_x, cols] @ w.T, split over num_threads threads by weight rows
 * (one caller at a time: the engine's step thread) */
int gguf_linear(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t num_x, float *out,
                int num_threads) {
    if ((type != Q4_0 && type != Q4_1 && type != Q8_0) || cols % 32) return -1;
    int64_t row_bytes = cols / 32 * (type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34);
    if (num_threads > 64) num_threads = 64;
    if (num_threads > rows / 8) num_threads = (int)(rows / 8);
    if (num_threads < 1) num_threads = 1;
    job_t all = {type, w, row_bytes, rows, cols, x, num_x, out, 0, rows};
    if (num_threads == 1) { run_job(&all); return 0; }
    grow_pool(num_threads);
    for (int t = 0; t < pool_size; t++) {
        pool_jobs[t] = all;
        /* split on multiples of 8 rows */
        pool_jobs[t].n0 = t < num_threads ? (rows / 8 * t / num_threads) * 8 : rows;
        pool_jobs[t].n1 = t < num_threads ? (t + 1 == num_threads ? rows : (rows / 8 * (t + 1) / num_threads) * 8) : rows;
    }
    __atomic_store_n(&pending, pool_size - 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool_lock);
    __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
    run_job(&pool_jobs[0]);
    while (__atomic_load_n(&pending, __ATOMIC_ACQUIRE)) _mm_pause();
    return 0;
}
