/* Vector helpers shared by the C kernels (AVX2, FMA, F16C). */
#ifndef SONAR_CPU_SIMD_H
#define SONAR_CPU_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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

/* eight int32 lanes of sum(u[i] * s[i]) for 32 unsigned bytes u and 32 signed bytes s */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* llama.cpp's 16 non-linear 4-bit values (IQ4_NL, IQ4_XS) in both 128-bit lanes, for a
 * byte shuffle from codes 0..15 */
static inline __m256i iq4_table(void) {
    const __m128i values = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    return _mm256_set_m128i(values, values);
}

/* the sum of eight int32 lanes */
static inline int32_t hsum_i32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_hadd_epi32(t, t);
    t = _mm_hadd_epi32(t, t);
    return _mm_cvtsi128_si32(t);
}

/* 32 activations as int8 codes, x ~ scale * codes[i] with scale = amax / 127 (returned);
 * sums16[0], sums16[1]: the sums of codes 0..15 and 16..31 */
static inline float quantize_block32(const float *x, int8_t *codes, int32_t sums16[2]) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float top = _mm_cvtss_f32(m);
    __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sums16[0] = hsum_i32(_mm256_add_epi32(q[0], q[1]));
    sums16[1] = hsum_i32(_mm256_add_epi32(q[2], q[3]));
    /* int32 -> int16 -> int8, then undo the lane interleaving of the two packs */
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)codes, bytes);
    return top / 127.0f;
}

#endif
