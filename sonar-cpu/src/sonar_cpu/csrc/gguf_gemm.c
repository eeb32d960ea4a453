/* GGUF block products: out[r, n] = sum_k x[r, k] * w[n, k] for weights stored as llama.cpp's
 * Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL blocks of 32 (fp16 scale [, fp16 min] [, fifth bits],
 * codes; IQ4_NL's 4-bit codes index a table of 16 signed values); Q5_0, Q5_1 and IQ4_NL in
 * layout 8 only.
 *
 * Two products:
 * - gguf_linear: float32 activations, exact up to float32 summation order. Per block:
 *   sum((d q + m) x) = d sum(q x) + m sum(x); up to 8 activation rows per unpack.
 * - gguf_linear_q8: the activations quantized first to int8 in blocks of 32 (a float scale
 *   per block, amax / 127), then integer dot products of codes against codes (AVX2 maddubs,
 *   or VNNI where the compiler targets it), scaled per block. The activations' rounding is the
 *   only difference from the exact product (about 0.4% of a block's largest value).
 *
 * Each reads the weights in one of two layouts: the file's, row after row (layout 1), or eight
 * rows to a vector (layout 8, the lanes_* functions below), which sonar_cpu.gguf_kernel lays a
 * layer's blocks out in at load wherever its rows come in groups of eight.
 *
 * Both split the weight's rows over OpenMP threads. Compiled with -fopenmp, the library binds
 * to the OpenMP runtime already loaded in the process (torch's), so its threads are torch's:
 * nothing contends with torch's own parallel regions. */
#include <math.h>
#include <omp.h>

#include "simd.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20, MAX_ROWS = 8, ROW_ALIGN = 8 };

/* the types each layout takes */
static inline int file_layout_type(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }
static inline int lanes_type(int type) { return file_layout_type(type) || type == Q5_0 || type == Q5_1 || type == IQ4_NL; }
/* the types whose operands hold signed codes (the others: unsigned, offset by a constant) */
static inline int signed_codes(int type) { return type == Q8_0 || type == IQ4_NL; }
static inline int five_bits(int type) { return type == Q5_0 || type == Q5_1; }
static inline int has_minimum(int type) { return type == Q4_1 || type == Q5_1; }
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif

static inline int block_bytes(int type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34; }

/* Weights are stored row after row as in the file (layout 1), or eight rows to a vector
 * (layout 8, below: lanes_*). */
static inline const uint8_t *block_at(const uint8_t *w, int64_t row_bytes, int block, int64_t n, int64_t b) {
    return w + n * row_bytes + b * block;
}
static inline int head_bytes(int type) { return type == Q4_1 ? 4 : 2; }

/* the share [n0, n1) of `rows` weight rows that thread t of nt takes, on multiples of ROW_ALIGN */
static inline void share(int64_t rows, int t, int nt, int64_t *n0, int64_t *n1) {
    int64_t units = (rows + ROW_ALIGN - 1) / ROW_ALIGN;
    *n0 = units * t / nt * ROW_ALIGN;
    *n1 = units * (t + 1) / nt * ROW_ALIGN;
    if (*n0 > rows) *n0 = rows;
    if (*n1 > rows) *n1 = rows;
}

static int lanes_linear(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t num_x,
                        float *out, int num_threads, uint8_t *scratch, int exact);

static inline int clamp_threads(int num_threads, int64_t rows) {
    if (num_threads > rows / ROW_ALIGN) num_threads = (int)(rows / ROW_ALIGN);
    return num_threads < 1 ? 1 : num_threads;
}

/* ---------------------------------------------------------------- exact (float32 activations) */

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

/* weight rows [n0, n1) against nr <= MAX_ROWS activation rows */
static void exact_tile(int type, const uint8_t *w, int64_t row_bytes, int64_t cols, const float *x,
                       int64_t nr, float *out, int64_t out_stride, int64_t n0, int64_t n1) {
    int64_t nb = cols / 32;
    int block = block_bytes(type), head = head_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        __m256 acc[MAX_ROWS], accm[MAX_ROWS];
        for (int r = 0; r < nr; r++) acc[r] = accm[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = block_at(w, row_bytes, block, n, b);
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

/* out [num_x, rows] = x [num_x, cols] @ w.T, float32 activations */
int gguf_linear(int type, const uint8_t *w, int layout, int64_t rows, int64_t cols, const float *x, int64_t num_x,
                float *out, int num_threads, uint8_t *scratch) {
    if (!lanes_type(type) || cols % 32) return -1;
    if (layout == 8) return lanes_linear(type, w, rows, cols, x, num_x, out, num_threads, scratch, 1);
    if (layout != 1 || !file_layout_type(type)) return -1;
    int64_t row_bytes = cols / 32 * block_bytes(type);
    int nt = clamp_threads(num_threads, rows);
#pragma omp parallel num_threads(nt)
    {
        int64_t n0, n1;
        share(rows, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        for (int64_t r = 0; r < num_x; r += MAX_ROWS) {
            int64_t nr = num_x - r < MAX_ROWS ? num_x - r : MAX_ROWS;
            exact_tile(type, w, row_bytes, cols, x + r * cols, nr, out + r * rows, rows, n0, n1);
        }
    }
    return 0;
}

/* ------------------------------------------------------------- int8 activations (fast path) */

/* the activations of one row as int8 codes in blocks of 32: x ~ scale[b] * codes[b * 32 + i];
 * sums[b] = sum of the block's codes */
static void quantize_row(const float *x, int64_t cols, int8_t *codes, float *scale, int32_t *sums) {
    for (int64_t b = 0; b < cols / 32; b++) {
        int32_t halves[2];
        scale[b] = quantize_block32(x + b * 32, codes + b * 32, halves);
        sums[b] = halves[0] + halves[1];
    }
}

/* the 32 codes of a 4-bit block as unsigned bytes in order: low nibbles are values 0..15 */
static inline __m256i nibbles(const uint8_t *qs) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* a weight block's codes and scales, decoded once for every activation row */
typedef struct { __m256i q, magnitude; float d, offset; } wblock_t;

static inline wblock_t load_block(int type, const uint8_t *blk) {
    wblock_t wb;
    wb.d = f16(blk);
    if (type == Q8_0) {
        wb.q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        wb.magnitude = _mm256_sign_epi8(wb.q, wb.q);
        wb.offset = 0.0f;
    } else {
        wb.q = wb.magnitude = nibbles(blk + head_bytes(type));
        /* Q4_1: + m * sum(x);  Q4_0: the codes are offset by 8, - 8 d sum(x) */
        wb.offset = type == Q4_1 ? f16(blk + 2) : -8.0f * wb.d;
    }
    return wb;
}

/* eight int32 lanes of the block's codes against one activation block's codes */
static inline __m256i block_dot(int type, const wblock_t *wb, __m256i xq) {
    return type == Q8_0 ? dot_u8_s8(wb->magnitude, _mm256_sign_epi8(xq, wb->q)) : dot_u8_s8(wb->q, xq);
}

/* one activation row against weight rows [n0, n1), four weight rows at a time (independent
 * accumulators, so the adds do not wait on each other) */
static void q8_row(int type, const uint8_t *w, int64_t row_bytes, int64_t cols, const int8_t *codes,
                   const float *scale, const int32_t *sums, float *out, int64_t n0, int64_t n1) {
    int64_t nb = cols / 32;
    int block = block_bytes(type);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        float extra[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t b = 0; b < nb; b++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(codes + b * 32));
            float dx = scale[b], sx = dx * (float)sums[b];
            for (int i = 0; i < 4; i++) {
                const uint8_t *blk = block_at(w, row_bytes, block, n + i, b);
                _mm_prefetch((const char *)blk + PREFETCH_BYTES, _MM_HINT_T0);
                wblock_t wb = load_block(type, blk);
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(wb.d * dx), _mm256_cvtepi32_ps(block_dot(type, &wb, xq)), acc[i]);
                extra[i] += wb.offset * sx;
            }
        }
        for (int i = 0; i < 4; i++) out[n + i] = hsum(acc[i]) + extra[i];
    }
    for (; n < n1; n++) {
        __m256 acc = _mm256_setzero_ps();
        float extra = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(codes + b * 32));
            wblock_t wb = load_block(type, block_at(w, row_bytes, block, n, b));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(wb.d * scale[b]), _mm256_cvtepi32_ps(block_dot(type, &wb, xq)), acc);
            extra += wb.offset * scale[b] * (float)sums[b];
        }
        out[n] = hsum(acc) + extra;
    }
}

/* nr <= MAX_ROWS activation rows against weight rows [n0, n1), each weight block decoded once */
static void q8_tile(int type, const uint8_t *w, int64_t row_bytes, int64_t cols, const int8_t *codes,
                    const float *scale, const int32_t *sums, int64_t nr, float *out, int64_t out_stride, int64_t n0,
                    int64_t n1) {
    if (nr == 1) {
        q8_row(type, w, row_bytes, cols, codes, scale, sums, out, n0, n1);
        return;
    }
    int64_t nb = cols / 32;
    int block = block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        __m256 acc[MAX_ROWS];
        float extra[MAX_ROWS];
        for (int r = 0; r < nr; r++) { acc[r] = _mm256_setzero_ps(); extra[r] = 0.0f; }
        for (int64_t b = 0; b < nb; b++) {
            wblock_t wb = load_block(type, block_at(w, row_bytes, block, n, b));
            for (int r = 0; r < nr; r++) {
                __m256i xq = _mm256_loadu_si256((const __m256i *)(codes + r * cols + b * 32));
                float dx = scale[r * nb + b];
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wb.d * dx), _mm256_cvtepi32_ps(block_dot(type, &wb, xq)), acc[r]);
                extra[r] += wb.offset * dx * (float)sums[r * nb + b];
            }
        }
        for (int r = 0; r < nr; r++) out[r * out_stride + n] = hsum(acc[r]) + extra[r];
    }
}


/* ------------------------------------------------ eight rows in the lanes of one vector (layout 8)
 *
 * Each group of eight weight rows is stored block by block as
 *   [8 fp16 scales d][8 fp16 minimums m (Q4_1, Q5_1)][8 x 4 bytes of fifth bits (Q5_0, Q5_1)][codes]
 * where the codes are vectors of 32 bytes holding, in 32-bit lane j, four consecutive codes of
 * row j: for 4- and 5-bit types four vectors, chunk c holding the GGUF bytes qs[4c .. 4c + 4]
 * of each row (low nibbles: values 4c .. 4c + 3, high nibbles: values 16 + 4c ..); for Q8_0
 * eight vectors, chunk c holding values 4c .. 4c + 3. A 5-bit block's 32 fifth bits (bit v for
 * value v in the file) are reordered per row so that byte i holds, at bit k, the fifth bit of
 * value 4k + i: operand k's bits are then one shift and mask away. A dot product of four bytes
 * per lane (VNNI, or maddubs + madd) against four activation codes broadcast to every lane
 * then yields eight rows' partial sums at once, and the per-block scales apply as vectors of
 * eight rows. */

static inline int lanes_codes_bytes(int type) { return type == Q8_0 ? 256 : 128; }
static inline int lanes_head_bytes(int type) { return (has_minimum(type) ? 32 : 16) + (five_bits(type) ? 32 : 0); }
static inline int64_t lanes_group_block_bytes(int type) { return lanes_head_bytes(type) + lanes_codes_bytes(type); }

/* the eight 32-byte operands of a block of eight rows: operand k pairs with activation values
 * 4k .. 4k + 3 (unsigned codes for 4- and 5-bit types; for Q8_0, and IQ4_NL after its table, the signed codes, made unsigned by the
 * caller with their signs moved onto the activations) */
static inline void lanes_operands(int type, const uint8_t *blk, __m256i op[8]) {
    const uint8_t *codes = blk + lanes_head_bytes(type);
    if (type == Q8_0) {
        for (int k = 0; k < 8; k++) op[k] = _mm256_loadu_si256((const __m256i *)(codes + 32 * k));
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)(codes + 32 * c));
        op[c] = _mm256_and_si256(packed, low);
        op[c + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
    if (type == IQ4_NL) {  /* each nibble indexes llama.cpp's non-linear table */
        const __m256i table = iq4_table();
        for (int k = 0; k < 8; k++) op[k] = _mm256_shuffle_epi8(table, op[k]);
    }
    if (five_bits(type)) {
        __m256i bits = _mm256_loadu_si256((const __m256i *)(codes - 32));
        const __m256i one = _mm256_set1_epi8(1);
        for (int k = 0; k < 8; k++)
            op[k] = _mm256_or_si256(op[k], _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, k), one), 4));
    }
}

/* one activation row's int8 block against a block of eight rows: the eight rows' integer dots */
static inline __m256i lanes_block_dot(int type, const __m256i op[8], const int8_t *xq) {
    __m256i total = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        __m256i x4 = _mm256_set1_epi32(*(const int32_t *)(xq + 4 * k));
        __m256i part = signed_codes(type) ? dot_u8_s8(_mm256_sign_epi8(op[k], op[k]), _mm256_sign_epi8(x4, op[k]))
                                          : dot_u8_s8(op[k], x4);
        total = _mm256_add_epi32(total, part);
    }
    return total;
}

/* int8 activation rows [0, nr) (nr <= 4) against row groups [g0, g1) */
static void lanes_q8(int type, const uint8_t *w, int64_t nb, const int8_t *codes, const float *scale,
                     const int32_t *sums, int64_t cols, int64_t nr, float *out, int64_t out_stride, int64_t g0,
                     int64_t g1) {
    int64_t gb = lanes_group_block_bytes(type);
    for (int64_t g = g0; g < g1; g++) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const uint8_t *group = w + g * nb * gb;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = group + b * gb;
            _mm_prefetch((const char *)blk + PREFETCH_BYTES, _MM_HINT_T0);
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            /* Q4_1, Q5_1: + m sum(x);  Q4_0 (Q5_0): codes offset by 8 (16), - 8 d sum(x) (- 16 d sum(x)) */
            __m256 offset = has_minimum(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                          : signed_codes(type) ? _mm256_setzero_ps() : _mm256_mul_ps(d, _mm256_set1_ps(type == Q5_0 ? -16.0f : -8.0f));
            __m256i op[8];
            lanes_operands(type, blk, op);
            for (int r = 0; r < nr; r++) {
                float dx = scale[r * nb + b];
                __m256 dot = _mm256_cvtepi32_ps(lanes_block_dot(type, op, codes + r * cols + b * 32));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), dot, acc[r]);
                if (!signed_codes(type)) acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(dx * (float)sums[r * nb + b]), acc[r]);
            }
        }
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + r * out_stride + g * 8, acc[r]);
    }
}

/* float activation rows [0, nr) (nr <= 4) against row groups [g0, g1), exact up to summation
 * order: per block d * sum(q x) + m * sum(x) with the codes as floats */
static void lanes_exact(int type, const uint8_t *w, int64_t nb, const float *x, const float *xsums, int64_t cols,
                        int64_t nr, float *out, int64_t out_stride, int64_t g0, int64_t g1) {
    int64_t gb = lanes_group_block_bytes(type);
    const __m256i byte = _mm256_set1_epi32(0xFF);
    const __m256 code_offset = _mm256_set1_ps(type == Q4_0 ? 8.0f : type == Q5_0 ? 16.0f : 0.0f);
    for (int64_t g = g0; g < g1; g++) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const uint8_t *group = w + g * nb * gb;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = group + b * gb;
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            __m256 m = has_minimum(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : _mm256_setzero_ps();
            __m256i op[8];
            lanes_operands(type, blk, op);
            __m256 block_acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int k = 0; k < 8; k++) {
                for (int i = 0; i < 4; i++) {
                    __m256i q = _mm256_srli_epi32(op[k], 8 * i);
                    /* Q8_0, IQ4_NL: sign-extend the byte; 4- and 5-bit: the code less 8 for Q4_0, 16 for Q5_0 */
                    __m256 wq = signed_codes(type) ? _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(op[k], 24 - 8 * i), 24))
                              : _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, byte)), code_offset);
                    for (int r = 0; r < nr; r++)
                        block_acc[r] = _mm256_fmadd_ps(wq, _mm256_set1_ps(x[r * cols + b * 32 + 4 * k + i]), block_acc[r]);
                }
            }
            for (int r = 0; r < nr; r++) {
                acc[r] = _mm256_fmadd_ps(d, block_acc[r], acc[r]);
                if (has_minimum(type)) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsums[r * nb + b]), acc[r]);
            }
        }
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + r * out_stride + g * 8, acc[r]);
    }
}

enum { LANE_ROWS = 4 };  /* activation rows per pass over the weights (accumulators in registers) */

static int lanes_linear(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t num_x,
                        float *out, int num_threads, uint8_t *scratch, int exact) {
    if (rows % 8) return -1;
    int64_t nb = cols / 32, groups = rows / 8;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > groups) nt = (int)groups;
    int8_t *codes = (int8_t *)scratch;
    float *scale = (float *)(scratch + ((num_x * cols + 15) & ~(int64_t)15));
    int32_t *sums = (int32_t *)(scale + num_x * nb);
    float *xsums = scale; /* exact products: the activations' sums per block, in the scales' place */
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        for (int64_t r = t; r < num_x; r += count) {
            if (exact) {
                for (int64_t b = 0; b < nb; b++) {
                    const float *xb = x + r * cols + b * 32;
                    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                             _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
                    xsums[r * nb + b] = hsum(s);
                }
            } else {
                quantize_row(x + r * cols, cols, codes + r * cols, scale + r * nb, sums + r * nb);
            }
        }
#pragma omp barrier
        int64_t g0 = groups * t / count, g1 = groups * (t + 1) / count;
        for (int64_t r = 0; r < num_x; r += LANE_ROWS) {
            int64_t nr = num_x - r < LANE_ROWS ? num_x - r : LANE_ROWS;
            if (exact)
                lanes_exact(type, w, nb, x + r * cols, xsums + r * nb, cols, nr, out + r * rows, rows, g0, g1);
            else
                lanes_q8(type, w, nb, codes + r * cols, scale + r * nb, sums + r * nb, cols, nr, out + r * rows, rows, g0, g1);
        }
    }
    return 0;
}

/* bytes of scratch gguf_linear_q8 needs for num_x rows of cols activations */
int64_t gguf_q8_scratch_bytes(int64_t cols, int64_t num_x) {
    return num_x * (cols + cols / 32 * (int64_t)(sizeof(float) + sizeof(int32_t))) + 64;
}

/* out [num_x, rows] = x [num_x, cols] @ w.T with x quantized to int8 blocks in `scratch`
 * (gguf_q8_scratch_bytes of it) */
int gguf_linear_q8(int type, const uint8_t *w, int layout, int64_t rows, int64_t cols, const float *x, int64_t num_x,
                   float *out, int num_threads, uint8_t *scratch) {
    if (!lanes_type(type) || cols % 32) return -1;
    if (layout == 8) return lanes_linear(type, w, rows, cols, x, num_x, out, num_threads, scratch, 0);
    if (layout != 1 || !file_layout_type(type)) return -1;
    int64_t row_bytes = cols / 32 * block_bytes(type), nb = cols / 32;
    int8_t *codes = (int8_t *)scratch;
    float *scale = (float *)(scratch + ((num_x * cols + 15) & ~(int64_t)15));
    int32_t *sums = (int32_t *)(scale + num_x * nb);
    int nt = clamp_threads(num_threads, rows);
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        for (int64_t r = t; r < num_x; r += count)
            quantize_row(x + r * cols, cols, codes + r * cols, scale + r * nb, sums + r * nb);
#pragma omp barrier
        int64_t n0, n1;
        share(rows, t, count, &n0, &n1);
        for (int64_t r = 0; r < num_x; r += MAX_ROWS) {
            int64_t nr = num_x - r < MAX_ROWS ? num_x - r : MAX_ROWS;
            q8_tile(type, w, row_bytes, cols, codes + r * cols, scale + r * nb, sums + r * nb, nr, out + r * rows, rows,
                    n0, n1);
        }
    }
    return 0;
}

/* Several matrices of one shape and type, each over its own run of activation rows, in one
 * parallel region (the chosen experts of a mixture-of-experts layer): matrix j (layout 8, at
 * w[j]) multiplies rows starts[j] .. starts[j + 1] of x [starts[n], cols] into the same rows of
 * out [starts[n], rows], the activations rounded to int8 blocks first. The threads share the
 * (matrix, group of eight rows) pairs of all matrices that have rows, so a decode step's few
 * rows per expert still keep every thread busy. */
int gguf_linear_q8_experts(int type, const uint8_t *const *w, int n, const int64_t *starts, int64_t rows, int64_t cols,
                           const float *x, float *out, int num_threads, uint8_t *scratch) {
    if (!lanes_type(type) || cols % 32 || rows % 8) return -1;
    int64_t nb = cols / 32, groups = rows / 8, num_x = starts[n];
    int8_t *codes = (int8_t *)scratch;
    float *scale = (float *)(scratch + ((num_x * cols + 15) & ~(int64_t)15));
    int32_t *sums = (int32_t *)(scale + num_x * nb);
    int nt = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        for (int64_t r = t; r < num_x; r += count)
            quantize_row(x + r * cols, cols, codes + r * cols, scale + r * nb, sums + r * nb);
#pragma omp barrier
        int64_t units = (int64_t)n * groups, u0 = units * t / count, u1 = units * (t + 1) / count;
        for (int64_t j = u0 / groups; j < n && j * groups < u1; j++) {
            int64_t g0 = u0 > j * groups ? u0 - j * groups : 0;
            int64_t g1 = u1 < (j + 1) * groups ? u1 - j * groups : groups;
            for (int64_t r = starts[j]; r < starts[j + 1]; r += LANE_ROWS) {
                int64_t nr = starts[j + 1] - r < LANE_ROWS ? starts[j + 1] - r : LANE_ROWS;
                lanes_q8(type, w[j], nb, codes + r * cols, scale + r * nb, sums + r * nb, cols, nr, out + r * rows, rows, g0, g1);
            }
        }
    }
    return 0;
}
