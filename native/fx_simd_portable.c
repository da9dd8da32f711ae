/* Portable C kernels: the reference path, and the one used on CPUs without AVX2+F16C. */
#include <math.h>
#include <string.h>
#include "fx_internal.h"

float fx_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (exp == 0x1fu) {                 /* inf / nan */
        c.u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {              /* normal */
        c.u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {              /* signed zero */
        c.u = sign;
    } else {                            /* subnormal: value = man * 2^-24 */
        c.f = (float)man * 5.9604644775390625e-8f;
        c.u |= sign;
    }
    return c.f;
}

uint16_t fx_f32_to_f16(float f) {
    union { float f; uint32_t u; } c;
    c.f = f;
    uint16_t sign = (uint16_t)((c.u >> 16) & 0x8000u);
    uint32_t a = c.u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;               /* nan */
    if (a >= 0x477ff000u) return sign | 0x7c00u;              /* inf, or rounds past 65504 */
    if (a >= 0x38800000u) {                                   /* normal half (|f| >= 2^-14): rebias, drop 13 bits */
        uint32_t r = a - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return sign | (uint16_t)(r >> 13);
    }
    c.u = a;                                                  /* subnormal or zero: units of 2^-24, exact scaling */
    return sign | (uint16_t)lrintf(c.f * 16777216.0f);
}

static inline void row_to_f32(const uint16_t *src, int d, int bf16, float *dst) {
    if (bf16) {
        for (int e = 0; e < d; e++) dst[e] = fx_bf16_to_f32(src[e]);
    } else {
        for (int e = 0; e < d; e++) dst[e] = fx_f16_to_f32(src[e]);
    }
}

static void qk_portable(const float *q, int r, const uint16_t *k, int len, int d, int bf16, float scale, float *s,
                        int ld, const void *pf, int64_t pf_lines) {
    float kf[FX_MAX_DIM];
    for (int t = 0; t < len; t++) {
        fx_prefetch_share(pf, pf_lines, t, len);
        row_to_f32(k + (int64_t)t * d, d, bf16, kf);
        for (int j = 0; j < r; j++) {
            const float *qj = q + (int64_t)j * d;
            float acc = 0.0f;
            for (int e = 0; e < d; e++) acc += qj[e] * kf[e];
            s[j * ld + t] = acc * scale;
        }
    }
}

static void pv_portable(const float *p, int r, int ld, const uint16_t *v, int len, int d, int bf16, float *acc,
                        const void *pf, int64_t pf_lines) {
    float vf[FX_MAX_DIM];
    for (int t = 0; t < len; t++) {
        fx_prefetch_share(pf, pf_lines, t, len);
        row_to_f32(v + (int64_t)t * d, d, bf16, vf);
        for (int j = 0; j < r; j++) {
            float pj = p[j * ld + t];
            float *aj = acc + (int64_t)j * d;
            for (int e = 0; e < d; e++) aj[e] += pj * vf[e];
        }
    }
}

static void exp_neg_portable(float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = x[i] < -87.0f ? 0.0f : expf(x[i]);
}

static float row_max_portable(const float *x, int n) {
    float m = x[0];
    for (int i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static float exp_sum_portable(float *x, int n, float m) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        float d = x[i] - m;
        x[i] = d < -87.0f ? 0.0f : expf(d);
        sum += x[i];
    }
    return sum;
}

static void stage_copy_portable(void *dst, const void *src, int64_t n, const void *pf, int64_t pf_lines) {
    fx_prefetch_share(pf, pf_lines, 0, 1);
    memcpy(dst, src, (size_t)n);
}
static void fence_portable(void) {}

static void bound_portable(const float *qpos, const float *qneg, const uint16_t *s, int n, int d, int bf16,
                           float *score) {
    float mn[FX_MAX_DIM], mx[FX_MAX_DIM];
    for (int b = 0; b < n; b++) {
        row_to_f32(s + (int64_t)b * 2 * d, d, bf16, mn);
        row_to_f32(s + (int64_t)b * 2 * d + d, d, bf16, mx);
        float acc = 0.0f;
        for (int e = 0; e < d; e++) acc += qpos[e] * mx[e] + qneg[e] * mn[e];
        score[b] = acc;
    }
}

static inline void row_from_f32(const float *src, int d, int bf16, uint16_t *dst) {
    if (bf16) {
        for (int e = 0; e < d; e++) dst[e] = fx_f32_to_bf16(src[e]);
    } else {
        for (int e = 0; e < d; e++) dst[e] = fx_f32_to_f16(src[e]);
    }
}

static void minmax_portable(const uint16_t *k, int len, int d, int bf16, uint16_t *mn16, uint16_t *mx16, int init) {
    float kf[FX_MAX_DIM], mn[FX_MAX_DIM], mx[FX_MAX_DIM];
    if (!init) {
        row_to_f32(mn16, d, bf16, mn);
        row_to_f32(mx16, d, bf16, mx);
    }
    for (int t = 0; t < len; t++) {
        row_to_f32(k + (int64_t)t * d, d, bf16, kf);
        if (init && t == 0) {
            memcpy(mn, kf, sizeof(float) * (size_t)d);
            memcpy(mx, kf, sizeof(float) * (size_t)d);
            continue;
        }
        for (int e = 0; e < d; e++) {
            mn[e] = kf[e] < mn[e] ? kf[e] : mn[e];
            mx[e] = kf[e] > mx[e] ? kf[e] : mx[e];
        }
    }
    if (len > 0 || !init) {
        row_from_f32(mn, d, bf16, mn16);
        row_from_f32(mx, d, bf16, mx16);
    }
}

static void bound_heads_portable(const float *q, int r, const uint16_t *s, int n, int d, int bf16, float *out,
                                 int64_t ld) {
    float mn[FX_MAX_DIM], mx[FX_MAX_DIM];
    for (int b = 0; b < n; b++) {
        row_to_f32(s + (int64_t)b * 2 * d, d, bf16, mn);
        row_to_f32(s + (int64_t)b * 2 * d + d, d, bf16, mx);
        for (int j = 0; j < r; j++) {
            const float *qj = q + (int64_t)j * d;
            float acc = 0.0f;
            for (int e = 0; e < d; e++) acc += qj[e] * (qj[e] > 0 ? mx[e] : mn[e]);
            out[j * ld + b] = acc;
        }
    }
}

static void gap_max_portable(const float *x, int64_t ld, const float *m, int r, int n, float *score) {
    for (int b = 0; b < n; b++) score[b] = x[b] - m[0];
    for (int j = 1; j < r; j++)
        for (int b = 0; b < n; b++) {
            float v = x[j * ld + b] - m[j];
            score[b] = v > score[b] ? v : score[b];
        }
}

static void qk32_portable(const float *q, int r, const float *k, int len, int d, float scale, float *s, int ld) {
    for (int t = 0; t < len; t++)
        for (int j = 0; j < r; j++) {
            const float *qj = q + (int64_t)j * d, *kt = k + (int64_t)t * d;
            float acc = 0.0f;
            for (int e = 0; e < d; e++) acc += qj[e] * kt[e];
            s[(int64_t)j * ld + t] = acc * scale;
        }
}

static void pv32_portable(const float *p, int r, int ld, const float *v, int len, int d, float *acc) {
    for (int t = 0; t < len; t++)
        for (int j = 0; j < r; j++) {
            float pt = p[(int64_t)j * ld + t], *aj = acc + (int64_t)j * d;
            const float *vt = v + (int64_t)t * d;
            for (int e = 0; e < d; e++) aj[e] += pt * vt[e];
        }
}

const fx_kernels fx_kernels_portable = {
    "portable", qk_portable, pv_portable, exp_neg_portable, row_max_portable, exp_sum_portable,
    stage_copy_portable, fence_portable, bound_portable, minmax_portable, bound_heads_portable, gap_max_portable,
    NULL, NULL, /* no bf16 dot products */
    qk32_portable, pv32_portable,
};
