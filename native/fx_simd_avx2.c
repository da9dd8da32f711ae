/* AVX2 + FMA + F16C kernels (8 floats per vector).  Same structure as fx_simd_avx512.c; the target pragma
 * enables the instructions for this file only and fluxion.c calls in here only when the CPU reports them. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>
#include <math.h>
#include <string.h>
#include "fx_internal.h"

#define FX_INLINE static inline __attribute__((always_inline))

FX_INLINE __m256 load8(const uint16_t *p, int bf16) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

FX_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* bf16 fast path: 16 values -> even and odd elements (lane i: elements 2i and 2i+1), a shift and a mask of the
 * same 256 bits instead of two widening conversions; q and the pv accumulators are split the same way. */
FX_INLINE void load16_bf16(const uint16_t *p, __m256 *even, __m256 *odd) {
    __m256i x = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 16 floats -> [even elements], [odd elements], and back */
FX_INLINE void split16(const float *x, __m256 *even, __m256 *odd) {
    __m256 lo = _mm256_loadu_ps(x), hi = _mm256_loadu_ps(x + 8);
    /* shuffle: lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6, then 64-bit pairs reordered 0 2 1 3 */
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0))),
                                                   _MM_SHUFFLE(3, 1, 2, 0)));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1))),
                                                  _MM_SHUFFLE(3, 1, 2, 0)));
}

FX_INLINE void merge16(float *x, __m256 even, __m256 odd) {
    __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd); /* 0-3 | 8-11 and 4-7 | 12-15 */
    _mm256_storeu_ps(x, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(x + 8, _mm256_permute2f128_ps(a, b, 0x31));
}

/* [sum a, sum b, sum c, sum d] */
FX_INLINE __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d)); /* a0123 b0123 c0123 d0123 | 4567s */
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* R heads x T tokens per step (T*R <= 12 accumulators of the 16 ymm registers): each K chunk is converted once and
 * feeds R FMAs, and T*R independent chains hide the FMA latency (one token at a time left only R chains, R = 1:
 * one).  The next block's prefetch advances one step per (T tokens, 8-wide chunk). */
FX_INLINE void qk_tile(const float *q, int R, int T, const uint16_t *k, int len, int d, int bf16, float scale,
                       float *s, int ld, pf_cursor *pc) {
    int t = 0;
    for (; t + T <= len; t += T) {
        __m256 acc[8][8];
        for (int u = 0; u < T; u++)
            for (int j = 0; j < R; j++) acc[u][j] = _mm256_setzero_ps();
        if (bf16) {
            for (int e = 0; e < d; e += 16) {
                pfc_step(pc);
                pfc_step(pc);
                for (int u = 0; u < T; u++) {
                    __m256 ke, ko;
                    load16_bf16(k + (int64_t)(t + u) * d + e, &ke, &ko);
                    for (int j = 0; j < R; j++) {
                        acc[u][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + e), ke, acc[u][j]);
                        acc[u][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + e + 8), ko, acc[u][j]);
                    }
                }
            }
        } else {
            for (int e = 0; e < d; e += 8) {
                pfc_step(pc);
                for (int u = 0; u < T; u++) {
                    __m256 kv = load8(k + (int64_t)(t + u) * d + e, 0);
                    for (int j = 0; j < R; j++)
                        acc[u][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + e), kv, acc[u][j]);
                }
            }
        }
        for (int j = 0; j < R; j++) {
            int u = 0;
            for (; u + 4 <= T; u += 4)
                _mm_storeu_ps(s + j * ld + t + u, _mm_mul_ps(_mm_set1_ps(scale), reduce4(acc[u][j], acc[u + 1][j],
                                                                                         acc[u + 2][j], acc[u + 3][j])));
            for (; u < T; u++) s[j * ld + t + u] = hsum8(acc[u][j]) * scale;
        }
    }
    for (; t < len; t++) {
        __m256 acc[8];
        for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
        if (bf16) {
            for (int e = 0; e < d; e += 16) {
                pfc_step(pc);
                pfc_step(pc);
                __m256 ke, ko;
                load16_bf16(k + (int64_t)t * d + e, &ke, &ko);
                for (int j = 0; j < R; j++) {
                    acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + e), ke, acc[j]);
                    acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + e + 8), ko, acc[j]);
                }
            }
        } else {
            for (int e = 0; e < d; e += 8) {
                pfc_step(pc);
                __m256 kv = load8(k + (int64_t)t * d + e, 0);
                for (int j = 0; j < R; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + e), kv, acc[j]);
            }
        }
        for (int j = 0; j < R; j++) s[j * ld + t] = hsum8(acc[j]) * scale;
    }
}

/* tokens per step for R heads */
static inline int qk_tokens(int R) { return R == 1 ? 8 : R <= 3 ? 4 : R == 4 ? 2 : 1; }

static void qk_avx2(const float *q, int r, const uint16_t *k, int len, int d, int bf16, float scale, float *s,
                    int ld, const void *pf, int64_t pf_lines) {
    /* the prefetch spreads over every pass of up to 8 heads: per pass (len / T) groups and (len % T) single
     * tokens, d / 8 steps each */
    int64_t steps = 0;
    for (int j0 = 0; j0 < r; j0 += 8) {
        int T = qk_tokens(r - j0 < 8 ? r - j0 : 8);
        steps += (int64_t)(len / T + len % T) * (d / 8);
    }
    pf_cursor pc = pfc_init(pf, pf_lines, steps);
    float qs[FX_MAX_GROUP * FX_MAX_DIM];
    if (bf16) { /* per 16-element chunk: [even 8][odd 8], matching load16_bf16 */
        for (int j = 0; j < r; j++)
            for (int e = 0; e < d; e += 16) {
                __m256 ev, od;
                split16(q + j * d + e, &ev, &od);
                _mm256_storeu_ps(qs + j * d + e, ev);
                _mm256_storeu_ps(qs + j * d + e + 8, od);
            }
        q = qs;
    }
    for (int j0 = 0; j0 < r; j0 += 8) {
        int rj = r - j0 < 8 ? r - j0 : 8;
        const float *qj = q + (int64_t)j0 * d;
        float *sj = s + j0 * ld;
        switch (rj) {
            case 1: qk_tile(qj, 1, 8, k, len, d, bf16, scale, sj, ld, &pc); break;
            case 2: qk_tile(qj, 2, 4, k, len, d, bf16, scale, sj, ld, &pc); break;
            case 3: qk_tile(qj, 3, 4, k, len, d, bf16, scale, sj, ld, &pc); break;
            case 4: qk_tile(qj, 4, 2, k, len, d, bf16, scale, sj, ld, &pc); break;
            case 5: qk_tile(qj, 5, 1, k, len, d, bf16, scale, sj, ld, &pc); break;
            case 6: qk_tile(qj, 6, 1, k, len, d, bf16, scale, sj, ld, &pc); break;
            case 7: qk_tile(qj, 7, 1, k, len, d, bf16, scale, sj, ld, &pc); break;
            default: qk_tile(qj, 8, 1, k, len, d, bf16, scale, sj, ld, &pc); break;
        }
    }
}

/* R heads x S 8-wide strips per pass (R*S <= 8 accumulators plus R broadcasts): S*R independent chains, and each
 * p broadcast serves S strips.  Columns left over when d / 8 is not a multiple of S take single strips. */
FX_INLINE void pv_tile(const float *p, int R, int S, int ld, const uint16_t *v, int len, int d, int bf16,
                       float *acc, pf_cursor *pc) {
    int c = 0;
    for (; c + 8 * S <= d; c += 8 * S) {
        __m256 a[8][8];
        for (int j = 0; j < R; j++)
            for (int u = 0; u < S; u++) a[j][u] = _mm256_loadu_ps(acc + j * d + c + 8 * u);
        for (int t = 0; t < len; t++) {
            pfc_step(pc);
            __m256 pj[8];
            for (int j = 0; j < R; j++) pj[j] = _mm256_broadcast_ss(p + j * ld + t);
            for (int u = 0; u < S; u++) {
                __m256 vv = load8(v + (int64_t)t * d + c + 8 * u, bf16);
                for (int j = 0; j < R; j++) a[j][u] = _mm256_fmadd_ps(pj[j], vv, a[j][u]);
            }
        }
        for (int j = 0; j < R; j++)
            for (int u = 0; u < S; u++) _mm256_storeu_ps(acc + j * d + c + 8 * u, a[j][u]);
    }
    for (; c < d; c += 8) {
        __m256 a[8];
        for (int j = 0; j < R; j++) a[j] = _mm256_loadu_ps(acc + j * d + c);
        for (int t = 0; t < len; t++) {
            pfc_step(pc);
            __m256 vv = load8(v + (int64_t)t * d + c, bf16);
            for (int j = 0; j < R; j++) a[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j * ld + t), vv, a[j]);
        }
        for (int j = 0; j < R; j++) _mm256_storeu_ps(acc + j * d + c, a[j]);
    }
}

/* bf16, R (<= 4) heads x S 16-wide strips per pass, each strip as even/odd accumulator halves (split16 on entry,
 * merge16 on exit): one shift and one mask per 16 V values.  Columns left over take single 16-wide strips. */
FX_INLINE void pv_pass16(const float *p, int R, int S, int ld, const uint16_t *v, int len, int d, float *acc,
                         pf_cursor *pc) {
    __m256 ae[4][4], ao[4][4];
    for (int j = 0; j < R; j++)
        for (int u = 0; u < S; u++) split16(acc + j * d + 16 * u, &ae[j][u], &ao[j][u]);
    for (int t = 0; t < len; t++) {
        pfc_step(pc);
        __m256 pj[4];
        for (int j = 0; j < R; j++) pj[j] = _mm256_broadcast_ss(p + j * ld + t);
        for (int u = 0; u < S; u++) {
            __m256 ve, vo;
            load16_bf16(v + (int64_t)t * d + 16 * u, &ve, &vo);
            for (int j = 0; j < R; j++) {
                ae[j][u] = _mm256_fmadd_ps(pj[j], ve, ae[j][u]);
                ao[j][u] = _mm256_fmadd_ps(pj[j], vo, ao[j][u]);
            }
        }
    }
    for (int j = 0; j < R; j++)
        for (int u = 0; u < S; u++) merge16(acc + j * d + 16 * u, ae[j][u], ao[j][u]);
}

FX_INLINE void pv_tile16(const float *p, int R, int S, int ld, const uint16_t *v, int len, int d, float *acc,
                         pf_cursor *pc) {
    int c = 0;
    for (; c + 16 * S <= d; c += 16 * S) pv_pass16(p, R, S, ld, v + c, len, d, acc + c, pc);
    for (; c < d; c += 16) pv_pass16(p, R, 1, ld, v + c, len, d, acc + c, pc);
}

/* 16-wide strips per pass for R <= 4 heads (bf16) */
static inline int pv_strips16(int R) { return R == 1 ? 4 : R == 2 ? 2 : 1; }

/* strips per pass for R heads */
static inline int pv_strips(int R) { return R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1; }

static void pv_avx2(const float *p, int r, int ld, const uint16_t *v, int len, int d, int bf16, float *acc,
                    const void *pf, int64_t pf_lines) {
    /* the prefetch spreads over every pass of up to 8 heads: per pass one step per token of each column pass
     * (d / (8 S) of S strips, the rest single strips) */
    int64_t steps = 0;
    for (int j0 = 0; j0 < r; j0 += 8) {
        int rj = r - j0 < 8 ? r - j0 : 8;
        if (bf16 && rj <= 4) {
            int S = pv_strips16(rj);
            steps += (int64_t)(d / (16 * S) + (d % (16 * S)) / 16) * len;
        } else {
            int S = pv_strips(rj);
            steps += (int64_t)(d / (8 * S) + (d % (8 * S)) / 8) * len;
        }
    }
    pf_cursor pc = pfc_init(pf, pf_lines, steps);
    for (int j0 = 0; j0 < r; j0 += 8) {
        int rj = r - j0 < 8 ? r - j0 : 8;
        const float *pj = p + j0 * ld;
        float *aj = acc + (int64_t)j0 * d;
        if (bf16 && rj <= 4) {
            switch (rj) {
                case 1: pv_tile16(pj, 1, 4, ld, v, len, d, aj, &pc); break;
                case 2: pv_tile16(pj, 2, 2, ld, v, len, d, aj, &pc); break;
                case 3: pv_tile16(pj, 3, 1, ld, v, len, d, aj, &pc); break;
                default: pv_tile16(pj, 4, 1, ld, v, len, d, aj, &pc); break;
            }
            continue;
        }
        switch (rj) {
            case 1: pv_tile(pj, 1, 8, ld, v, len, d, bf16, aj, &pc); break;
            case 2: pv_tile(pj, 2, 4, ld, v, len, d, bf16, aj, &pc); break;
            case 3: pv_tile(pj, 3, 2, ld, v, len, d, bf16, aj, &pc); break;
            case 4: pv_tile(pj, 4, 2, ld, v, len, d, bf16, aj, &pc); break;
            case 5: pv_tile(pj, 5, 1, ld, v, len, d, bf16, aj, &pc); break;
            case 6: pv_tile(pj, 6, 1, ld, v, len, d, bf16, aj, &pc); break;
            case 7: pv_tile(pj, 7, 1, ld, v, len, d, bf16, aj, &pc); break;
            default: pv_tile(pj, 8, 1, ld, v, len, d, bf16, aj, &pc); break;
        }
    }
}

/* Same range reduction and polynomial as the AVX-512 path; 2^n is built in the exponent bits (n >= -126 here). */
FX_INLINE __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), f);
    __m256 y = _mm256_set1_ps(1.0f / 720.0f);
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f / 120.0f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f / 24.0f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f / 6.0f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(0.5f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

static void exp_neg_avx2(float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_neg8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float tail[8] = {0};
        for (int t = i; t < n; t++) tail[t - i] = x[t];
        _mm256_storeu_ps(tail, exp_neg8(_mm256_loadu_ps(tail)));
        for (int t = i; t < n; t++) x[t] = tail[t - i];
    }
}

static float row_max_avx2(const float *x, int n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}

static float exp_sum_avx2(float *x, int n, float m) {
    __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    if (i < n) {
        float tail[8];
        for (int t = 0; t < 8; t++) tail[t] = i + t < n ? x[i + t] - m : -100.0f;
        _mm256_storeu_ps(tail, exp_neg8(_mm256_loadu_ps(tail)));
        for (int t = i; t < n; t++) {
            x[t] = tail[t - i];
            sum += x[t];
        }
    }
    return sum;
}

static void stage_copy_avx2(void *dst, const void *src, int64_t n, const void *pf, int64_t pf_lines) {
    char *d = dst;
    const char *s = src;
    if (((uintptr_t)d & 31) || (n & 63)) {
        fx_prefetch_share(pf, pf_lines, 0, 1);
        memcpy(dst, src, (size_t)n);
        return;
    }
    int64_t lines = n / 64;
    pf_cursor pc = pfc_init(pf, pf_lines, lines);
    for (int64_t l = 0; l < lines; l++) {
        pfc_step(&pc);
        _mm256_stream_si256((__m256i *)(d + 64 * l), _mm256_loadu_si256((const __m256i *)(s + 64 * l)));
        _mm256_stream_si256((__m256i *)(d + 64 * l + 32), _mm256_loadu_si256((const __m256i *)(s + 64 * l + 32)));
    }
}

static void fence_avx2(void) { _mm_sfence(); }

/* 8 fp32 values that are 16-bit values -> 16-bit (exact: bf16 keeps the upper halves, vcvtps2ph rounds nothing) */
FX_INLINE void store8(uint16_t *p, __m256 v, int bf16) {
    __m128i h;
    if (bf16) {
        __m256i x = _mm256_srli_epi32(_mm256_castps_si256(v), 16); /* 0..65535 per lane: packus keeps them */
        h = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    } else {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    }
    _mm_storeu_si128((__m128i *)p, h);
}

#define FX_BOUND_AHEAD 4096 /* prefetch distance in bytes within a run of summaries: see fx_simd_avx512.c */
FX_INLINE void bound_body(const float *qpos, const float *qneg, const uint16_t *s, int n, int d, int bf16,
                          float *score) {
    const char *base = (const char *)s;
    const int64_t bb = (int64_t)2 * d * 2, end = (int64_t)n * bb;
    for (int b = 0; b < n; b++) {
        for (int64_t o = b * bb + FX_BOUND_AHEAD, e = o + bb < end ? o + bb : end; o < e; o += 64)
            __builtin_prefetch(base + o, 0, 2);
        const uint16_t *mn = s + (int64_t)b * 2 * d;
        const uint16_t *mx = mn + d;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int e = 0; e < d; e += 8) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qpos + e), load8(mx + e, bf16), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qneg + e), load8(mn + e, bf16), a1);
        }
        score[b] = hsum8(_mm256_add_ps(a0, a1));
    }
}

static void bound_avx2(const float *qpos, const float *qneg, const uint16_t *s, int n, int d, int bf16,
                       float *score) {
    if (bf16) bound_body(qpos, qneg, s, n, d, 1, score);
    else bound_body(qpos, qneg, s, n, d, 0, score);
}

static void minmax_avx2(const uint16_t *k, int len, int d, int bf16, uint16_t *mn, uint16_t *mx, int init) {
    for (int e = 0; e < d; e += 8) {
        int t = 0;
        __m256 lo, hi;
        if (init) {
            lo = hi = load8(k + e, bf16);
            t = 1;
        } else {
            lo = load8(mn + e, bf16);
            hi = load8(mx + e, bf16);
        }
        for (; t < len; t++) {
            __m256 kv = load8(k + (int64_t)t * d + e, bf16);
            lo = _mm256_min_ps(lo, kv);
            hi = _mm256_max_ps(hi, kv);
        }
        store8(mn + e, lo, bf16);
        store8(mx + e, hi, bf16);
    }
}

/* R (<= 5) heads' bounds of one block: per 8-wide chunk the min or the max by the sign of q (blendv reads the sign
 * bit: -0.0 takes the min, harmless as its product is 0), one FMA per head; chunks alternate between two accumulators
 * per head (2R accumulators + min + max + q + pick = 14 of the 16 ymm registers at R = 5). */
FX_INLINE void bound_heads_block(const float *q, int R, const uint16_t *mn, int d, int bf16, float *out,
                                 int64_t ld) {
    const uint16_t *mx = mn + d;
    __m256 a0[5], a1[5];
    for (int j = 0; j < R; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    for (int e = 0; e < d; e += 16) { /* d % 16 == 0 */
        __m256 lo = load8(mn + e, bf16), hi = load8(mx + e, bf16);
        for (int j = 0; j < R; j++) {
            __m256 qv = _mm256_loadu_ps(q + j * d + e);
            a0[j] = _mm256_fmadd_ps(qv, _mm256_blendv_ps(hi, lo, qv), a0[j]);
        }
        lo = load8(mn + e + 8, bf16);
        hi = load8(mx + e + 8, bf16);
        for (int j = 0; j < R; j++) {
            __m256 qv = _mm256_loadu_ps(q + j * d + e + 8);
            a1[j] = _mm256_fmadd_ps(qv, _mm256_blendv_ps(hi, lo, qv), a1[j]);
        }
    }
    int j = 0;
    for (; j + 4 <= R; j += 4) {
        float t[4];
        _mm_storeu_ps(t, reduce4(_mm256_add_ps(a0[j], a1[j]), _mm256_add_ps(a0[j + 1], a1[j + 1]),
                                 _mm256_add_ps(a0[j + 2], a1[j + 2]), _mm256_add_ps(a0[j + 3], a1[j + 3])));
        for (int u = 0; u < 4; u++) out[(j + u) * ld] = t[u];
    }
    for (; j < R; j++) out[j * ld] = hsum8(_mm256_add_ps(a0[j], a1[j]));
}

/* Heads in even passes of at most 5 (r = 7: 4 + 3, r = 8: 4 + 4), every pass over the same block while in L1.
 * Each 16-bit summary chunk is widened (exactly) once per pass and serves all the pass's heads. */
FX_INLINE void bound_heads_body(const float *q, int r, const uint16_t *s, int n, int d, int bf16, float *out,
                                int64_t ld) {
    const char *base = (const char *)s;
    const int64_t bb = (int64_t)2 * d * 2, end = (int64_t)n * bb;
    int passes = (r + 4) / 5;
    for (int b = 0; b < n; b++) {
        for (int64_t o = b * bb + FX_BOUND_AHEAD, e = o + bb < end ? o + bb : end; o < e; o += 64)
            __builtin_prefetch(base + o, 0, 2);
        const uint16_t *mn = s + (int64_t)b * 2 * d;
        for (int p = 0, j0 = 0; p < passes; p++) {
            int j1 = r * (p + 1) / passes;
            const float *qj = q + (int64_t)j0 * d;
            float *o = out + j0 * ld + b;
            switch (j1 - j0) {
                case 1: bound_heads_block(qj, 1, mn, d, bf16, o, ld); break;
                case 2: bound_heads_block(qj, 2, mn, d, bf16, o, ld); break;
                case 3: bound_heads_block(qj, 3, mn, d, bf16, o, ld); break;
                case 4: bound_heads_block(qj, 4, mn, d, bf16, o, ld); break;
                default: bound_heads_block(qj, 5, mn, d, bf16, o, ld); break;
            }
            j0 = j1;
        }
    }
}

static void bound_heads_avx2(const float *q, int r, const uint16_t *s, int n, int d, int bf16, float *out,
                             int64_t ld) {
    if (bf16) bound_heads_body(q, r, s, n, d, 1, out, ld);
    else bound_heads_body(q, r, s, n, d, 0, out, ld);
}

static void gap_max_avx2(const float *x, int64_t ld, const float *m, int r, int n, float *score) {
    int b = 0;
    for (; b + 8 <= n; b += 8) {
        __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + b), _mm256_set1_ps(m[0]));
        for (int j = 1; j < r; j++)
            v = _mm256_max_ps(v, _mm256_sub_ps(_mm256_loadu_ps(x + j * ld + b), _mm256_set1_ps(m[j])));
        _mm256_storeu_ps(score + b, v);
    }
    for (; b < n; b++) {
        float v = x[b] - m[0];
        for (int j = 1; j < r; j++) {
            float w = x[j * ld + b] - m[j];
            v = w > v ? w : v;
        }
        score[b] = v;
    }
}

#include "fx_attn32_ymm.h"

const fx_kernels fx_kernels_avx2 = {
    "avx2", qk_avx2, pv_avx2, exp_neg_avx2, row_max_avx2, exp_sum_avx2, stage_copy_avx2, fence_avx2, bound_avx2,
    minmax_avx2, bound_heads_avx2, gap_max_avx2, NULL, NULL, /* no bf16 dot products */
    a32_qk, a32_pv,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
