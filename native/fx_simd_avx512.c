/* AVX-512 kernels (F + BW + VL + DQ).  Compiled with the same flags as every other file: the target pragma below
 * enables the instructions for this file only, and fluxion.c calls in here only when the CPU reports them.
 * bf16 -> fp32 is an exact 16-bit shift and fp16 -> fp32 is vcvtph2ps (AVX-512F); the AVX512-BF16/FP16
 * extensions only add narrowing conversions and low-precision dot products, which fp32 accumulation does not
 * want, so they are not used. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")
#endif

#include <immintrin.h>
#include "fx_internal.h"

#define FX_INLINE static inline __attribute__((always_inline))

FX_INLINE __m512 load16(const uint16_t *p, int bf16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* R query heads against one K row at a time; R is a compile-time constant so acc[] stays in registers. */
FX_INLINE void qk_group(const float *q, int R, const uint16_t *k, int len, int d, int bf16, float scale, float *s,
                        int ld) {
    for (int t = 0; t < len; t++) {
        const uint16_t *kt = k + (int64_t)t * d;
        __m512 acc[8];
        for (int j = 0; j < R; j++) acc[j] = _mm512_setzero_ps();
        for (int e = 0; e < d; e += 16) {
            __m512 kv = load16(kt + e, bf16);
            for (int j = 0; j < R; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + e), kv, acc[j]);
        }
        for (int j = 0; j < R; j++) s[j * ld + t] = _mm512_reduce_add_ps(acc[j]) * scale;
    }
}

static void qk_avx512(const float *q, int r, const uint16_t *k, int len, int d, int bf16, float scale, float *s,
                      int ld) {
    for (int j0 = 0; j0 < r; j0 += 8) {
        int rj = r - j0 < 8 ? r - j0 : 8;
        const float *qj = q + (int64_t)j0 * d;
        float *sj = s + j0 * ld;
        switch (rj) {
            case 1: qk_group(qj, 1, k, len, d, bf16, scale, sj, ld); break;
            case 2: qk_group(qj, 2, k, len, d, bf16, scale, sj, ld); break;
            case 3: qk_group(qj, 3, k, len, d, bf16, scale, sj, ld); break;
            case 4: qk_group(qj, 4, k, len, d, bf16, scale, sj, ld); break;
            case 5: qk_group(qj, 5, k, len, d, bf16, scale, sj, ld); break;
            case 6: qk_group(qj, 6, k, len, d, bf16, scale, sj, ld); break;
            case 7: qk_group(qj, 7, k, len, d, bf16, scale, sj, ld); break;
            default: qk_group(qj, 8, k, len, d, bf16, scale, sj, ld); break;
        }
    }
}

/* One 16-wide column strip of V at a time: the R accumulators for that strip stay in registers over all tokens. */
FX_INLINE void pv_group(const float *p, int R, int ld, const uint16_t *v, int len, int d, int bf16, float *acc) {
    for (int e = 0; e < d; e += 16) {
        __m512 a[8];
        for (int j = 0; j < R; j++) a[j] = _mm512_loadu_ps(acc + j * d + e);
        for (int t = 0; t < len; t++) {
            __m512 vv = load16(v + (int64_t)t * d + e, bf16);
            for (int j = 0; j < R; j++) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * ld + t]), vv, a[j]);
        }
        for (int j = 0; j < R; j++) _mm512_storeu_ps(acc + j * d + e, a[j]);
    }
}

static void pv_avx512(const float *p, int r, int ld, const uint16_t *v, int len, int d, int bf16, float *acc) {
    for (int j0 = 0; j0 < r; j0 += 8) {
        int rj = r - j0 < 8 ? r - j0 : 8;
        const float *pj = p + j0 * ld;
        float *aj = acc + (int64_t)j0 * d;
        switch (rj) {
            case 1: pv_group(pj, 1, ld, v, len, d, bf16, aj); break;
            case 2: pv_group(pj, 2, ld, v, len, d, bf16, aj); break;
            case 3: pv_group(pj, 3, ld, v, len, d, bf16, aj); break;
            case 4: pv_group(pj, 4, ld, v, len, d, bf16, aj); break;
            case 5: pv_group(pj, 5, ld, v, len, d, bf16, aj); break;
            case 6: pv_group(pj, 6, ld, v, len, d, bf16, aj); break;
            case 7: pv_group(pj, 7, ld, v, len, d, bf16, aj); break;
            default: pv_group(pj, 8, ld, v, len, d, bf16, aj); break;
        }
    }
}

/* exp(x) for x <= 0: x = n*ln2 + f, |f| <= ln2/2, exp(f) by its degree-6 Taylor polynomial (relative error
 * ~1e-7), times 2^n by vscalefps.  Inputs below -87 give exactly 0. */
FX_INLINE __m512 exp_neg16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), f);
    __m512 y = _mm512_set1_ps(1.0f / 720.0f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f / 120.0f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f / 24.0f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f / 6.0f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.5f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
}

static void exp_neg_avx512(float *x, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp_neg16(_mm512_loadu_ps(x + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(x + i, m, exp_neg16(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

static void bound_avx512(const float *qpos, const float *qneg, const float *s, int n, int d, float *score) {
    for (int b = 0; b < n; b++) {
        const float *mn = s + (int64_t)b * 2 * d;
        const float *mx = mn + d;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int e = 0; e < d; e += 16) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qpos + e), _mm512_loadu_ps(mx + e), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qneg + e), _mm512_loadu_ps(mn + e), a1);
        }
        score[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

static void minmax_avx512(const uint16_t *k, int len, int d, int bf16, float *mn, float *mx, int init) {
    for (int e = 0; e < d; e += 16) {
        int t = 0;
        __m512 lo, hi;
        if (init) {
            lo = hi = load16(k + e, bf16);
            t = 1;
        } else {
            lo = _mm512_loadu_ps(mn + e);
            hi = _mm512_loadu_ps(mx + e);
        }
        for (; t < len; t++) {
            __m512 kv = load16(k + (int64_t)t * d + e, bf16);
            lo = _mm512_min_ps(lo, kv);
            hi = _mm512_max_ps(hi, kv);
        }
        _mm512_storeu_ps(mn + e, lo);
        _mm512_storeu_ps(mx + e, hi);
    }
}

const fx_kernels fx_kernels_avx512 = {
    "avx512", qk_avx512, pv_avx512, exp_neg_avx512, bound_avx512, minmax_avx512,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
