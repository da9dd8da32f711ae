/* q.k on bf16 K with AVX512-BF16 dot products (vdpbf16ps), for the FX_SIMD_AVX512_BF16 path.
 *
 * Why: at one thread the AVX-512 attention is compute-bound.  Its qk widens every 32 bf16 keys to two fp32 vectors
 * (a shift and a mask) and spends two FMAs per head on them; vdpbf16ps takes the 32 bf16 keys as they are and does
 * the 32 multiply-adds of one head in one instruction (per fp32 lane: acc += q[2i]*k[2i] + q[2i+1]*k[2i+1]).
 *
 * Accuracy: the product of two bf16 values (8 significant bits each) is exact in fp32, and the sums are fp32, so
 * when every q element IS a bf16 value the scores are those of exact products, summed in another order than qk's
 * FMAs.  fluxion.c therefore runs this only after q_to_bf16 has found q exactly representable (a bf16 model's q
 * is; an fp32 model's generally is not, and then the plain qk runs).  vdpbf16ps treats denormal inputs as zero, so
 * q_to_bf16 also refuses denormal q elements; a denormal key (below 1.2e-38) contributes 0 instead of a product
 * below 1.2e-38 * |q|.
 *
 * Compiled with the same flags as every other file: the target pragma enables AVX512-BF16 for this file only, and
 * fluxion.c reaches it only when the CPU reports the extension (fx_simd_supported(FX_SIMD_AVX512_BF16)). */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,avx2"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,avx2")
#endif

#include <immintrin.h>
#include "fx_internal.h"
#include "fx_simd_avx512.h"

int fx_q_to_bf16_avx512bf16(const float *q, int n, uint16_t *qb) {
    const __m512i low = _mm512_set1_epi32(0xFFFF), expo = _mm512_set1_epi32(0x7F800000),
                  magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    for (int i = 0; i < n; i += 16) { /* n = r * D, a multiple of 16 */
        __m512i x = _mm512_loadu_si512((const void *)(q + i));
        /* a bf16 value is an fp32 value whose low 16 bits are zero; a denormal has a zero exponent field and a
         * nonzero magnitude */
        __mmask16 inexact = _mm512_test_epi32_mask(x, low);
        __mmask16 denormal = _mm512_testn_epi32_mask(x, expo) & _mm512_test_epi32_mask(x, magnitude);
        if (inexact | denormal) return 0; /* an fp32 model's q fails on its first elements: stop there */
        _mm256_storeu_si256((__m256i *)(qb + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
    }
    return 1;
}

/* 32 bf16 values of a row from its element c; in the last chunk of a head_dim % 32 == 16 (half != 0) only 16,
 * zero-extended: the zero lanes of q and K add 0 * 0. */
FX_INLINE __m512bh row_chunk(const uint16_t *p, int half) {
    __m512i x = half ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p))
                     : _mm512_loadu_si512((const void *)p);
    return (__m512bh)x;
}

/* R (<= 4) heads x 4 tokens per step, as qk_tile in fx_simd_avx512.c: each chunk of K is loaded once and feeds R
 * dot products, the 4R sums stay in registers and are reduced four at a time.  One prefetch step per (4 tokens,
 * chunk), and one per chunk for the leftover tokens together. */
FX_INLINE void qk_dot_tile(const uint16_t *qb, int R, const uint16_t *k, int len, int d, float scale, float *s,
                           int ld, pf_cursor *pc) {
    const __m128 sc = _mm_set1_ps(scale);
    int t = 0;
    for (; t + 4 <= len; t += 4) {
        __m512 acc[4][4];
        for (int j = 0; j < R; j++)
            for (int u = 0; u < 4; u++) acc[j][u] = _mm512_setzero_ps();
        for (int c = 0; c < d; c += 32) {
            int half = d - c < 32;
            pfc_step(pc);
            __m512bh kc[4];
            for (int u = 0; u < 4; u++) kc[u] = row_chunk(k + (int64_t)(t + u) * d + c, half);
            for (int j = 0; j < R; j++) {
                __m512bh qc = row_chunk(qb + j * d + c, half);
                for (int u = 0; u < 4; u++) acc[j][u] = _mm512_dpbf16_ps(acc[j][u], qc, kc[u]);
            }
        }
        for (int j = 0; j < R; j++)
            _mm_storeu_ps(s + j * ld + t, _mm_mul_ps(sc, reduce4(acc[j][0], acc[j][1], acc[j][2], acc[j][3])));
    }
    if (t < len)
        for (int c = 0; c < d; c += 32) pfc_step(pc);
    for (; t < len; t++) {
        __m512 acc[4];
        for (int j = 0; j < R; j++) acc[j] = _mm512_setzero_ps();
        for (int c = 0; c < d; c += 32) {
            int half = d - c < 32;
            __m512bh kc = row_chunk(k + (int64_t)t * d + c, half);
            for (int j = 0; j < R; j++) acc[j] = _mm512_dpbf16_ps(acc[j], row_chunk(qb + j * d + c, half), kc);
        }
        for (int j = 0; j < R; j++) s[j * ld + t] = _mm512_reduce_add_ps(acc[j]) * scale;
    }
}

void fx_qk_bf16_avx512bf16(const uint16_t *qb, int r, const uint16_t *k, int len, int d, float scale, float *s,
                           int ld, const void *pf, int64_t pf_lines) {
    /* the prefetch spreads over every pass of up to 4 heads */
    pf_cursor pc = pfc_init(pf, pf_lines, (int64_t)((r + 3) / 4) * ((len + 3) / 4) * ((d + 31) / 32));
    for (int j0 = 0; j0 < r; j0 += 4) {
        int rj = r - j0 < 4 ? r - j0 : 4;
#define QK_DOT_TILE(R) qk_dot_tile(qb + j0 * d, R, k, len, d, scale, s + j0 * ld, ld, &pc)
        FX_SWITCH_R4(rj, QK_DOT_TILE)
#undef QK_DOT_TILE
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
