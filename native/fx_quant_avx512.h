/* AVX-512 kernels of the quantized-weight products, included by fx_quant_avx512.c (FXQ_VNNI 0: AVX-512BW integer
 * dot products, vpmaddubsw + vpmaddwd) and fx_quant_avx512vnni.c (FXQ_VNNI 1: vpdpbusd, vpdpwssd), each after its
 * own target pragma, to define the table FXQ_TABLE.  The two give the same int32 lanes (no int16 pair saturates:
 * |weight byte| <= 128, |qx| <= 127), so the same results bit for bit.
 *
 * 32-block types: two blocks per 512-bit vector (an odd last block alone, the upper half zero).  Signed integer
 * parts (Q4_0, Q5_0, Q8_0) go in as |qw| with x negated where qw < 0 (a masked subtract), so the sums are exactly
 * sum(qw qx); Q4_1/Q5_1 go in as n and add m * (dx sum(qx)) in fp32.  K types: 64 elements per vector, the
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

/* ---- 32-block types ---- */

/* [16 bytes at a, twice; 16 bytes at b, twice] as 128-bit lanes; b NULL: the upper half zero */
FX_INLINE __m512i pair16(const uint8_t *a, const uint8_t *b) {
    __m512i v = _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a)));
    return _mm512_inserti64x4(v, b ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b))
                                   : _mm256_setzero_si256(), 1);
}

/* The nibbles of two blocks' qs in element order: block a's 32 elements (low nibbles, then high), then block b's. */
FX_INLINE __m512i nibbles_pair(const uint8_t *qa, const uint8_t *qb) {
    return _mm512_and_si512(_mm512_srlv_epi64(pair16(qa, qb), _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)),
                            _mm512_set1_epi8(15));
}

/* Byte e = 16 where bit e of block a's uint32 qh is set (e < 32), then block b's (NULL: none). */
FX_INLINE __m512i fifth_bits_pair(const uint8_t *qha, const uint8_t *qhb) {
    uint64_t bits = fxq_u32(qha) | (uint64_t)(qhb ? fxq_u32(qhb) : 0) << 32;
    return _mm512_maskz_mov_epi8((__mmask64)bits, _mm512_set1_epi8(16));
}

FX_INLINE __m512 pair_ps(float a, float b) { /* [a x 8, b x 8] */
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

/* [p[0] x 8, p[1] x 8] (single: [p[0] x 8, 0 x 8], p[1] not read) */
FX_INLINE __m512 expand2(const float *p, int single) {
    __m128 v = single ? _mm_load_ss(p) : _mm_castpd_ps(_mm_load_sd((const double *)p));
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(v));
}

FX_INLINE __m128 load2(const float *p, int single) {
    return single ? _mm_load_ss(p) : _mm_castpd_ps(_mm_load_sd((const double *)p));
}

/* Blocks b (and b + 1 unless single) of one weight row against MT rows of x. */
FX_INLINE void q32_pair(int t, int bytes, const uint8_t *row, int64_t b, int single, const int8_t *xq,
                        const float *xd, const float *xs, int64_t k, int64_t nb, const int MT, __m512 *acc,
                        __m128 *corr) {
    const int signed_w = t == FX_QT_Q4_0 || t == FX_QT_Q5_0 || t == FX_QT_Q8_0;
    const uint8_t *pa = row + b * bytes, *pb = single ? NULL : pa + bytes;
    __m512i u;
    __mmask64 neg = 0;
    __m128 mv = _mm_setzero_ps();
    if (signed_w) {
        __m512i sg;
        if (t == FX_QT_Q8_0) {
            __m512i lo = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(pa + 2)));
            sg = _mm512_inserti64x4(lo, pb ? _mm256_loadu_si256((const __m256i *)(pb + 2)) : _mm256_setzero_si256(),
                                    1);
        } else if (t == FX_QT_Q4_0) {
            sg = _mm512_sub_epi8(nibbles_pair(pa + 2, pb ? pb + 2 : pa + 2), _mm512_set1_epi8(8));
        } else {
            sg = _mm512_or_si512(nibbles_pair(pa + 6, pb ? pb + 6 : pa + 6), fifth_bits_pair(pa + 2, pb ? pb + 2 : 0));
            sg = _mm512_sub_epi8(sg, _mm512_set1_epi8(16));
        }
        if (single) sg = _mm512_maskz_mov_epi8((__mmask64)0xFFFFFFFFu, sg);
        u = _mm512_abs_epi8(sg); /* -128 -> 0x80: 128 unsigned */
        neg = _mm512_movepi8_mask(sg);
    } else {
        int five = t == FX_QT_Q5_1;
        u = nibbles_pair(pa + (five ? 8 : 4), pb ? pb + (five ? 8 : 4) : pa);
        if (five) u = _mm512_or_si512(u, fifth_bits_pair(pa + 4, pb ? pb + 4 : 0));
        if (single) u = _mm512_maskz_mov_epi8((__mmask64)0xFFFFFFFFu, u);
        mv = _mm_set_ps(0.0f, 0.0f, pb ? f16s(pb + 2) : 0.0f, f16s(pa + 2));
    }
    const __m512 dw = pair_ps(f16s(pa), pb ? f16s(pb) : 0.0f);
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
        const int8_t *xp = xq + i * k + 32 * b;
        __m512i xv = single ? _mm512_maskz_loadu_epi8((__mmask64)0xFFFFFFFFu, xp) : _mm512_loadu_si512(xp);
        if (signed_w) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
        __m512 scale = _mm512_mul_ps(dw, expand2(xd + i * nb + b, single));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8(u, xv)), scale, acc[i]);
        if (!signed_w) corr[i] = _mm_fmadd_ps(mv, load2(xs + i * nb + b, single), corr[i]);
    }
}

FX_INLINE void q32_tile(int t, int bytes, const uint8_t *row, const fxq_act *a, int i0, const int MT, float *y,
                        int64_t ldy) {
    const int64_t k = a->k, nb = k / 32;
    const int8_t *xq = a->q32 + i0 * k;
    const float *xd = a->d32 + i0 * nb, *xs = a->s32 + i0 * nb;
    __m512 acc[8];
    __m128 corr[8];
    for (int i = 0; i < MT; i++) {
        acc[i] = _mm512_setzero_ps();
        corr[i] = _mm_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) q32_pair(t, bytes, row, b, 0, xq, xd, xs, k, nb, MT, acc, corr);
    if (b < nb) q32_pair(t, bytes, row, b, 1, xq, xd, xs, k, nb, MT, acc, corr);
    for (int i = 0; i < MT; i++) {
        __m128 c = _mm_add_ss(corr[i], _mm_movehdup_ps(corr[i]));
        y[i * ldy] = _mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(c);
    }
}

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
        const float d = f16s(p), dmin = f16s(p + 2);
        uint8_t sc[8], mn[8];
        fxq_k4_scales(p + 4, sc, mn);
        const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        __m128i m8 = _mm_loadl_epi64((const __m128i *)mn);
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

#define C_Q4_0(MT) q32_tile(FX_QT_Q4_0, FXQ_BYTES_Q4_0, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q4_1(MT) q32_tile(FX_QT_Q4_1, FXQ_BYTES_Q4_1, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q5_0(MT) q32_tile(FX_QT_Q5_0, FXQ_BYTES_Q5_0, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q5_1(MT) q32_tile(FX_QT_Q5_1, FXQ_BYTES_Q5_1, row, a, i0, MT, y + i0 * ldy + r, ldy)
#define C_Q8_0(MT) q32_tile(FX_QT_Q8_0, FXQ_BYTES_Q8_0, row, a, i0, MT, y + i0 * ldy + r, ldy)
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
};
