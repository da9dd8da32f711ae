/* Internal interfaces of the quantized-weight kernels (fx_quant*.c): the quantized activations as the kernels read
 * them, the per-SIMD-path kernel table, and the block-format helpers every path shares.  fluxion.h ("QUANTIZED
 * WEIGHTS") states the block layouts and the arithmetic; this file only names them for the C code. */
#ifndef FX_QUANT_H
#define FX_QUANT_H

#include <stdint.h>
#include <string.h>
#include "fx_internal.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define FXQ_NTYPES 31   /* type ids 0 .. 30 index the kernel tables */
#define FXQ_TILE_M 16   /* rows of x handled per pass over a weight row */

/* Block sizes and bytes per block (fluxion.h's table). */
enum {
    FXQ_BYTES_Q4_0 = 18, FXQ_BYTES_Q4_1 = 20, FXQ_BYTES_Q5_0 = 22, FXQ_BYTES_Q5_1 = 24, FXQ_BYTES_Q8_0 = 34,
    FXQ_BYTES_Q4_K = 144, FXQ_BYTES_Q5_K = 176, FXQ_BYTES_Q6_K = 210,
};

/* The activations of a tile of x rows, quantized (fx_quant.c, quantize_rows) or as given.  Row i of the tile starts
 * at i * k (q, x), i * (k / 32) (d32, s32), i * (k / 256) (d256), i * (k / 16) (bs256); pointers of a format the call
 * does not use are NULL. */
typedef struct fxq_act {
    int64_t k;
    const int8_t *q32;     /* 32-block format: qx [k] */
    const float *d32;      /*   dx per 32-block */
    const float *s32;      /*   dx * sum(qx) per 32-block (fp32 product) */
    const int8_t *q256;    /* 256-block format (K types): qx [k] */
    const float *d256;     /*   dx per 256-block */
    const int16_t *bs256;  /*   sum(qx) per 16 elements */
    const float *x;        /* F32/F16/BF16 weights: x as given [k] */
} fxq_act;

/* y[i * ldy + r] = dot(weight row r, x row i) for r < n_rows, i < m (1 <= m <= FXQ_TILE_M); weight row r at
 * w + r * row_bytes.  Each weight row is read from memory once for all m rows. */
typedef void (*fxq_rows_fn)(const uint8_t *w, int64_t row_bytes, int64_t n_rows, const fxq_act *a, int m, float *y,
                            int64_t ldy);

typedef struct fx_qkernels {
    const char *name;
    fxq_rows_fn rows[FXQ_NTYPES]; /* by type id; NULL for ids that are not weight types */
    /* out[0 .. k) = one row of type wtype, as fp32 (fluxion.h's formulas, bit for bit on every path) */
    void (*dequant_row)(int32_t wtype, const uint8_t *row, int64_t k, float *out);
    /* the same row rounded to bf16 (fx_dequantize_bf16), bit for bit on every path */
    void (*dequant_row_bf16)(int32_t wtype, const uint8_t *row, int64_t k, uint16_t *out);
} fx_qkernels;

/* fx_qmatmul_many with a row stride per output: ys[j] row i at ys[j] + i * ldys[j] (ldys[j] >= n_outs[j]; ldys NULL:
 * n_outs), so several products can fill one interleaved output (fx_layer_qkv's q/k/v rows).  Same checks. */
int fxq_matmul_ld(int32_t n, const int32_t *wtypes, const void *const *ws, const int64_t *n_outs,
                  const int64_t *ldys, int64_t k, const float *x, int64_t m, float *const *ys, void *work,
                  int64_t work_bytes);

extern const fx_qkernels fx_qkernels_portable;
extern const fx_qkernels fx_qkernels_avx2;
extern const fx_qkernels fx_qkernels_avx512;      /* AVX-512BW integer dot products */
extern const fx_qkernels fx_qkernels_avx512vnni;  /* the same kernels with AVX512-VNNI instructions */

/* ---- shared helpers (static inline: each path's file compiles them for its own instruction set) ---- */

/* Software prefetch of the weight stream, this many bytes ahead of the block being read.  A thread reads its rows
 * front to back, so the bytes ahead are its next rows (or, at the end of an item, another thread's: harmless). */
#ifndef FXQ_PF_DIST
#define FXQ_PF_DIST 8192
#endif

/* Prefetch the cache lines of [p + FXQ_PF_DIST, p + FXQ_PF_DIST + n) (n: the bytes of one step of the loop). */
static inline __attribute__((always_inline)) void fxq_prefetch(const uint8_t *p, int n) {
    for (int o = 0; o < n; o += 64) __builtin_prefetch(p + FXQ_PF_DIST + o, 0, 2);
}

static inline uint16_t fxq_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t fxq_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q4_K / Q5_K: the eight 6-bit scales and mins packed in 12 bytes (fluxion.h, Q4_K). */
static inline void fxq_k4_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* The same scales and mins as two 64-bit words, byte j = sc[j] (mn[j]), computed on three 32-bit loads (SWAR): bits
 * 6-7 of scales[j] (j < 8) move to bits 4-5 of the same byte by a right shift of 2, masked per byte. */
static inline void fxq_k4_scales64(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a = fxq_u32(s), b = fxq_u32(s + 4), c = fxq_u32(s + 8);
    uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u), mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *sc = (uint64_t)(a & 0x3F3F3F3Fu) | (uint64_t)sc_hi << 32;
    *mn = (uint64_t)(b & 0x3F3F3F3Fu) | (uint64_t)mn_hi << 32;
}

/* fp16 -> fp32, exact (inline, so loops over it vectorise; fx_f16_to_f32's semantics) */
static inline float fxq_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    union { uint32_t u; float f; } c;
    if (em >= 0x7c00u) {                /* inf / nan */
        c.u = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
    } else if (em >= 0x0400u) {         /* normal: exponent rebiased by 112 */
        c.u = sign | ((em << 13) + 0x38000000u);
    } else {                            /* zero and subnormal: em * 2^-24 */
        c.f = (float)em * 5.9604644775390625e-8f;
        c.u |= sign;
    }
    return c.f;
}

/* Q6_K: q(e) - 32 for the 256 elements of a block (fluxion.h's formula, loops in the layout's order) */
static inline void fxq_q6k_ints(const uint8_t *p, int8_t q[256]) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
        int8_t *o = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (int8_t)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
            o[l + 32] = (int8_t)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
            o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

/* One row of any type as fp32.  Each value is computed exactly as fluxion.h writes it, with fp32 operations whose
 * products are all exact, so whatever the compiler does with them (vectorising, contracting a product and a sum into
 * an FMA) the result is the same: the exact value rounded once. */
static inline void fxq_dequant_row_generic(int32_t t, const uint8_t *w, int64_t k, float *out) {
    switch (t) {
        case FX_QT_F32: memcpy(out, w, (size_t)k * 4); return;
        case FX_QT_F16: {
            int64_t e = 0;
#if defined(__F16C__)
            for (; e + 8 <= k; e += 8) _mm256_storeu_ps(out + e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * e))));
#endif
            for (; e < k; e++) out[e] = fxq_h2f(fxq_u16(w + 2 * e));
            return;
        }
        case FX_QT_BF16:
            for (int64_t e = 0; e < k; e++) out[e] = fx_bf16_to_f32(fxq_u16(w + 2 * e));
            return;
        default: break;
    }
    int64_t nb = t >= FX_QT_Q4_K ? k / 256 : k / 32;
    for (int64_t b = 0; b < nb; b++) {
        switch (t) {
            case FX_QT_Q4_0: {
                const uint8_t *p = w + b * FXQ_BYTES_Q4_0, *qs = p + 2;
                float d = fxq_h2f(fxq_u16(p)), *o = out + 32 * b;
                for (int e = 0; e < 16; e++) {
                    o[e] = d * (float)((qs[e] & 15) - 8);
                    o[e + 16] = d * (float)((qs[e] >> 4) - 8);
                }
                break;
            }
            case FX_QT_Q4_1: {
                const uint8_t *p = w + b * FXQ_BYTES_Q4_1, *qs = p + 4;
                float d = fxq_h2f(fxq_u16(p)), m = fxq_h2f(fxq_u16(p + 2)), *o = out + 32 * b;
                for (int e = 0; e < 16; e++) {
                    o[e] = d * (float)(qs[e] & 15) + m;
                    o[e + 16] = d * (float)(qs[e] >> 4) + m;
                }
                break;
            }
            case FX_QT_Q5_0: {
                const uint8_t *p = w + b * FXQ_BYTES_Q5_0, *qs = p + 6;
                float d = fxq_h2f(fxq_u16(p)), *o = out + 32 * b;
                uint32_t qh = fxq_u32(p + 2);
                for (int e = 0; e < 16; e++) {
                    o[e] = d * (float)((int)((qs[e] & 15) | ((qh >> e) & 1) << 4) - 16);
                    o[e + 16] = d * (float)((int)((qs[e] >> 4) | ((qh >> (e + 16)) & 1) << 4) - 16);
                }
                break;
            }
            case FX_QT_Q5_1: {
                const uint8_t *p = w + b * FXQ_BYTES_Q5_1, *qs = p + 8;
                float d = fxq_h2f(fxq_u16(p)), m = fxq_h2f(fxq_u16(p + 2)), *o = out + 32 * b;
                uint32_t qh = fxq_u32(p + 4);
                for (int e = 0; e < 16; e++) {
                    o[e] = d * (float)((qs[e] & 15) | ((qh >> e) & 1) << 4) + m;
                    o[e + 16] = d * (float)((qs[e] >> 4) | ((qh >> (e + 16)) & 1) << 4) + m;
                }
                break;
            }
            case FX_QT_Q8_0: {
                const uint8_t *p = w + b * FXQ_BYTES_Q8_0;
                float d = fxq_h2f(fxq_u16(p)), *o = out + 32 * b;
                for (int e = 0; e < 32; e++) o[e] = d * (float)(int8_t)p[2 + e];
                break;
            }
            case FX_QT_Q4_K:
            case FX_QT_Q5_K: {
                int five = t == FX_QT_Q5_K;
                const uint8_t *p = w + b * (five ? FXQ_BYTES_Q5_K : FXQ_BYTES_Q4_K);
                const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
                float d = fxq_h2f(fxq_u16(p)), dmin = fxq_h2f(fxq_u16(p + 2)), *o = out + 256 * b;
                uint8_t sc[8], mn[8];
                fxq_k4_scales(p + 4, sc, mn);
                for (int j = 0; j < 8; j++) {
                    float dj = d * (float)sc[j], mj = dmin * (float)mn[j];
                    const uint8_t *q = qs + 32 * (j / 2);
                    int shift = 4 * (j % 2);
                    for (int l = 0; l < 32; l++) {
                        int n = (q[l] >> shift) & 15;
                        if (five) n |= ((qh[l] >> j) & 1) << 4;
                        o[32 * j + l] = dj * (float)n - mj;
                    }
                }
                break;
            }
            case FX_QT_Q6_K: {
                const uint8_t *p = w + b * FXQ_BYTES_Q6_K;
                const int8_t *scales = (const int8_t *)(p + 192);
                float d = fxq_h2f(fxq_u16(p + 208)), *o = out + 256 * b;
                int8_t q[256];
                fxq_q6k_ints(p, q);
                for (int g = 0; g < 16; g++) {
                    float dg = d * (float)scales[g];
                    for (int e = 0; e < 16; e++) o[16 * g + e] = dg * (float)q[16 * g + e];
                }
                break;
            }
            default: break;
        }
    }
}

/* Elements of a row dequantized to fp32 at a time on the way to bf16: a multiple of every block size, 16 KB of
 * stack, so a row of any width goes through L1 without a buffer from the caller. */
#define FXQ_BF16_CHUNK 4096

/* out[e] = in[e] rounded to bf16, to nearest with ties to even, NaN -> 0x7fc0: torch's conversion for every
 * non-NaN value, so a prefill GEMM's bf16 weights are those of dequantizing to fp32 and converting.  A plain loop:
 * each path's file compiles it for its instruction set. */
static inline void fxq_f32_to_bf16(const float *in, int64_t n, uint16_t *out) {
    for (int64_t e = 0; e < n; e++) {
        uint32_t u;
        memcpy(&u, in + e, 4);
        uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        out[e] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
    }
}

/* One row of any type as bf16: fxq_dequant_row_generic chunk by chunk, each chunk converted while in L1. */
static inline void fxq_dequant_row_bf16_generic(int32_t t, const uint8_t *w, int64_t k, uint16_t *out) {
    float tmp[FXQ_BF16_CHUNK];
    int64_t block, bytes;
    switch (t) {
        case FX_QT_F32: block = 1, bytes = 4; break;
        case FX_QT_F16: case FX_QT_BF16: block = 1, bytes = 2; break;
        case FX_QT_Q4_0: block = 32, bytes = FXQ_BYTES_Q4_0; break;
        case FX_QT_Q4_1: block = 32, bytes = FXQ_BYTES_Q4_1; break;
        case FX_QT_Q5_0: block = 32, bytes = FXQ_BYTES_Q5_0; break;
        case FX_QT_Q5_1: block = 32, bytes = FXQ_BYTES_Q5_1; break;
        case FX_QT_Q8_0: block = 32, bytes = FXQ_BYTES_Q8_0; break;
        case FX_QT_Q4_K: block = 256, bytes = FXQ_BYTES_Q4_K; break;
        case FX_QT_Q5_K: block = 256, bytes = FXQ_BYTES_Q5_K; break;
        case FX_QT_Q6_K: block = 256, bytes = FXQ_BYTES_Q6_K; break;
        default: return;
    }
    for (int64_t e0 = 0; e0 < k; e0 += FXQ_BF16_CHUNK) {
        int64_t n = k - e0 < FXQ_BF16_CHUNK ? k - e0 : FXQ_BF16_CHUNK; /* a multiple of the block, as k is */
        fxq_dequant_row_generic(t, w + e0 / block * bytes, n, tmp);
        fxq_f32_to_bf16(tmp, n, out + e0);
    }
}

#endif
