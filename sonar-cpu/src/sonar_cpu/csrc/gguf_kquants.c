/* GGUF K-quant products: out[r, n] = sum_k x[r, k] * w[n, k] for weights stored as llama.cpp's
 * Q2_K / Q3_K / Q4_K / Q5_K / Q6_K super-blocks of 256 values, eight weight rows to a vector
 * (layout 8).
 *
 * A super-block of one row holds eight groups of 32 values (Q4_K, Q5_K: w = d sc q - dmin m,
 * q in 0..15 or 0..31, a 6-bit scale sc and minimum m per group) or sixteen of 16 (Q6_K:
 * w = d sc (q - 32), q in 0..63, an int8 scale per group; Q3_K: w = d sc (q - 4), q in 0..7, a
 * 6-bit signed scale; Q2_K: w = d sc q - dmin m, q in 0..3, a 4-bit scale and minimum).
 * sonar_cpu.gguf_kernel lays a layer's rows out at load, per group of eight rows and per
 * super-block, as
 *   Q4_K: [8 fp16 d][8 fp16 dmin][sc: 8 groups x 8 rows, u8][m: 8 x 8, u8][qs]
 *   Q5_K: the same, with [qh] before [qs]
 *   Q6_K: [8 fp16 d][sc: 16 groups x 8 rows, i8][half 0: ql 0..31, ql 32..63, qh][half 1: ...]
 *   Q3_K: [8 fp16 d][sc - 32: 16 x 8, i8][hmask][qs]
 *   Q2_K: [8 fp16 d][8 fp16 dmin][sc | m << 4: 16 x 8, u8][qs]
 *   IQ4_XS: [8 fp16 d][sc - 32: 8 groups x 8 rows, i8][qs] (w = d sc t[q], t llama.cpp's table of
 *     16 signed values; qs 16 bytes a group: low nibbles its values 0..15, high ones 16..31)
 * where every run of codes is a vector of 32 bytes per chunk c, holding in 32-bit lane j the
 * four bytes 4c .. 4c + 3 of row j's run (Q4_K's and Q5_K's qs in four runs of 32 bytes, one per
 * pair of groups: low nibbles the first group, high nibbles the second; Q5_K's qh one run of 32,
 * bit v the fifth bit of group v; Q6_K's ql runs low nibbles then high ones, its qh two bits per
 * group; Q3_K's hmask one run of 32, bit v the third bit of group v; Q2_K's and Q3_K's qs two
 * runs of 32, one per half, two bits per group). The 6-bit scales and minimums are unpacked at
 * load; everything else is the file's bytes in another order.
 *
 * Two products, as for the 32-value formats (gguf_gemm.c):
 * - exact: float32 activations, the codes decoded to floats in registers; equal to the float
 *   product of the dequantized weights up to float32 summation order;
 * - int8: the activations rounded first to int8 codes in blocks of 32 (a scale per block,
 *   amax / 127; llama.cpp rounds them in blocks of 256 for these types, which loses more), then
 *   integer dot products of four codes per lane, scaled per group of 32 values. */
#include <omp.h>

#include "simd.h"

enum { Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23, QK = 256, K_ROWS = 4 };

static inline int64_t k_group_bytes(int type) {
    return type == Q2_K ? 672 : type == Q3_K ? 912 : type == Q4_K ? 1184 : type == Q5_K ? 1440 : type == Q6_K ? 1680
         : type == IQ4_XS ? 1104 : 0;
}

/* the types whose groups of 16 values carry their own scale */
static inline int sixteens(int type) { return type == Q2_K || type == Q3_K || type == Q6_K; }
/* what the codes of a signed type are offset by: w = d sc (q - offset) */
static inline int code_offset(int type) { return type == Q6_K ? 32 : type == Q3_K ? 4 : 0; }

/* the super-block's dmin for the eight rows (the types with minimums: Q2_K, Q4_K, Q5_K), else 0 */
static inline __m256 k_dmin(int type, const uint8_t *sb) {
    if (type == Q2_K || type == Q4_K || type == Q5_K) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16)));
    return _mm256_setzero_ps();
}

/* the eight operands of group of 32 values v (0..7) of a super-block of eight rows: operand c
 * holds, in lane j, the unsigned codes of values 32 v + 4 c .. 32 v + 4 c + 3 of row j */
static inline void k_operands(int type, const uint8_t *sb, int v, __m256i op[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (type == IQ4_XS) {  /* signed values from the table */
        const uint8_t *qs = sb + 80 + v * 128;
        const __m256i table = iq4_table();
        for (int c = 0; c < 4; c++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            op[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(packed, low));
            op[c + 4] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(packed, 4), low));
        }
        return;
    }
    if (type == Q2_K || type == Q3_K) {  /* two bits per value, at bit 2 (v % 4) of the half's qs */
        const uint8_t *qs = sb + (type == Q2_K ? 160 : 400) + (v / 4) * 256;
        const __m256i two = _mm256_set1_epi8(0x03);
        for (int c = 0; c < 8; c++)
            op[c] = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)), 2 * (v % 4)), two);
        if (type == Q3_K) {  /* the third bit: bit v of hmask */
            const __m256i bit = _mm256_set1_epi8((char)(1 << v)), third = _mm256_set1_epi8(0x04);
            for (int c = 0; c < 8; c++) {
                __m256i hm = _mm256_loadu_si256((const __m256i *)(sb + 144 + 32 * c));
                op[c] = _mm256_or_si256(op[c], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), third));
            }
        }
        return;
    }
    if (type == Q6_K) {
        const uint8_t *half = sb + 144 + (v / 4) * 768;
        int k = v % 4;  /* ql 0..31 (k 0, 2) or 32..63 (k 1, 3); low nibbles (k < 2) or high */
        const uint8_t *ql = half + (k & 1) * 256, *qh = half + 512;
        const __m256i two_bits = _mm256_set1_epi8(0x30);
        for (int c = 0; c < 8; c++) {
            __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 32 * c));
            __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * c));
            __m256i nibble = _mm256_and_si256(k < 2 ? l : _mm256_srli_epi16(l, 4), low);
            /* bits 2k, 2k + 1 of the qh byte to bits 4, 5 (16-bit shifts: the mask drops what
             * crosses from the neighbouring byte) */
            __m256i high = k == 0 ? _mm256_slli_epi16(h, 4) : k == 1 ? _mm256_slli_epi16(h, 2)
                         : k == 2 ? h : _mm256_srli_epi16(h, 2);
            op[c] = _mm256_or_si256(nibble, _mm256_and_si256(high, two_bits));
        }
        return;
    }
    const uint8_t *qs = sb + (type == Q5_K ? 416 : 160) + (v / 2) * 256;
    for (int c = 0; c < 8; c++) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        op[c] = _mm256_and_si256(v & 1 ? _mm256_srli_epi16(packed, 4) : packed, low);
    }
    if (type == Q5_K) {
        const __m256i bit = _mm256_set1_epi8((char)(1 << v)), fifth = _mm256_set1_epi8(0x10);
        for (int c = 0; c < 8; c++) {
            __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 160 + 32 * c));
            __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            op[c] = _mm256_or_si256(op[c], _mm256_and_si256(set, fifth));
        }
    }
}

/* eight rows' integer dots of operands [c0, c0 + n) against four activation codes each */
static inline __m256i k_dot(const __m256i op[8], const int8_t *xq, int c0, int n) {
    __m256i total = _mm256_setzero_si256();
    for (int c = c0; c < c0 + n; c++)
        total = _mm256_add_epi32(total, dot_u8_s8(op[c], _mm256_set1_epi32(*(const int32_t *)(xq + 4 * c))));
    return total;
}

/* the same for signed operands (their signs moved onto the activations) */
static inline __m256i k_dot_signed(const __m256i op[8], const int8_t *xq) {
    __m256i total = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        __m256i x4 = _mm256_set1_epi32(*(const int32_t *)(xq + 4 * c));
        total = _mm256_add_epi32(total, dot_u8_s8(_mm256_sign_epi8(op[c], op[c]), _mm256_sign_epi8(x4, op[c])));
    }
    return total;
}

static inline __m256i scales_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i scales_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* int8 activation rows [0, nr) (nr <= K_ROWS) against row groups [g0, g1): codes [nr, cols],
 * scale [nr, cols / 32], sums [nr, cols / 16] (the codes' sums per 16) */
static void k_lanes_q8(int type, const uint8_t *w, int64_t nsb, const int8_t *codes, const float *scale,
                       const int32_t *sums, int64_t cols, int64_t nr, float *out, int64_t out_stride, int64_t g0,
                       int64_t g1) {
    int64_t gb = k_group_bytes(type), n16 = cols / 16, n32 = cols / 32;
    for (int64_t g = g0; g < g1; g++) {
        __m256 acc[K_ROWS];
        for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
        const uint8_t *group = w + g * nsb * gb;
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *sb = group + b * gb;
            _mm_prefetch((const char *)sb + gb, _MM_HINT_T0);
            _mm_prefetch((const char *)sb + gb + 512, _MM_HINT_T0);
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
            __m256 dmin = k_dmin(type, sb);
            for (int v = 0; v < 8; v++) {
                __m256i op[8];
                k_operands(type, sb, v, op);
                if (type == IQ4_XS) {  /* d sc t[q] per 32 values */
                    __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scales_i8(sb + 16 + 8 * v)));
                    for (int r = 0; r < nr; r++) {
                        const int8_t *xq = codes + r * cols + b * QK + 32 * v;
                        __m256 dx = _mm256_set1_ps(scale[r * n32 + b * 8 + v]);
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dsc, dx), _mm256_cvtepi32_ps(k_dot_signed(op, xq)), acc[r]);
                    }
                } else if (type == Q2_K) {  /* d sc q - dmin m per 16 values: sc and m are a byte's two nibbles */
                    __m256i p0 = scales_u8(sb + 32 + 16 * v), p1 = scales_u8(sb + 40 + 16 * v);
                    const __m256i nibble = _mm256_set1_epi32(0x0F);
                    __m256i s0 = _mm256_and_si256(p0, nibble), s1 = _mm256_and_si256(p1, nibble);
                    __m256i m0 = _mm256_srli_epi32(p0, 4), m1 = _mm256_srli_epi32(p1, 4);
                    for (int r = 0; r < nr; r++) {
                        const int8_t *xq = codes + r * cols + b * QK + 32 * v;
                        const int32_t *xs = sums + r * n16 + b * 16 + 2 * v;
                        __m256i total = _mm256_add_epi32(_mm256_mullo_epi32(k_dot(op, xq, 0, 4), s0), _mm256_mullo_epi32(k_dot(op, xq, 4, 4), s1));
                        __m256i mins = _mm256_add_epi32(_mm256_mullo_epi32(m0, _mm256_set1_epi32(xs[0])), _mm256_mullo_epi32(m1, _mm256_set1_epi32(xs[1])));
                        __m256 dx = _mm256_set1_ps(scale[r * n32 + b * 8 + v]);
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(total), acc[r]);
                        acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins), acc[r]);
                    }
                } else if (sixteens(type)) {  /* sc (q - offset) x: the offset comes off as offset sum(x) per 16 values */
                    __m256i s0 = scales_i8(sb + 16 + 16 * v), s1 = scales_i8(sb + 24 + 16 * v);
                    int offset = code_offset(type);
                    for (int r = 0; r < nr; r++) {
                        const int8_t *xq = codes + r * cols + b * QK + 32 * v;
                        const int32_t *xs = sums + r * n16 + b * 16 + 2 * v;
                        __m256i lo = _mm256_sub_epi32(k_dot(op, xq, 0, 4), _mm256_set1_epi32(offset * xs[0]));
                        __m256i hi = _mm256_sub_epi32(k_dot(op, xq, 4, 4), _mm256_set1_epi32(offset * xs[1]));
                        __m256i total = _mm256_add_epi32(_mm256_mullo_epi32(lo, s0), _mm256_mullo_epi32(hi, s1));
                        __m256 dx = _mm256_set1_ps(scale[r * n32 + b * 8 + v]);
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(total), acc[r]);
                    }
                } else {
                    __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scales_u8(sb + 32 + 8 * v)));
                    __m256 dm = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(scales_u8(sb + 96 + 8 * v)));
                    for (int r = 0; r < nr; r++) {
                        const int8_t *xq = codes + r * cols + b * QK + 32 * v;
                        const int32_t *xs = sums + r * n16 + b * 16 + 2 * v;
                        float dx = scale[r * n32 + b * 8 + v];
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dsc, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(k_dot(op, xq, 0, 8)), acc[r]);
                        acc[r] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(dx * (float)(xs[0] + xs[1])), acc[r]);
                    }
                }
            }
        }
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + r * out_stride + g * 8, acc[r]);
    }
}

/* float activation rows [0, nr) (nr <= K_ROWS) against row groups [g0, g1), exact up to
 * summation order: per group of values, (d sc) sum(q x) - (dmin m) sum(x), or for Q6_K
 * (d sc) sum((q - 32) x), with the codes as floats; xsums [nr, cols / 16] */
static void k_lanes_exact(int type, const uint8_t *w, int64_t nsb, const float *x, const float *xsums, int64_t cols,
                          int64_t nr, float *out, int64_t out_stride, int64_t g0, int64_t g1) {
    int64_t gb = k_group_bytes(type), n16 = cols / 16;
    const __m256i byte = _mm256_set1_epi32(0xFF);
    const __m256 offset = _mm256_set1_ps((float)code_offset(type));
    for (int64_t g = g0; g < g1; g++) {
        __m256 acc[K_ROWS];
        for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
        const uint8_t *group = w + g * nsb * gb;
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *sb = group + b * gb;
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
            __m256 dmin = k_dmin(type, sb);
            for (int v = 0; v < 8; v++) {
                __m256i op[8];
                k_operands(type, sb, v, op);
                __m256 part[K_ROWS][2];  /* per row: values 0..15 and 16..31 of the group */
                for (int r = 0; r < nr; r++) part[r][0] = part[r][1] = _mm256_setzero_ps();
                for (int c = 0; c < 8; c++) {
                    for (int i = 0; i < 4; i++) {
                        __m256 wq = type == IQ4_XS ? _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(op[c], 24 - 8 * i), 24))
                                  : _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(op[c], 8 * i), byte)), offset);
                        for (int r = 0; r < nr; r++)
                            part[r][c / 4] = _mm256_fmadd_ps(wq, _mm256_set1_ps(x[r * cols + b * QK + 32 * v + 4 * c + i]), part[r][c / 4]);
                    }
                }
                if (type == IQ4_XS) {
                    __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scales_i8(sb + 16 + 8 * v)));
                    for (int r = 0; r < nr; r++) acc[r] = _mm256_fmadd_ps(dsc, _mm256_add_ps(part[r][0], part[r][1]), acc[r]);
                } else if (type == Q2_K) {
                    __m256i p0 = scales_u8(sb + 32 + 16 * v), p1 = scales_u8(sb + 40 + 16 * v);
                    const __m256i nibble = _mm256_set1_epi32(0x0F);
                    __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(p0, nibble)));
                    __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(p1, nibble)));
                    __m256 m0 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(p0, 4)));
                    __m256 m1 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(p1, 4)));
                    for (int r = 0; r < nr; r++) {
                        const float *xs = xsums + r * n16 + b * 16 + 2 * v;
                        acc[r] = _mm256_fmadd_ps(s0, part[r][0], acc[r]);
                        acc[r] = _mm256_fmadd_ps(s1, part[r][1], acc[r]);
                        acc[r] = _mm256_fnmadd_ps(m0, _mm256_set1_ps(xs[0]), acc[r]);
                        acc[r] = _mm256_fnmadd_ps(m1, _mm256_set1_ps(xs[1]), acc[r]);
                    }
                } else if (sixteens(type)) {
                    __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scales_i8(sb + 16 + 16 * v)));
                    __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scales_i8(sb + 24 + 16 * v)));
                    for (int r = 0; r < nr; r++) {
                        acc[r] = _mm256_fmadd_ps(s0, part[r][0], acc[r]);
                        acc[r] = _mm256_fmadd_ps(s1, part[r][1], acc[r]);
                    }
                } else {
                    __m256 sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scales_u8(sb + 32 + 8 * v)));
                    __m256 m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(scales_u8(sb + 96 + 8 * v)));
                    for (int r = 0; r < nr; r++) {
                        const float *xs = xsums + r * n16 + b * 16 + 2 * v;
                        acc[r] = _mm256_fmadd_ps(sc, _mm256_add_ps(part[r][0], part[r][1]), acc[r]);
                        acc[r] = _mm256_fnmadd_ps(m, _mm256_set1_ps(xs[0] + xs[1]), acc[r]);
                    }
                }
            }
        }
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + r * out_stride + g * 8, acc[r]);
    }
}

/* one activation row as int8 codes in blocks of 32: x ~ scale[j] * codes[32 j + i] (scale
 * amax / 127); sums[j] = sum of codes 16 j .. 16 j + 15 */
static void k_quantize_row(const float *x, int64_t cols, int8_t *codes, float *scale, int32_t *sums) {
    for (int64_t j = 0; j < cols / 32; j++) scale[j] = quantize_block32(x + 32 * j, codes + 32 * j, sums + 2 * j);
}

/* sums of 16 floats at a time: out[j] = x[16 j] + ... + x[16 j + 15] */
static void k_float_sums(const float *x, int64_t cols, float *out) {
    for (int64_t j = 0; j < cols / 16; j++)
        out[j] = hsum(_mm256_add_ps(_mm256_loadu_ps(x + 16 * j), _mm256_loadu_ps(x + 16 * j + 8)));
}

/* bytes of scratch the K-quant products need for num_x rows of cols activations */
int64_t gguf_k_scratch_bytes(int64_t cols, int64_t num_x) {
    return num_x * (cols + cols / 32 * (int64_t)sizeof(float) + cols / 16 * (int64_t)sizeof(int32_t)) + 64;
}

static inline int k_shape_ok(int type, int64_t rows, int64_t cols) {
    return k_group_bytes(type) && cols % QK == 0 && rows % 8 == 0;
}

/* the activations' codes (int8) or float sums per 16 (exact) for rows [t, num_x) step count */
static void k_prepare_rows(const float *x, int64_t cols, int64_t num_x, int t, int count, int exact, uint8_t *scratch) {
    int8_t *codes = (int8_t *)scratch;
    float *scale = (float *)(scratch + ((num_x * cols + 31) & ~(int64_t)31));
    int32_t *sums = (int32_t *)(scale + num_x * (cols / 32));
    for (int64_t r = t; r < num_x; r += count) {
        if (exact)
            k_float_sums(x + r * cols, cols, (float *)sums + r * (cols / 16));
        else
            k_quantize_row(x + r * cols, cols, codes + r * cols, scale + r * (cols / 32), sums + r * (cols / 16));
    }
}

/* rows [r0, r1) of the activations against row groups [g0, g1) of one matrix */
static void k_rows(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t num_x, int64_t r0,
                   int64_t r1, float *out, const uint8_t *scratch, int exact, int64_t g0, int64_t g1) {
    int64_t nsb = cols / QK;
    const int8_t *codes = (const int8_t *)scratch;
    const float *scale = (const float *)(scratch + ((num_x * cols + 31) & ~(int64_t)31));
    const int32_t *sums = (const int32_t *)(scale + num_x * (cols / 32));
    for (int64_t r = r0; r < r1; r += K_ROWS) {
        int64_t nr = r1 - r < K_ROWS ? r1 - r : K_ROWS;
        if (exact)
            k_lanes_exact(type, w, nsb, x + r * cols, (const float *)sums + r * (cols / 16), cols, nr, out + r * rows, rows, g0, g1);
        else
            k_lanes_q8(type, w, nsb, codes + r * cols, scale + r * (cols / 32), sums + r * (cols / 16), cols, nr, out + r * rows,
                       rows, g0, g1);
    }
}

/* out [num_x, rows] = x [num_x, cols] @ w.T for w in layout 8 (rows a multiple of 8, cols of
 * 256); exact: float32 activations, else int8 ones in `scratch` (gguf_k_scratch_bytes of it) */
int gguf_k_linear(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t num_x, float *out,
                  int num_threads, uint8_t *scratch, int exact) {
    if (!k_shape_ok(type, rows, cols)) return -1;
    int64_t groups = rows / 8;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > groups) nt = (int)groups;
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        k_prepare_rows(x, cols, num_x, t, count, exact, scratch);
#pragma omp barrier
        k_rows(type, w, rows, cols, x, num_x, 0, num_x, out, scratch, exact, groups * t / count, groups * (t + 1) / count);
    }
    return 0;
}

/* Several matrices of one shape and type (a mixture-of-experts layer's chosen experts), each
 * over its own run of activation rows, in one parallel region: matrix j (layout 8, at w[j])
 * multiplies rows starts[j] .. starts[j + 1] of x into the same rows of out [starts[n], rows],
 * the activations rounded to int8 first; the threads share the (matrix, group of eight rows)
 * pairs of all the matrices. */
int gguf_k_linear_experts(int type, const uint8_t *const *w, int n, const int64_t *starts, int64_t rows, int64_t cols,
                          const float *x, float *out, int num_threads, uint8_t *scratch) {
    if (!k_shape_ok(type, rows, cols)) return -1;
    int64_t groups = rows / 8, num_x = starts[n];
    int nt = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        k_prepare_rows(x, cols, num_x, t, count, 0, scratch);
#pragma omp barrier
        int64_t units = (int64_t)n * groups, u0 = units * t / count, u1 = units * (t + 1) / count;
        for (int64_t j = u0 / groups; j < n && j * groups < u1; j++) {
            int64_t g0 = u0 > j * groups ? u0 - j * groups : 0;
            int64_t g1 = u1 < (j + 1) * groups ? u1 - j * groups : groups;
            k_rows(type, w[j], rows, cols, x, num_x, starts[j], starts[j + 1], out, scratch, 0, g0, g1);
        }
    }
    return 0;
}
