/* AVX-512 kernels of the quantized-weight products, included by fx_quant_avx512.c (FXQ_VNNI 0: AVX-512BW integer
 * dot products, vpmaddubsw + vpmaddwd) and fx_quant_avx512vnni.c (FXQ_VNNI 1: vpdpbusd, vpdpwssd), each after its
 * own target pragma, to define the table FXQ_TABLE.  The two give the same int32 lanes (no int16 pair saturates:
 * |weight byte| <= 128, |qx| <= 127), so the same results bit for bit.
 *
 * 32-block types: fx_quant_ymm.h on 256-bit vectors (VNNI on ymm).  K types: 64 elements per 512-bit vector, the
 * sub-block scales applied to the int16 pair sums (vpmaddwd / vpdpwssd), a 256-block's integer sum in int32.
 * Per weight row, x rows are taken 8, 4, 2 or 1 at a time, each block decoded once per group. */
#ifndef FXQ_TABLE
#error "define FXQ_VNNI and FXQ_TABLE, then include after the file's target pragma"
#endif

#include <immintrin.h>
#include "fx_quant.h"

#define FX_INLINE static inline __attribute__((always_inline))

FX_INLINE float f16s(const uint8_t *p) { return _cvtsh_ss(fxq_u16(p)); }

/* int32 lanes: lane l = sum of the products of bytes 4l .. 4l + 3 (u unsigned, s signed) */
FX_INLINE __m512i dot_u8s8(__m512i u, __m512i s) {
#if FXQ_VNNI
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* acc + (int16 pairs of p) . (int16 pairs of sc) */
FX_INLINE __m512i madd_acc(__m512i acc, __m512i p, __m512i sc) {
#if FXQ_VNNI
    return _mm512_dpwssd_epi32(acc, p, sc);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc));
#endif
}

/* ---- 32-block types: fx_quant_ymm.h, with VNNI on ymm ---- */

#define FXQ_INLINE_Y FX_INLINE
#define FXQ_YMM_VNNI FXQ_VNNI
#define FXQ_YMM_MT 8
#include "fx_quant_ymm.h"

/* ---- K types ---- */

FX_INLINE void k45_tile(int five, const uint8_t *row, const fxq_act *a, int i0, const int MT, float *y, int64_t ldy) {
    const int64_t k = a->k, nb = k / 256;
    const int bytes = five ? FXQ_BYTES_Q5_K : FXQ_BYTES_Q4_K;
    const int8_t *xq = a->q256 + i0 * k;
    const float *xd = a->d256 + i0 * nb;
    const int16_t *bs = a->bs256 + i0 * (k / 16);
    __m512 acc[8];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + b * bytes, *qs = p + (five ? 48 : 16);
        fxq_prefetch(p, bytes);
        const float d = f16s(p), dmin = f16s(p + 2);
        uint64_t sc, mn;
        fxq_k4_scales64(p + 4, &sc, &mn);
        const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        __m128i m8 = _mm_cvtsi64_si128((long long)mn);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)); /* mn[j] at int16 lanes 2j, 2j + 1 */
        const __m512i qh = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 16)))
                                : _mm512_setzero_si512();
        __m512i iacc[8];
        for (int i = 0; i < MT; i++) iacc[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) { /* elements 64c .. 64c + 63: sub-blocks 2c (low nibbles), 2c + 1 (high) */
            __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
            __m512i n = _mm512_and_si512(_mm512_srlv_epi64(q, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)),
                                         _mm512_set1_epi8(15));
            if (five) { /* bit 2c (low half) / 2c + 1 (high half) of qh[l] rotated onto bit 4 of byte l */
                const long long r0 = (4 - 2 * c) & 63, r1 = (3 - 2 * c) & 63;
                __m512i hb = _mm512_rolv_epi64(qh, _mm512_set_epi64(r1, r1, r1, r1, r0, r0, r0, r0));
                n = _mm512_or_si512(n, _mm512_and_si512(hb, _mm512_set1_epi8(16)));
            }
            const __m512i scv = _mm512_permutexvar_epi16(
                _mm512_set_epi16(2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c,
                                 2 * c, 2 * c, 2 * c, 2 * c),
                sc16);
#pragma GCC unroll 8
            for (int i = 0; i < MT; i++) {
                __m512i xv = _mm512_loadu_si512(xq + i * k + 256 * b + 64 * c);
                iacc[i] = madd_acc(iacc[i], _mm512_maddubs_epi16(n, xv), scv);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            float dx = xd[i * nb + b];
            __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + i * (k / 16) + 16 * b)), mins);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i]), _mm512_set1_ps(d * dx), acc[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(msum)), _mm512_set1_ps(-(dmin * dx)),
                                     acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

FX_INLINE void q6k_tile(const uint8_t *row, const fxq_act *a, int i0, const int MT, float *y, int64_t ldy) {
    const int64_t k = a->k, nb = k / 256;
    const int8_t *xq = a->q256 + i0 * k;
    const float *xd = a->d256 + i0 * nb;
    const int16_t *bs = a->bs256 + i0 * (k / 16);
    __m512 acc[8];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = row + b * FXQ_BYTES_Q6_K;
        fxq_prefetch(p, FXQ_BYTES_Q6_K);
        const float d = f16s(p + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
        __m512i iacc[8];
        for (int i = 0; i < MT; i++) iacc[i] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(p + 64 * h);
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h)));
#pragma GCC unroll 2
            for (int c = 0; c < 2; c++) { /* elements 128h + 64c .. + 63: groups 8h + 4c .. 8h + 4c + 3 */
                __m512i lo = _mm512_and_si512(c ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(15));
                const long long s0 = 4 * c, s1 = 4 * c + 2;
                __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_set_epi64(s1, s1, s1, s1, s0, s0, s0, s0)),
                                              _mm512_set1_epi8(3));
                __m512i n = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
                const short g = (short)(8 * h + 4 * c);
                const __m512i scv = _mm512_permutexvar_epi16(
                    _mm512_set_epi16(g + 3, g + 3, g + 3, g + 3, g + 3, g + 3, g + 3, g + 3, g + 2, g + 2, g + 2, g + 2,
                                     g + 2, g + 2, g + 2, g + 2, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1,
                                     g, g, g, g, g, g, g, g),
                    _mm512_castsi256_si512(sc16));
#pragma GCC unroll 8
                for (int i = 0; i < MT; i++) {
                    __m512i xv = _mm512_loadu_si512(xq + i * k + 256 * b + 128 * h + 64 * c);
                    iacc[i] = madd_acc(iacc[i], _mm512_maddubs_epi16(n, xv), scv);
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) { /* the -32 offset: sum_g scales[g] * 32 * sum(qx over group g) */
            __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs + i * (k / 16) + 16 * b)), sc16);
            iacc[i] = _mm512_sub_epi32(iacc[i], _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i]), _mm512_set1_ps(d * xd[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

/* ---- F32 / F16 / BF16: fp32 FMAs, 32 weights per step in two chains, a masked tail ---- */

FX_INLINE __m512 load16w(int t, const uint8_t *p, __mmask16 mask) {
    if (t == FX_QT_F32) return _mm512_maskz_loadu_ps(mask, p);
    __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    if (t == FX_QT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

FX_INLINE void float_tile(int t, const uint8_t *row, const fxq_act *a, int i0, const int MT, float *y, int64_t ldy) {
    const int64_t k = a->k;
    const int es = t == FX_QT_F32 ? 4 : 2;
    const float *x = a->x + i0 * k;
    __m512 acc0[8], acc1[8];
    for (int i = 0; i < MT; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    int64_t e = 0;
    for (; e + 32 <= k; e += 32) {
        fxq_prefetch(row + e * es, 32 * es);
        __m512 w0 = load16w(t, row + e * es, 0xFFFF), w1 = load16w(t, row + (e + 16) * es, 0xFFFF);
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            acc0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * k + e), acc0[i]);
            acc1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * k + e + 16), acc1[i]);
        }
    }
    for (; e < k; e += 16) {
        __mmask16 mask = k - e >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - e)) - 1);
        __m512 w0 = load16w(t, row + e * es, mask);
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) acc0[i] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(mask, x + i * k + e), acc0[i]);
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}

/* Each weight row against the tile's x rows, 8, 4, 2 or 1 at a time (compile-time counts). */
#define TILES(CALL)                                                                                              \
    for (int64_t r = 0; r < n_rows; r++) {                                                                       \
        const uint8_t *row = w + r * rb;                                                                         \
        int i0 = 0;                                                                                              \
        for (; i0 + 8 <= m; i0 += 8) CALL(8);                                                                    \
        if (i0 + 4 <= m) {                                                                                       \
            CALL(4);                                                                                             \
            i0 += 4;                                                                                             \
        }                                                                                                        \
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

static void dequant_row(int32_t t, const uint8_t *row, int64_t k, float *out) {
    fxq_dequant_row_generic(t, row, k, out); /* the shared C, vectorised for AVX-512 by the compiler */
}

static void dequant_row_bf16(int32_t t, const uint8_t *row, int64_t k, uint16_t *out) {
    fxq_dequant_row_bf16_generic(t, row, k, out);
}

const fx_qkernels FXQ_TABLE = {
#if FXQ_VNNI
    "avx512vnni",
#else
    "avx512",
#endif
    {
        [FX_QT_F32] = rows_f32, [FX_QT_F16] = rows_f16, [FX_QT_BF16] = rows_bf16, [FX_QT_Q4_0] = rows_q4_0,
        [FX_QT_Q4_1] = rows_q4_1, [FX_QT_Q5_0] = rows_q5_0, [FX_QT_Q5_1] = rows_q5_1, [FX_QT_Q8_0] = rows_q8_0,
        [FX_QT_Q4_K] = rows_q4_k, [FX_QT_Q5_K] = rows_q5_k, [FX_QT_Q6_K] = rows_q6_k,
    },
    dequant_row,
    dequant_row_bf16,
};
