/* Portable C kernels of the quantized-weight products (FX_SIMD_PORTABLE, and the reference the SIMD paths are
 * tested against along with the Python one).  Per weight row and block: decode the block's integer parts once, then
 * one exact integer dot product per row of x, scaled in fp32 (fluxion.h, "QUANTIZED WEIGHTS"). */
#include <string.h>
#include "fx_quant.h"

#define FXQ_INLINE static inline __attribute__((always_inline))

/* The integer parts of one 32-block: wq = the signed part (Q4_0, Q5_0, Q8_0) or n (Q4_1, Q5_1); d, m its fields. */
FXQ_INLINE void decode32(int t, const uint8_t *p, int8_t wq[32], float *d, float *m) {
    *d = fxq_h2f(fxq_u16(p));
    *m = 0.0f;
    switch (t) {
        case FX_QT_Q4_0:
            for (int e = 0; e < 16; e++) {
                wq[e] = (int8_t)((p[2 + e] & 15) - 8);
                wq[e + 16] = (int8_t)((p[2 + e] >> 4) - 8);
            }
            break;
        case FX_QT_Q4_1:
            *m = fxq_h2f(fxq_u16(p + 2));
            for (int e = 0; e < 16; e++) {
                wq[e] = (int8_t)(p[4 + e] & 15);
                wq[e + 16] = (int8_t)(p[4 + e] >> 4);
            }
            break;
        case FX_QT_Q5_0: {
            uint32_t qh = fxq_u32(p + 2);
            for (int e = 0; e < 16; e++) {
                wq[e] = (int8_t)(((p[6 + e] & 15) | ((qh >> e) & 1) << 4) - 16);
                wq[e + 16] = (int8_t)(((p[6 + e] >> 4) | ((qh >> (e + 16)) & 1) << 4) - 16);
            }
            break;
        }
        case FX_QT_Q5_1: {
            *m = fxq_h2f(fxq_u16(p + 2));
            uint32_t qh = fxq_u32(p + 4);
            for (int e = 0; e < 16; e++) {
                wq[e] = (int8_t)((p[8 + e] & 15) | ((qh >> e) & 1) << 4);
                wq[e + 16] = (int8_t)((p[8 + e] >> 4) | ((qh >> (e + 16)) & 1) << 4);
            }
            break;
        }
        default: /* Q8_0 */
            memcpy(wq, p + 2, 32);
            break;
    }
}

FXQ_INLINE void rows_q32(int t, int bytes, const uint8_t *w, int64_t rb, int64_t n_rows, const fxq_act *a, int m,
                         float *y, int64_t ldy) {
    int64_t k = a->k, nb = k / 32;
    int has_min = t == FX_QT_Q4_1 || t == FX_QT_Q5_1;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = w + r * rb;
        float acc[FXQ_TILE_M] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int8_t wq[32];
            float d, mm;
            decode32(t, row + b * bytes, wq, &d, &mm);
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q32 + i * k + 32 * b;
                int s = 0;
                for (int e = 0; e < 32; e++) s += wq[e] * xq[e];
                acc[i] += (d * a->d32[i * nb + b]) * (float)s;
                if (has_min) acc[i] += mm * a->s32[i * nb + b];
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = acc[i];
    }
}

/* K types: per 256-block, n (Q4_K, Q5_K: 0..31) or q - 32 (Q6_K) for every element, and the block's scales. */
FXQ_INLINE void rows_k(int t, const uint8_t *w, int64_t rb, int64_t n_rows, const fxq_act *a, int m, float *y,
                       int64_t ldy) {
    int64_t k = a->k, nb = k / 256;
    int bytes = t == FX_QT_Q4_K ? FXQ_BYTES_Q4_K : t == FX_QT_Q5_K ? FXQ_BYTES_Q5_K : FXQ_BYTES_Q6_K;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = w + r * rb;
        float acc[FXQ_TILE_M] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = row + b * bytes;
            int8_t wq[256];
            int sc[16];
            uint8_t sc8[8], mn[8];
            float d, dmin = 0.0f;
            if (t == FX_QT_Q6_K) {
                d = fxq_h2f(fxq_u16(p + 208));
                fxq_q6k_ints(p, wq);
                for (int g = 0; g < 16; g++) sc[g] = (int8_t)p[192 + g];
            } else {
                int five = t == FX_QT_Q5_K;
                const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
                d = fxq_h2f(fxq_u16(p));
                dmin = fxq_h2f(fxq_u16(p + 2));
                fxq_k4_scales(p + 4, sc8, mn);
                for (int j = 0; j < 8; j++) {
                    sc[j] = sc8[j];
                    for (int l = 0; l < 32; l++) {
                        int n = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
                        if (five) n |= ((qh[l] >> j) & 1) << 4;
                        wq[32 * j + l] = (int8_t)n;
                    }
                }
            }
            for (int i = 0; i < m; i++) {
                const int8_t *xq = a->q256 + i * k + 256 * b;
                float dx = a->d256[i * (k / 256) + b];
                int isum = 0;
                if (t == FX_QT_Q6_K) {
                    for (int g = 0; g < 16; g++) {
                        int s = 0;
                        for (int e = 0; e < 16; e++) s += wq[16 * g + e] * xq[16 * g + e];
                        isum += sc[g] * s;
                    }
                    acc[i] += (d * dx) * (float)isum;
                } else {
                    const int16_t *bs = a->bs256 + i * (k / 16) + 16 * b;
                    int msum = 0;
                    for (int j = 0; j < 8; j++) {
                        int s = 0;
                        for (int e = 0; e < 32; e++) s += wq[32 * j + e] * xq[32 * j + e];
                        isum += sc[j] * s;
                        msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
                    }
                    acc[i] += (d * dx) * (float)isum - (dmin * dx) * (float)msum;
                }
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = acc[i];
    }
}

/* F32 / F16 / BF16: fp32 dot products, the weights converted 64 at a time. */
FXQ_INLINE void rows_float(int t, const uint8_t *w, int64_t rb, int64_t n_rows, const fxq_act *a, int m, float *y,
                           int64_t ldy) {
    int64_t k = a->k;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = w + r * rb;
        float acc[FXQ_TILE_M] = {0};
        for (int64_t e0 = 0; e0 < k; e0 += 64) {
            int n = (int)(k - e0 < 64 ? k - e0 : 64);
            float wf[64];
            for (int e = 0; e < n; e++) {
                const uint8_t *p = row + (e0 + e) * (t == FX_QT_F32 ? 4 : 2);
                if (t == FX_QT_F32) memcpy(&wf[e], p, 4);
                else if (t == FX_QT_F16) wf[e] = fxq_h2f(fxq_u16(p));
                else wf[e] = fx_bf16_to_f32(fxq_u16(p));
            }
            for (int i = 0; i < m; i++) {
                const float *x = a->x + i * k + e0;
                float s = 0.0f;
                for (int e = 0; e < n; e++) s += wf[e] * x[e];
                acc[i] += s;
            }
        }
        for (int i = 0; i < m; i++) y[i * ldy + r] = acc[i];
    }
}

#define ROWS_FN(name, call)                                                                                      \
    static void name(const uint8_t *w, int64_t rb, int64_t n_rows, const fxq_act *a, int m, float *y,          \
                     int64_t ldy) {                                                                              \
        call;                                                                                                    \
    }
ROWS_FN(rows_q4_0, rows_q32(FX_QT_Q4_0, FXQ_BYTES_Q4_0, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_q4_1, rows_q32(FX_QT_Q4_1, FXQ_BYTES_Q4_1, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_q5_0, rows_q32(FX_QT_Q5_0, FXQ_BYTES_Q5_0, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_q5_1, rows_q32(FX_QT_Q5_1, FXQ_BYTES_Q5_1, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_q8_0, rows_q32(FX_QT_Q8_0, FXQ_BYTES_Q8_0, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_q4_k, rows_k(FX_QT_Q4_K, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_q5_k, rows_k(FX_QT_Q5_K, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_q6_k, rows_k(FX_QT_Q6_K, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_f32, rows_float(FX_QT_F32, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_f16, rows_float(FX_QT_F16, w, rb, n_rows, a, m, y, ldy))
ROWS_FN(rows_bf16, rows_float(FX_QT_BF16, w, rb, n_rows, a, m, y, ldy))

static void dequant_row_portable(int32_t t, const uint8_t *row, int64_t k, float *out) {
    fxq_dequant_row_generic(t, row, k, out);
}

static void dequant_row_portable_bf16(int32_t t, const uint8_t *row, int64_t k, uint16_t *out) {
    fxq_dequant_row_bf16_generic(t, row, k, out);
}

const fx_qkernels fx_qkernels_portable = {
    "portable",
    {
        [FX_QT_F32] = rows_f32, [FX_QT_F16] = rows_f16, [FX_QT_BF16] = rows_bf16, [FX_QT_Q4_0] = rows_q4_0,
        [FX_QT_Q4_1] = rows_q4_1, [FX_QT_Q5_0] = rows_q5_0, [FX_QT_Q5_1] = rows_q5_1, [FX_QT_Q8_0] = rows_q8_0,
        [FX_QT_Q4_K] = rows_q4_k, [FX_QT_Q5_K] = rows_q5_k, [FX_QT_Q6_K] = rows_q6_k,
    },
    dequant_row_portable,
    dequant_row_portable_bf16,
};
