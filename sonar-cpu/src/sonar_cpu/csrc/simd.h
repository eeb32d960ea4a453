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

#endif
