/* AVX-512 kernels (F + BW + VL + DQ).  Compiled with the same flags as every other file: the target pragma below
 * enables the instructions for this file only, and fluxion.c calls in here only when the CPU reports them.
 * bf16 -> fp32 is an exact 16-bit shift and fp16 -> fp32 is vcvtph2ps (AVX-512F).  AVX512-BF16 dot products are
 * used by q.k only, on the FX_SIMD_AVX512_BF16 path (fx_simd_avx512bf16.c), when q is exactly bf16. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")
#endif

#include <immintrin.h>
#include <math.h>
#include <string.h>
#include "fx_internal.h"
#include "fx_simd_avx512.h"

FX_INLINE __m512 load16(const uint16_t *p, int bf16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* ---- 32-element chunks (head_dim % 32 == 0), the fast path ----
 * A 64-byte row chunk becomes two fp32 vectors without any cross-lane shuffle: bf16 gives the even and the odd
 * elements (a shift and a mask of the same 512 bits); fp16 gives the first and the second 16 elements.  Dot
 * products do not care about element order as long as q (and the V accumulators) are split the same way. */
FX_INLINE void load32(const uint16_t *p, int bf16, __m512 *a, __m512 *b) {
    if (bf16) {
        __m512i x = _mm512_loadu_si512((const void *)p);
        *a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else {
        *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        *b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16)));
    }
}

/* The same split for 32 fp32 values, and its inverse. */
FX_INLINE void split32(const float *x, int bf16, __m512 *a, __m512 *b) {
    __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    if (bf16) {
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        *a = _mm512_permutex2var_ps(lo, even, hi);
        *b = _mm512_permutex2var_ps(lo, odd, hi);
    } else {
        *a = lo;
        *b = hi;
    }
}

FX_INLINE void merge32(float *x, int bf16, __m512 a, __m512 b) {
    if (bf16) {
        const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        _mm512_storeu_ps(x, _mm512_permutex2var_ps(a, lo, b));
        _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(a, hi, b));
    } else {
        _mm512_storeu_ps(x, a);
        _mm512_storeu_ps(x + 16, b);
    }
}

/* R (<= 4) heads x 4 tokens per step: each K chunk is converted once and feeds 2R FMAs; sums reduced 4 at a time. */
FX_INLINE void qk_tile(const float *qs, int R, const uint16_t *k, int len, int d, int bf16, float scale, float *s,
                       int ld, pf_cursor *pc) {
    const __m128 sc = _mm_set1_ps(scale);
    int t = 0;
    for (; t + 4 <= len; t += 4) {
        __m512 acc[4][4];
        for (int j = 0; j < R; j++)
            for (int u = 0; u < 4; u++) acc[j][u] = _mm512_setzero_ps();
        for (int c = 0; c < d; c += 32) {
            pfc_step(pc);
            __m512 ka[4], kb[4];
            for (int u = 0; u < 4; u++) load32(k + (int64_t)(t + u) * d + c, bf16, &ka[u], &kb[u]);
            for (int j = 0; j < R; j++) {
                __m512 qa = _mm512_load_ps(qs + j * d + c), qb = _mm512_load_ps(qs + j * d + c + 16);
                for (int u = 0; u < 4; u++) {
                    acc[j][u] = _mm512_fmadd_ps(qa, ka[u], acc[j][u]);
                    acc[j][u] = _mm512_fmadd_ps(qb, kb[u], acc[j][u]);
                }
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
            __m512 ka, kb;
            load32(k + (int64_t)t * d + c, bf16, &ka, &kb);
            for (int j = 0; j < R; j++) {
                acc[j] = _mm512_fmadd_ps(_mm512_load_ps(qs + j * d + c), ka, acc[j]);
                acc[j] = _mm512_fmadd_ps(_mm512_load_ps(qs + j * d + c + 16), kb, acc[j]);
            }
        }
        for (int j = 0; j < R; j++) s[j * ld + t] = _mm512_reduce_add_ps(acc[j]) * scale;
    }
}

/* R (<= 8) heads, one 32-wide column strip at a time: the 2R accumulators stay in registers over all tokens.
 * The next block's prefetch is spread over every (strip, token) step, not just the first strip: issuing all of it
 * within the first strip (a quarter of the work at D = 128) stalled on full miss buffers and left the memory
 * system idle for the rest of the block (12.5 -> 15.5 GB/s at D = 128, r = 4, 64-token blocks, 1 thread). */
FX_INLINE void pv_tile(const float *p, int R, int ld, const uint16_t *v, int len, int d, int bf16, float *acc,
                       pf_cursor *pc) {
    for (int c = 0; c < d; c += 32) {
        __m512 aa[8], ab[8];
        for (int j = 0; j < R; j++) split32(acc + j * d + c, bf16, &aa[j], &ab[j]);
        for (int t = 0; t < len; t++) {
            pfc_step(pc);
            __m512 va, vb;
            load32(v + (int64_t)t * d + c, bf16, &va, &vb);
            for (int j = 0; j < R; j++) {
                __m512 pj = _mm512_set1_ps(p[j * ld + t]);
                aa[j] = _mm512_fmadd_ps(pj, va, aa[j]);
                ab[j] = _mm512_fmadd_ps(pj, vb, ab[j]);
            }
        }
        for (int j = 0; j < R; j++) merge32(acc + j * d + c, bf16, aa[j], ab[j]);
    }
}

/* R (<= 4) heads, two 32-wide strips (64 columns) at a time: 4R accumulators in registers, and each broadcast of
 * p[j][t] and each pass of the loop's bookkeeping serves 4 FMAs instead of 2 (pv_tile's per-token overhead, about
 * a sixth of its time at r = 4, halves). */
FX_INLINE void pv_tile2(const float *p, int R, int ld, const uint16_t *v, int len, int d, int bf16, float *acc,
                        pf_cursor *pc) {
    for (int c = 0; c < d; c += 64) {
        __m512 a0[4], b0[4], a1[4], b1[4];
        for (int j = 0; j < R; j++) {
            split32(acc + j * d + c, bf16, &a0[j], &b0[j]);
            split32(acc + j * d + c + 32, bf16, &a1[j], &b1[j]);
        }
        for (int t = 0; t < len; t++) {
            pfc_step(pc);
            __m512 va0, vb0, va1, vb1;
            load32(v + (int64_t)t * d + c, bf16, &va0, &vb0);
            load32(v + (int64_t)t * d + c + 32, bf16, &va1, &vb1);
            for (int j = 0; j < R; j++) {
                __m512 pj = _mm512_set1_ps(p[j * ld + t]);
                a0[j] = _mm512_fmadd_ps(pj, va0, a0[j]);
                b0[j] = _mm512_fmadd_ps(pj, vb0, b0[j]);
                a1[j] = _mm512_fmadd_ps(pj, va1, a1[j]);
                b1[j] = _mm512_fmadd_ps(pj, vb1, b1[j]);
            }
        }
        for (int j = 0; j < R; j++) {
            merge32(acc + j * d + c, bf16, a0[j], b0[j]);
            merge32(acc + j * d + c + 32, bf16, a1[j], b1[j]);
        }
    }
}

/* ---- 16-element fallback (head_dim % 32 == 16) ---- */

FX_INLINE void qk_group(const float *q, int R, const uint16_t *k, int len, int d, int bf16, float scale, float *s,
                        int ld, pf_cursor *pc) {
    for (int t = 0; t < len; t++) {
        pfc_step(pc);
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

FX_INLINE void pv_group(const float *p, int R, int ld, const uint16_t *v, int len, int d, int bf16, float *acc,
                        pf_cursor *pc) {
    for (int e = 0; e < d; e += 16) {
        __m512 a[8];
        for (int j = 0; j < R; j++) a[j] = _mm512_loadu_ps(acc + j * d + e);
        for (int t = 0; t < len; t++) {
            pfc_step(pc);
            __m512 vv = load16(v + (int64_t)t * d + e, bf16);
            for (int j = 0; j < R; j++) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * ld + t]), vv, a[j]);
        }
        for (int j = 0; j < R; j++) _mm512_storeu_ps(acc + j * d + e, a[j]);
    }
}

static void qk_avx512(const float *q, int r, const uint16_t *k, int len, int d, int bf16, float scale, float *s,
                      int ld, const void *pf, int64_t pf_lines) {
    if (d % 32 == 0) {
        float qs[FX_MAX_GROUP * FX_MAX_DIM] __attribute__((aligned(64)));
        for (int j = 0; j < r; j++)
            for (int c = 0; c < d; c += 32) {
                __m512 a, b;
                split32(q + j * d + c, bf16, &a, &b);
                _mm512_store_ps(qs + j * d + c, a);
                _mm512_store_ps(qs + j * d + c + 16, b);
            }
        /* the prefetch spreads over every pass of up to 4 heads: one step per (4 tokens, 32-wide chunk) */
        pf_cursor pc = pfc_init(pf, pf_lines, (int64_t)((r + 3) / 4) * ((len + 3) / 4) * (d / 32));
        for (int j0 = 0; j0 < r; j0 += 4) {
            int rj = r - j0 < 4 ? r - j0 : 4;
#define QK_TILE(R) qk_tile(qs + j0 * d, R, k, len, d, bf16, scale, s + j0 * ld, ld, &pc)
            FX_SWITCH_R4(rj, QK_TILE)
#undef QK_TILE
        }
        return;
    }
    pf_cursor pc = pfc_init(pf, pf_lines, (int64_t)((r + 7) / 8) * len); /* one step per token of every pass */
    for (int j0 = 0; j0 < r; j0 += 8) {
        int rj = r - j0 < 8 ? r - j0 : 8;
#define QK_GROUP(R) \
    qk_group(q + (int64_t)j0 * d, R, k, len, d, bf16, scale, s + j0 * ld, ld, &pc)
        FX_SWITCH_R(rj, QK_GROUP)
#undef QK_GROUP
    }
}

static void pv_avx512(const float *p, int r, int ld, const uint16_t *v, int len, int d, int bf16, float *acc,
                      const void *pf, int64_t pf_lines) {
    if (d % 64 == 0 && r <= 4) { /* one pass, 64-wide strips: one prefetch step per (strip, token) */
        pf_cursor pc = pfc_init(pf, pf_lines, (int64_t)(d / 64) * len);
#define PV_TILE2(R) pv_tile2(p, R, ld, v, len, d, bf16, acc, &pc)
        FX_SWITCH_R4(r, PV_TILE2)
#undef PV_TILE2
        return;
    }
    /* one step per (strip, token) of every pass of up to 8 heads; strips are 32 wide (16 when d % 32 != 0) */
    pf_cursor pc = pfc_init(pf, pf_lines, (int64_t)((r + 7) / 8) * (d % 32 == 0 ? d / 32 : d / 16) * len);
    for (int j0 = 0; j0 < r; j0 += 8) {
        int rj = r - j0 < 8 ? r - j0 : 8;
        const float *pj = p + j0 * ld;
        float *aj = acc + (int64_t)j0 * d;
#define PV_TILE(R) pv_tile(pj, R, ld, v, len, d, bf16, aj, &pc)
#define PV_GROUP(R) pv_group(pj, R, ld, v, len, d, bf16, aj, &pc)
        if (d % 32 == 0) {
            FX_SWITCH_R(rj, PV_TILE)
        } else {
            FX_SWITCH_R(rj, PV_GROUP)
        }
#undef PV_TILE
#undef PV_GROUP
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

static float row_max_avx512(const float *x, int n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + i));
    }
    return _mm512_reduce_max_ps(m);
}

static float exp_sum_avx512(float *x, int n, float m) {
    __m512 mv = _mm512_set1_ps(m), acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
        _mm512_storeu_ps(x + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        __m512 e = _mm512_maskz_mov_ps(k, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
        _mm512_mask_storeu_ps(x + i, k, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

static void stage_copy_avx512(void *dst, const void *src, int64_t n, const void *pf, int64_t pf_lines) {
    char *d = dst;
    const char *s = src;
    if (((uintptr_t)d & 63) || (n & 63)) {
        fx_prefetch_share(pf, pf_lines, 0, 1);
        memcpy(dst, src, (size_t)n);
        return;
    }
    int64_t lines = n / 64;
    pf_cursor pc = pfc_init(pf, pf_lines, lines);
    for (int64_t l = 0; l < lines; l++) {
        pfc_step(&pc);
        _mm512_stream_si512((void *)(d + 64 * l), _mm512_loadu_si512((const void *)(s + 64 * l)));
    }
}

static void fence_avx512(void) { _mm_sfence(); }

/* 16 fp32 values that are 16-bit values -> 16-bit (exact: bf16 keeps the upper halves, vcvtps2ph rounds nothing) */
FX_INLINE void store16(uint16_t *p, __m512 v, int bf16) {
    __m256i h = bf16 ? _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16))
                     : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256((__m256i *)p, h);
}

/* Summaries are read once, in order, a run of up to a page of blocks per call: the scoring is ~10x faster than
 * memory, so the loop prefetches (towards L2) the lines FX_BOUND_AHEAD bytes ahead within the run; the hardware
 * prefetchers alone reached ~10 GB/s at 1 thread, this ~16 GB/s (measured with fp32 summaries; at 16 bits a block's
 * summary is half the bytes, so the same distance covers twice the blocks). */
#define FX_BOUND_AHEAD 4096
FX_INLINE void bound_body(const float *qpos, const float *qneg, const uint16_t *s, int n, int d, int bf16,
                          float *score) {
    const char *base = (const char *)s;
    const int64_t bb = (int64_t)2 * d * 2, end = (int64_t)n * bb;
    for (int b = 0; b < n; b++) {
        for (int64_t o = b * bb + FX_BOUND_AHEAD, e = o + bb < end ? o + bb : end; o < e; o += 64)
            __builtin_prefetch(base + o, 0, 2);
        const uint16_t *mn = s + (int64_t)b * 2 * d;
        const uint16_t *mx = mn + d;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int e = 0; e < d; e += 16) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qpos + e), load16(mx + e, bf16), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qneg + e), load16(mn + e, bf16), a1);
        }
        score[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

static void bound_avx512(const float *qpos, const float *qneg, const uint16_t *s, int n, int d, int bf16,
                         float *score) {
    if (bf16) bound_body(qpos, qneg, s, n, d, 1, score);
    else bound_body(qpos, qneg, s, n, d, 0, score);
}

static void minmax_avx512(const uint16_t *k, int len, int d, int bf16, uint16_t *mn, uint16_t *mx, int init) {
    for (int e = 0; e < d; e += 16) {
        int t = 0;
        __m512 lo, hi;
        if (init) {
            lo = hi = load16(k + e, bf16);
            t = 1;
        } else {
            lo = load16(mn + e, bf16);
            hi = load16(mx + e, bf16);
        }
        for (; t < len; t++) {
            __m512 kv = load16(k + (int64_t)t * d + e, bf16);
            lo = _mm512_min_ps(lo, kv);
            hi = _mm512_max_ps(hi, kv);
        }
        store16(mn + e, lo, bf16);
        store16(mx + e, hi, bf16);
    }
}

/* Horizontal sums of n (<= 16) vectors v[i] stored to out[i]: four at a time (missing ones zero). */
FX_INLINE void store_sums(const __m512 *v, int n, float *const *out) {
    const __m512 z = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 4) {
        float t[4];
        _mm_storeu_ps(t, reduce4(v[i], i + 1 < n ? v[i + 1] : z, i + 2 < n ? v[i + 2] : z, i + 3 < n ? v[i + 3] : z));
        for (int u = 0; u < 4 && i + u < n; u++) *out[i + u] = t[u];
    }
}

/* R (<= 8) heads' bounds of NB (1 or 2) consecutive blocks: per 16-wide chunk the min or the max by the sign mask of
 * q (precomputed per call), one FMA per head and block.  Two blocks share each q load and mask and give every head
 * two independent chains; a single block alternates two accumulators over its chunks instead.  Sums are reduced
 * four at a time (a lone horizontal sum costs about as much as four). */
FX_INLINE void bound_heads_blocks(const float *q, const __mmask16 *neg, int R, int NB, const uint16_t *mn, int d,
                                  int bf16, float *out, int64_t ld) {
    const int nc = d / 16; /* chunks; mask of head j, chunk c: neg[j * nc + c] */
    __m512 acc[2][8];
    for (int x = 0; x < 2; x++)
        for (int j = 0; j < R; j++) acc[x][j] = _mm512_setzero_ps();
    if (NB == 2) {
        const uint16_t *mx0 = mn + d, *mn1 = mn + 2 * d, *mx1 = mn + 3 * d;
        for (int c = 0; c < nc; c++) {
            __m512 lo0 = load16(mn + 16 * c, bf16), hi0 = load16(mx0 + 16 * c, bf16);
            __m512 lo1 = load16(mn1 + 16 * c, bf16), hi1 = load16(mx1 + 16 * c, bf16);
            for (int j = 0; j < R; j++) {
                __m512 qv = _mm512_loadu_ps(q + j * d + 16 * c);
                __mmask16 m = neg[j * nc + c];
                acc[0][j] = _mm512_fmadd_ps(qv, _mm512_mask_blend_ps(m, hi0, lo0), acc[0][j]);
                acc[1][j] = _mm512_fmadd_ps(qv, _mm512_mask_blend_ps(m, hi1, lo1), acc[1][j]);
            }
        }
    } else {
        const uint16_t *mx = mn + d;
        for (int c = 0; c < nc; c++) {
            __m512 lo = load16(mn + 16 * c, bf16), hi = load16(mx + 16 * c, bf16);
            for (int j = 0; j < R; j++)
                acc[c & 1][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + 16 * c),
                                                _mm512_mask_blend_ps(neg[j * nc + c], hi, lo), acc[c & 1][j]);
        }
        for (int j = 0; j < R; j++) acc[0][j] = _mm512_add_ps(acc[0][j], acc[1][j]);
    }
    __m512 v[16];
    float *o[16];
    int n = 0;
    for (int j = 0; j < R; j++)
        for (int x = 0; x < NB; x++) {
            v[n] = acc[x][j];
            o[n++] = out + j * ld + x;
        }
    store_sums(v, n, o);
}

/* Heads in even passes of at most 8 (r = 12: 6 + 6), blocks in pairs; every pass over the same blocks while in L1.
 * Each 16-bit summary chunk is widened (exactly) once per pass and serves all the pass's heads. */
FX_INLINE void bound_heads_body(const float *q, int r, const uint16_t *s, int n, int d, int bf16, float *out,
                                int64_t ld) {
    __mmask16 neg[FX_MAX_GROUP * FX_MAX_DIM / 16]; /* per head and chunk: lanes where q <= 0 take the min */
    for (int i = 0; i < r * d / 16; i++)
        neg[i] = _mm512_cmp_ps_mask(_mm512_loadu_ps(q + 16 * i), _mm512_setzero_ps(), _CMP_LE_OQ);
    const char *base = (const char *)s;
    const int64_t bb = (int64_t)2 * d * 2, end = (int64_t)n * bb;
    int passes = (r + 7) / 8, nc = d / 16;
    for (int b = 0; b < n; b += 2) {
        int nb = n - b < 2 ? 1 : 2;
        for (int64_t o = b * bb + FX_BOUND_AHEAD, e = o + nb * bb < end ? o + nb * bb : end; o < e; o += 64)
            __builtin_prefetch(base + o, 0, 2);
        const uint16_t *mn = s + (int64_t)b * 2 * d;
        for (int p = 0, j0 = 0; p < passes; p++) {
            int j1 = r * (p + 1) / passes;
            const float *qj = q + (int64_t)j0 * d;
            const __mmask16 *nj = neg + j0 * nc;
            float *o = out + j0 * ld + b;
#define FX_HEADS_CASE(R)                                                              \
    case R:                                                                           \
        if (nb == 2) bound_heads_blocks(qj, nj, R, 2, mn, d, bf16, o, ld);            \
        else bound_heads_blocks(qj, nj, R, 1, mn, d, bf16, o, ld);                    \
        break;
            switch (j1 - j0) {
                FX_HEADS_CASE(1)
                FX_HEADS_CASE(2)
                FX_HEADS_CASE(3)
                FX_HEADS_CASE(4)
                FX_HEADS_CASE(5)
                FX_HEADS_CASE(6)
                FX_HEADS_CASE(7)
                default: FX_HEADS_CASE(8)
            }
#undef FX_HEADS_CASE
            j0 = j1;
        }
    }
}

static void bound_heads_avx512(const float *q, int r, const uint16_t *s, int n, int d, int bf16, float *out,
                               int64_t ld) {
    if (bf16) bound_heads_body(q, r, s, n, d, 1, out, ld);
    else bound_heads_body(q, r, s, n, d, 0, out, ld);
}

static void gap_max_avx512(const float *x, int64_t ld, const float *m, int r, int n, float *score) {
    int b = 0;
    for (; b + 16 <= n; b += 16) {
        __m512 v = _mm512_sub_ps(_mm512_loadu_ps(x + b), _mm512_set1_ps(m[0]));
        for (int j = 1; j < r; j++)
            v = _mm512_max_ps(v, _mm512_sub_ps(_mm512_loadu_ps(x + j * ld + b), _mm512_set1_ps(m[j])));
        _mm512_storeu_ps(score + b, v);
    }
    if (b < n) {
        __mmask16 k = (__mmask16)((1u << (n - b)) - 1);
        __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + b), _mm512_set1_ps(m[0]));
        for (int j = 1; j < r; j++)
            v = _mm512_max_ps(v, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j * ld + b), _mm512_set1_ps(m[j])));
        _mm512_mask_storeu_ps(score + b, k, v);
    }
}

#include "fx_attn32_ymm.h"

const fx_kernels fx_kernels_avx512 = {
    "avx512", qk_avx512, pv_avx512, exp_neg_avx512, row_max_avx512, exp_sum_avx512, stage_copy_avx512,
    fence_avx512, bound_avx512, minmax_avx512, bound_heads_avx512, gap_max_avx512, NULL, NULL, a32_qk, a32_pv,
};

/* The same kernels plus q.k by bf16 dot products (fx_simd_avx512bf16.c, compiled for AVX512-BF16): fluxion.c
 * selects this table only when the CPU has that extension. */
const fx_kernels fx_kernels_avx512_bf16 = {
    "avx512bf16", qk_avx512, pv_avx512, exp_neg_avx512, row_max_avx512, exp_sum_avx512, stage_copy_avx512,
    fence_avx512, bound_avx512, minmax_avx512, bound_heads_avx512, gap_max_avx512, fx_qk_bf16_avx512bf16,
    fx_q_to_bf16_avx512bf16, a32_qk, a32_pv,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
