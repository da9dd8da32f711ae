/* AVX2 kernels of the quantized-weight products (FX_SIMD_AVX2): 32 weights per 256-bit vector, integer dot products
 * by vpmaddubsw (unsigned weight bytes x signed activation bytes, pairs summed to int16) + vpmaddwd (to int32).
 * Compiled with the same flags as every other file; the target pragma enables AVX2/FMA/F16C for this file only and
 * fx_quant.c calls in here only when the CPU has them.
 *
 * 32-block types: fx_quant_ymm.h.  K types: their unsigned part n (Q6_K: q, its -32 applied to the activations'
 * 16-element sums) times the sub-block scales inside vpmaddwd, the min term in fp32 from the activations' sums.
 * Per weight row, x rows are taken 4, 2 or 1 at a time, each block decoded once per group (the weight row stays
 * in L1 between groups).  The weight stream is prefetched FXQ_PF_DIST bytes ahead. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>
#include "fx_quant.h"

#define FX_INLINE static inline __attribute__((always_inline))

FX_INLINE float f16s(const uint8_t *p) { return _cvtsh_ss(fxq_u16(p)); }

#define FXQ_INLINE_Y FX_INLINE
#define FXQ_YMM_VNNI 0
#define FXQ_YMM_MT 4
#include "fx_quant_ymm.h"

#define hsum8 hsum8_y

/* ---- K types: per 256-block, eight 32-element chunks; the per-chunk (Q4_K/Q5_K) or per-16 (Q6_K) scales multiply
 * the int16 pair sums inside vpmaddwd, so a block's whole integer sum stays in int32 (at most ~3.4e7). ---- */

FX_INLINE void k45_tile(int five, const uint8_t *row, const fxq_act *a, int i0, const int MT, float *y, int64_t ldy) {
    const int64_t k = a->k, nb = k / 256;
    const int bytes = five ? FXQ_BYTES_Q5_K : FXQ_BYTES_Q4_K;
    const int8_t *xq = a->q256 + i0 * k;
    const float *xd = a->d256 + i0 * nb;
    const int16_t *bs = a->bs256 + i0 * (k / 16);
    __m256 acc[4];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + b * bytes, *qs = p + (five ? 48 : 16);
        fxq_prefetch(p, bytes);
        const float d = f16s(p), dmin = f16s(p + 2);
        uint64_t sc, mn;
        fxq_k4_scales64(p + 4, &sc, &mn);
        __m128i m8 = _mm_cvtsi64_si128((long long)mn);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)); /* mn[j] at int16 lanes 2j, 2j + 1 */
        __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
        __m256i iacc[4];
        for (int i = 0; i < MT; i++) iacc[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
            __m256i n = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(15));
            if (five) { /* bit j of qh[l] -> bit 4 of byte l (the 16-bit shifts cannot bring another byte's bit 4) */
                __m256i hb = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
                n = _mm256_or_si256(n, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
            }
            const __m256i scv = _mm256_set1_epi16((short)((sc >> (8 * j)) & 0xFF));
#pragma GCC unroll 4
            for (int i = 0; i < MT; i++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * k + 256 * b + 32 * j));
                iacc[i] = _mm256_add_epi32(iacc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(n, xv), scv));
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) {
            float dx = xd[i * nb + b];
            __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + i * (k / 16) + 16 * b)), mins);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i]), _mm256_set1_ps(d * dx), acc[i]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-(dmin * dx)), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hsum8(acc[i]);
}

FX_INLINE __m256i dup16to32(__m256i v) { /* int32 lanes holding int16 values -> both halves of each lane = value */
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

FX_INLINE void q6k_tile(const uint8_t *row, const fxq_act *a, int i0, const int MT, float *y, int64_t ldy) {
    const int64_t k = a->k, nb = k / 256;
    const int8_t *xq = a->q256 + i0 * k;
    const float *xd = a->d256 + i0 * nb;
    const int16_t *bs = a->bs256 + i0 * (k / 16);
    __m256 acc[4];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + b * FXQ_BYTES_Q6_K;
        fxq_prefetch(p, FXQ_BYTES_Q6_K);
        const float d = f16s(p + 208);
        __m128i s8 = _mm_loadu_si128((const __m128i *)(p + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(s8); /* the 16 scales as int16 */
        /* scales g = 0..7 and 8..15, each in both int16 halves of an int32 lane */
        const __m256i dup[2] = {dup16to32(_mm256_cvtepi8_epi32(s8)), dup16to32(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)))};
        __m256i iacc[4];
        for (int i = 0; i < MT; i++) iacc[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) { /* elements 128h + 32s + l, l < 32 */
                __m256i lo = s % 2 ? l1 : l0;
                lo = _mm256_and_si256(s / 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(15));
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), _mm256_set1_epi8(3));
                __m256i n = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                /* groups 8h + 2s (elements 0..15 of the chunk: int32 lanes 0..3) and 8h + 2s + 1 (lanes 4..7) */
                __m256i scv = _mm256_permutevar8x32_epi32(dup[h], _mm256_setr_epi32(2 * s, 2 * s, 2 * s, 2 * s,
                                                                                    2 * s + 1, 2 * s + 1, 2 * s + 1,
                                                                                    2 * s + 1));
#pragma GCC unroll 4
                for (int i = 0; i < MT; i++) {
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * k + 256 * b + 128 * h + 32 * s));
                    iacc[i] = _mm256_add_epi32(iacc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(n, xv), scv));
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) { /* the -32 offset: sum_g scales[g] * 32 * sum(qx over group g) */
            __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + i * (k / 16) + 16 * b)), sc16);
            iacc[i] = _mm256_sub_epi32(iacc[i], _mm256_slli_epi32(off, 5));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i]), _mm256_set1_ps(d * xd[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hsum8(acc[i]);
}

/* ---- F32 / F16 / BF16: fp32 FMAs, 16 weights per step in two chains ---- */

FX_INLINE __m256 load8w(int t, const uint8_t *p) {
    if (t == FX_QT_F32) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (t == FX_QT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

FX_INLINE float load1w(int t, const uint8_t *p) {
    if (t == FX_QT_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    return t == FX_QT_F16 ? f16s(p) : fx_bf16_to_f32(fxq_u16(p));
}

FX_INLINE void float_tile(int t, const uint8_t *row, const fxq_act *a, int i0, const int MT, float *y, int64_t ldy) {
    const int64_t k = a->k;
    const int es = t == FX_QT_F32 ? 4 : 2;
    const float *x = a->x + i0 * k;
    __m256 acc0[4], acc1[4];
    for (int i = 0; i < MT; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 16 <= k; e += 16) {
        fxq_prefetch(row + e * es, 16 * es);
        __m256 w0 = load8w(t, row + e * es), w1 = load8w(t, row + (e + 8) * es);
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) {
            acc0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * k + e), acc0[i]);
            acc1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * k + e + 8), acc1[i]);
        }
    }
    for (int i = 0; i < MT; i++) {
        float s = hsum8(_mm256_add_ps(acc0[i], acc1[i]));
        for (int64_t f = e; f < k; f++) s += load1w(t, row + f * es) * x[i * k + f];
        y[i * ldy] = s;
    }
}

/* Each weight row against the tile's x rows, 4, 2 or 1 at a time (compile-time counts). */
#define TILES(CALL)                                                                                              \
    for (int64_t r = 0; r < n_rows; r++) {                                                                       \
        const uint8_t *row = w + r * rb;                                                                         \
        int i0 = 0;                                                                                              \
        for (; i0 + 4 <= m; i0 += 4) CALL(4);                                                                    \
        if (i0 + 2 <= m) {                                                                                       \
            CALL(2);                                                                                             \
            i0 += 2;                                                                                             \
        }                                                                                                        \
        if (i0 < m) CALL(1);                                                                                     \
    }

#define ROWS_FN(name, CALL)                                                                                      \
    static void name(const uint8_t *w, int64_t rb, int64_t n_rows, const fxq_act *a, int m, float *y,          \
                     int64_t ldy) {                                                                              \
        TILES(CALL)                                                                                              \
    }

#define C_Q4_0(MT) q32_tile_y(FX_QT_Q4_0, FXQ_BYTES_Q4_0, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q4_1(MT) q32_tile_y(FX_QT_Q4_1, FXQ_BYTES_Q4_1, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q5_0(MT) q32_tile_y(FX_QT_Q5_0, FXQ_BYTES_Q5_0, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q5_1(MT) q32_tile_y(FX_QT_Q5_1, FXQ_BYTES_Q5_1, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q8_0(MT) q32_tile_y(FX_QT_Q8_0, FXQ_BYTES_Q8_0, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q4_K(MT) k45_tile(0, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q5_K(MT) k45_tile(1, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q6_K(MT) q6k_tile(row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_F32(MT) float_tile(FX_QT_F32, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_F16(MT) float_tile(FX_QT_F16, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_BF16(MT) float_tile(FX_QT_BF16, row, a, i0, MT, y + i0 * ldy + r, ldy)

ROWS_FN(rows_q4_0, C_Q4_0)
ROWS_FN(rows_q4_1, C_Q4_1)
ROWS_FN(rows_q5_0, C_Q5_0)
ROWS_FN(rows_q5_1, C_Q5_1)
ROWS_FN(rows_q8_0, C_Q8_0)
ROWS_FN(rows_q4_k, C_Q4_K)
ROWS_FN(rows_q5_k, C_Q5_K)
ROWS_FN(rows_q6_k, C_Q6_K)
ROWS_FN(rows_f32, C_F32)
ROWS_FN(rows_f16, C_F16)
ROWS_FN(rows_bf16, C_BF16)

static void dequant_row_avx2(int32_t t, const uint8_t *row, int64_t k, float *out) {
    fxq_dequant_row_generic(t, row, k, out); /* the shared C, vectorised for AVX2 by the compiler */
}

static void dequant_row_avx2_bf16(int32_t t, const uint8_t *row, int64_t k, uint16_t *out) {
    fxq_dequant_row_bf16_generic(t, row, k, out);
}

const fx_qkernels fx_qkernels_avx2 = {
    "avx2",
    {
        [FX_QT_F32] = rows_f32, [FX_QT_F16] = rows_f16, [FX_QT_BF16] = rows_bf16, [FX_QT_Q4_0] = rows_q4_0,
        [FX_QT_Q4_1] = rows_q4_1, [FX_QT_Q5_0] = rows_q5_0, [FX_QT_Q5_1] = rows_q5_1, [FX_QT_Q8_0] = rows_q8_0,
        [FX_QT_Q4_K] = rows_q4_k, [FX_QT_Q5_K] = rows_q5_k, [FX_QT_Q6_K] = rows_q6_k,
    },
    dequant_row_avx2,
    dequant_row_avx2_bf16,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
