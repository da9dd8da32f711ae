/* Inline helpers shared by the AVX-512 files (fx_simd_avx512.c, fx_simd_avx512bf16.c).  Include it after the
 * file's own target pragma: the helpers compile with whatever instruction sets the including file enables. */
#ifndef FX_SIMD_AVX512_H
#define FX_SIMD_AVX512_H

#include <immintrin.h>

#define FX_INLINE static inline __attribute__((always_inline))

/* Horizontal sums of four vectors at once: [sum a, sum b, sum c, sum d]. */
FX_INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* lane: a02 b02 a13 b13 */
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Dispatch a head count to a compile-time R (1..8, or 1..4 for the 4-head tiles) so the accumulator arrays live in
 * registers. */
#define FX_SWITCH_R(rj, CALL)   \
    switch (rj) {               \
        case 1: CALL(1); break; \
        case 2: CALL(2); break; \
        case 3: CALL(3); break; \
        case 4: CALL(4); break; \
        case 5: CALL(5); break; \
        case 6: CALL(6); break; \
        case 7: CALL(7); break; \
        default: CALL(8); break; \
    }
#define FX_SWITCH_R4(rj, CALL)  \
    switch (rj) {               \
        case 1: CALL(1); break; \
        case 2: CALL(2); break; \
        case 3: CALL(3); break; \
        default: CALL(4); break; \
    }

#endif
