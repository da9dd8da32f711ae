/* fx_quant.c -- matrix products with quantized (GGUF) weights: validation, the activations' quantization, work
 * splitting over the pool and the kernel dispatch.  fluxion.h ("QUANTIZED WEIGHTS") is the contract; the inner
 * loops are per SIMD path in fx_quant_<path>.c. */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include "fx_quant.h"
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif

/* Sizes past these are refused as FX_E_QSHAPE: they keep every byte count below 2^62 without further checks. */
#define FXQ_MAX_K (INT64_C(1) << 36)
#define FXQ_MAX_ROWS (INT64_C(1) << 40)

/* Activation formats */
enum { FMT_FLOAT = 0, FMT_Q32 = 1, FMT_Q256 = 2 };

typedef struct {
    int32_t block, bytes, fmt;
} qtype_info;

static int type_info(int32_t t, qtype_info *ti) {
    switch (t) {
        case FX_QT_F32: *ti = (qtype_info){1, 4, FMT_FLOAT}; return 1;
        case FX_QT_F16: *ti = (qtype_info){1, 2, FMT_FLOAT}; return 1;
        case FX_QT_BF16: *ti = (qtype_info){1, 2, FMT_FLOAT}; return 1;
        case FX_QT_Q4_0: *ti = (qtype_info){32, FXQ_BYTES_Q4_0, FMT_Q32}; return 1;
        case FX_QT_Q4_1: *ti = (qtype_info){32, FXQ_BYTES_Q4_1, FMT_Q32}; return 1;
        case FX_QT_Q5_0: *ti = (qtype_info){32, FXQ_BYTES_Q5_0, FMT_Q32}; return 1;
        case FX_QT_Q5_1: *ti = (qtype_info){32, FXQ_BYTES_Q5_1, FMT_Q32}; return 1;
        case FX_QT_Q8_0: *ti = (qtype_info){32, FXQ_BYTES_Q8_0, FMT_Q32}; return 1;
        case FX_QT_Q4_K: *ti = (qtype_info){256, FXQ_BYTES_Q4_K, FMT_Q256}; return 1;
        case FX_QT_Q5_K: *ti = (qtype_info){256, FXQ_BYTES_Q5_K, FMT_Q256}; return 1;
        case FX_QT_Q6_K: *ti = (qtype_info){256, FXQ_BYTES_Q6_K, FMT_Q256}; return 1;
        default: return 0;
    }
}

int32_t fx_qblock_size(int32_t wtype) {
    qtype_info ti;
    return type_info(wtype, &ti) ? ti.block : 0;
}

/* Row bytes of a valid (type, k), or -FX_E_* */
static int64_t row_bytes_of(int32_t t, int64_t k, qtype_info *ti) {
    if (!type_info(t, ti)) return -FX_E_QTYPE;
    if (k <= 0 || k > FXQ_MAX_K || k % ti->block) return -FX_E_QSHAPE;
    return k / ti->block * ti->bytes;
}

int64_t fx_qrow_bytes(int32_t wtype, int64_t k) {
    qtype_info ti;
    return row_bytes_of(wtype, k, &ti);
}

/* ------------------------------------------------------------------------------------------------- settings -- */

static int g_vnni = 1;

static int cpu_has_vnni(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && fx_simd_supported(FX_SIMD_AVX512);
#else
    return 0;
#endif
}

int fx_set_vnni(int on) {
    g_vnni = on != 0;
    return g_vnni && cpu_has_vnni();
}

static const fx_qkernels *qkern(void) {
    switch (fx_get_simd()) {
        case FX_SIMD_AVX512:
        case FX_SIMD_AVX512_BF16: return g_vnni && cpu_has_vnni() ? &fx_qkernels_avx512vnni : &fx_qkernels_avx512;
        case FX_SIMD_AVX2: return &fx_qkernels_avx2;
        default: return &fx_qkernels_portable;
    }
}

/* ------------------------------------------------------------------------------------------------ workspace -- */

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* Bytes of one format's arrays for m rows of k (k a multiple of the format's block). */
static int64_t fmt_bytes(int fmt, int64_t m, int64_t k) {
    if (fmt == FMT_Q32) return align64(m * k) + 2 * align64(m * (k / 32) * 4);
    if (fmt == FMT_Q256) return align64(m * k) + align64(m * (k / 256) * 4) + align64(m * (k / 16) * 2);
    return 0;
}

/* fmts: bit FMT_Q32 / FMT_Q256 set for each format used.  64 bytes of slack align the caller's pointer. */
static int64_t work_bytes_for(unsigned fmts, int64_t m, int64_t k) {
    int64_t n = 0;
    if (fmts & (1u << FMT_Q32)) n += fmt_bytes(FMT_Q32, m, k);
    if (fmts & (1u << FMT_Q256)) n += fmt_bytes(FMT_Q256, m, k);
    return n ? n + 64 : 0;
}

int64_t fx_qmatmul_workspace(int32_t wtype, int64_t m, int64_t k) {
    if (m < 0 || m > FXQ_MAX_ROWS || k <= 0 || k > FXQ_MAX_K) return -FX_E_QSHAPE;
    unsigned fmts = 0;
    if (wtype == FX_QT_ANY) {
        if (k % 32 == 0) fmts |= 1u << FMT_Q32;
        if (k % 256 == 0) fmts |= 1u << FMT_Q256;
    } else {
        qtype_info ti;
        int64_t rb = row_bytes_of(wtype, k, &ti);
        if (rb < 0) return rb;
        if (ti.fmt != FMT_FLOAT) fmts |= 1u << ti.fmt;
    }
    return m ? work_bytes_for(fmts, m, k) : 0;
}

/* ------------------------------------------------------------------------------ activation quantization -- */

/* q[0 .. n) = x quantized (fluxion.h: dx = amax / 127, qx = x * (127 / amax) rounded half to even); returns
 * sum(q) and stores dx.  n is a multiple of 16. */
static int quantize_block(const float *x, int n, int8_t *q, float *dx) {
    float amax = 0.0f;
    int bad = 0;
    for (int e = 0; e < n; e++) {
        float a = fabsf(x[e]);
        bad |= !(a <= FLT_MAX); /* NaN or infinity */
        amax = a > amax ? a : amax;
    }
    if (bad || amax == 0.0f) {
        memset(q, 0, (size_t)n);
        *dx = bad ? NAN : 0.0f;
        return 0;
    }
    *dx = amax / 127.0f;
    float id = 127.0f / amax;
    int sum = 0;
#if defined(__x86_64__) || defined(__i386__)
    /* cvtps2dq rounds by MXCSR: half to even unless someone changed the rounding mode (nobody does; flush-to-zero
     * and denormals-are-zero do not matter here: |x * id| >= 2^-126 or it rounds to 0 either way) */
    const __m128 vid = _mm_set1_ps(id);
    for (int e = 0; e < n; e += 4) {
        __m128i v = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + e), vid));
        int32_t t[4];
        _mm_storeu_si128((__m128i *)t, v);
        for (int j = 0; j < 4; j++) {
            q[e + j] = (int8_t)t[j];
            sum += t[j];
        }
    }
#else
    for (int e = 0; e < n; e++) {
        volatile float p = x[e] * id; /* the fp32 product, then the rounding (no fused multiply-add) */
        int v = (int)lrintf(p);
        q[e] = (int8_t)v;
        sum += v;
    }
#endif
    return sum;
}

typedef struct {
    int8_t *q32;
    float *d32, *s32;
    int8_t *q256;
    float *d256;
    int16_t *bs256;
} act_bufs;

/* Carve the workspace (aligned to 64 inside) for the formats in fmts. */
static act_bufs carve(void *work, unsigned fmts, int64_t m, int64_t k) {
    act_bufs B = {0};
    char *p = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    if (fmts & (1u << FMT_Q32)) {
        B.q32 = (int8_t *)p;
        p += align64(m * k);
        B.d32 = (float *)p;
        p += align64(m * (k / 32) * 4);
        B.s32 = (float *)p;
        p += align64(m * (k / 32) * 4);
    }
    if (fmts & (1u << FMT_Q256)) {
        B.q256 = (int8_t *)p;
        p += align64(m * k);
        B.d256 = (float *)p;
        p += align64(m * (k / 256) * 4);
        B.bs256 = (int16_t *)p;
    }
    return B;
}

static void quantize_rows(const float *x, int64_t i0, int64_t i1, int64_t k, unsigned fmts, const act_bufs *B) {
    for (int64_t i = i0; i < i1; i++) {
        const float *xr = x + i * k;
        if (fmts & (1u << FMT_Q32)) {
            int64_t nb = k / 32;
            for (int64_t b = 0; b < nb; b++) {
                float *d = B->d32 + i * nb + b;
                int sum = quantize_block(xr + 32 * b, 32, B->q32 + i * k + 32 * b, d);
                B->s32[i * nb + b] = *d * (float)sum;
            }
        }
        if (fmts & (1u << FMT_Q256)) {
            int64_t nb = k / 256;
            for (int64_t b = 0; b < nb; b++) {
                int8_t *q = B->q256 + i * k + 256 * b;
                quantize_block(xr + 256 * b, 256, q, B->d256 + i * nb + b);
                int16_t *bs = B->bs256 + i * (k / 16) + 16 * b;
                for (int g = 0; g < 16; g++) {
                    int s = 0;
                    for (int e = 0; e < 16; e++) s += q[16 * g + e];
                    bs[g] = (int16_t)s;
                }
            }
        }
    }
}

/* x's rows quantized on the pool, one row per item (from m = FXQ_POOL_QUANT_M; fewer rows on the caller) */
#define FXQ_POOL_QUANT_M 4

typedef struct {
    const float *x;
    int64_t m, k;
    unsigned fmts;
    const act_bufs *B;
    _Atomic int64_t next;
} quant_job;

static void quant_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    quant_job *J = ctx;
    for (int64_t i; (i = atomic_fetch_add_explicit(&J->next, 1, memory_order_relaxed)) < J->m;)
        quantize_rows(J->x, i, i + 1, J->k, J->fmts, J->B);
}

static void quantize_all(const float *x, int64_t m, int64_t k, unsigned fmts, const act_bufs *B) {
    if (!fmts) return;
    if (m < FXQ_POOL_QUANT_M || fx_pool_threads() == 1) {
        quantize_rows(x, 0, m, k, fmts, B);
        return;
    }
    quant_job J = {x, m, k, fmts, B, 0};
    fx_pool_run(quant_worker, &J);
}

/* ----------------------------------------------------------------------------------------------- products -- */

typedef struct {
    const uint8_t *w;
    int64_t n_out, row_bytes, items, ldy;
    float *y;
    fxq_rows_fn fn;
} qmm_weight;

typedef struct {
    qmm_weight W[FX_QMM_MAX_MANY];
    int n;
    int64_t m, k, rows_per_item, total_items;
    act_bufs B;
    const float *x;
    _Atomic int64_t next;
} qmm_job;

/* The activations of x rows i0 .. (a tile) */
static fxq_act act_tile(const qmm_job *J, int64_t i0) {
    int64_t k = J->k;
    fxq_act a = {k, NULL, NULL, NULL, NULL, NULL, NULL, J->x + i0 * k};
    if (J->B.q32) {
        a.q32 = J->B.q32 + i0 * k;
        a.d32 = J->B.d32 + i0 * (k / 32);
        a.s32 = J->B.s32 + i0 * (k / 32);
    }
    if (J->B.q256) {
        a.q256 = J->B.q256 + i0 * k;
        a.d256 = J->B.d256 + i0 * (k / 256);
        a.bs256 = J->B.bs256 + i0 * (k / 16);
    }
    return a;
}

/* Items: chunks of rows_per_item output rows of one weight, weights one after the other.  Within an item, the x
 * rows go by tiles of FXQ_TILE_M (one tile when m <= 16: each weight row is read once), the item's weight rows
 * inner so that they come from cache for the tiles after the first. */
static void qmm_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    qmm_job *J = ctx;
    for (;;) {
        int64_t it = atomic_fetch_add_explicit(&J->next, 1, memory_order_relaxed);
        if (it >= J->total_items) return;
        int j = 0;
        while (it >= J->W[j].items) it -= J->W[j++].items;
        const qmm_weight *W = &J->W[j];
        int64_t r0 = it * J->rows_per_item, r1 = r0 + J->rows_per_item;
        if (r1 > W->n_out) r1 = W->n_out;
        for (int64_t i0 = 0; i0 < J->m; i0 += FXQ_TILE_M) {
            int mt = (int)(J->m - i0 < FXQ_TILE_M ? J->m - i0 : FXQ_TILE_M);
            fxq_act a = act_tile(J, i0);
            W->fn(W->w + r0 * W->row_bytes, W->row_bytes, r1 - r0, &a, mt, W->y + i0 * W->ldy + r0, W->ldy);
        }
    }
}

int fxq_matmul_ld(int32_t n, const int32_t *wtypes, const void *const *ws, const int64_t *n_outs,
                  const int64_t *ldys, int64_t k, const float *x, int64_t m, float *const *ys, void *work,
                  int64_t work_bytes) {
    if (n < 0 || n > FX_QMM_MAX_MANY || m < 0 || m > FXQ_MAX_ROWS) return FX_E_QSHAPE;
    if (n > 0 && (!wtypes || !ws || !n_outs || !ys)) return FX_E_QSHAPE;
    /* every check first: a bad type wins over a bad shape of the same weight, any error over the workspace */
    unsigned fmts = 0;
    int64_t total_rows = 0, max_row_bytes = 0;
    qtype_info ti;
    for (int j = 0; j < n; j++) {
        int64_t rb = row_bytes_of(wtypes[j], k, &ti);
        if (rb < 0) return (int)-rb;
        if (n_outs[j] < 0 || n_outs[j] > FXQ_MAX_ROWS) return FX_E_QSHAPE;
        if (n_outs[j] > 0 && !ws[j]) return FX_E_QSHAPE;
        if (m > 0 && n_outs[j] > 0 && !ys[j]) return FX_E_QSHAPE;
        if (ldys && ldys[j] < n_outs[j]) return FX_E_QSHAPE;
        if (ti.fmt != FMT_FLOAT) fmts |= 1u << ti.fmt;
        total_rows += n_outs[j];
        if (rb > max_row_bytes) max_row_bytes = rb;
    }
    if (n > 0 && k > 0 && m > 0 && !x) return FX_E_QSHAPE;
    int64_t need = m ? work_bytes_for(fmts, m, k) : 0;
    if (need > 0 && !work) return FX_E_QSHAPE;
    if (work_bytes < need) return FX_E_OUTPUT;
    if (m == 0 || total_rows == 0) return FX_OK;

    const fx_qkernels *K = qkern();
    qmm_job J;
    memset(&J, 0, sizeof J);
    J.n = n;
    J.m = m;
    J.k = k;
    J.x = x;
    J.B = carve(work, fmts, m, k);
    quantize_all(x, m, k, fmts, &J.B);
    /* Rows per item: about 8 items per thread for balance, a multiple of 16 (whole cache lines of y for m = 1),
     * and at most what keeps an item's weight rows within ~512 KB (L2) for the x tiles after the first. */
    int64_t threads = fx_pool_threads();
    int64_t rpi = (total_rows + threads * 8 - 1) / (threads * 8);
    rpi = (rpi + 15) & ~(int64_t)15;
    int64_t cap = ((int64_t)(512 << 10) / (max_row_bytes > 0 ? max_row_bytes : 1)) & ~(int64_t)15;
    if (cap < 16) cap = 16;
    if (rpi > cap) rpi = cap;
    if (rpi > 1024) rpi = 1024;
    if (rpi < 16) rpi = 16;
    J.rows_per_item = rpi;
    for (int j = 0; j < n; j++) {
        int64_t rb = row_bytes_of(wtypes[j], k, &ti);
        J.W[j] = (qmm_weight){(const uint8_t *)ws[j], n_outs[j], rb, (n_outs[j] + rpi - 1) / rpi,
                              ldys ? ldys[j] : n_outs[j], ys[j], K->rows[wtypes[j]]};
        J.total_items += J.W[j].items;
    }
    atomic_store(&J.next, 0);
    fx_pool_run(qmm_worker, &J);
    return FX_OK;
}

int fx_qmatmul(int32_t wtype, const void *w, int64_t n_out, int64_t k, const float *x, int64_t m, float *y, void *work,
               int64_t work_bytes) {
    return fxq_matmul_ld(1, &wtype, &w, &n_out, NULL, k, x, m, &y, work, work_bytes);
}

int fx_qmatmul_many(int32_t n, const int32_t *wtypes, const void *const *ws, const int64_t *n_outs, int64_t k,
                    const float *x, int64_t m, float *const *ys, void *work, int64_t work_bytes) {
    return fxq_matmul_ld(n, wtypes, ws, n_outs, NULL, k, x, m, ys, work, work_bytes);
}

/* ---------------------------------------------------------------------------------------------- dequantize -- */

typedef struct {
    const fx_qkernels *K;
    int32_t t;
    const uint8_t *w;
    int64_t row0, n_rows, k, row_bytes, rows_per_item, items;
    float *out;       /* fp32 output, or NULL with out16 */
    uint16_t *out16;  /* bf16 output */
    _Atomic int64_t next;
} deq_job;

static void deq_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    deq_job *J = ctx;
    for (;;) {
        int64_t it = atomic_fetch_add_explicit(&J->next, 1, memory_order_relaxed);
        if (it >= J->items) return;
        int64_t r0 = it * J->rows_per_item, r1 = r0 + J->rows_per_item;
        if (r1 > J->n_rows) r1 = J->n_rows;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = J->w + (J->row0 + r) * J->row_bytes;
            if (J->out) J->K->dequant_row(J->t, row, J->k, J->out + r * J->k);
            else J->K->dequant_row_bf16(J->t, row, J->k, J->out16 + r * J->k);
        }
    }
}

/* fx_dequantize and fx_dequantize_bf16: exactly one of out / out16 non-NULL (elem_bytes: its element size). */
static int dequantize(int32_t wtype, const void *w, int64_t row0, int64_t n_rows, int64_t k, float *out,
                      uint16_t *out16, int64_t elem_bytes) {
    qtype_info ti;
    int64_t rb = row_bytes_of(wtype, k, &ti);
    if (rb < 0) return (int)-rb;
    if (row0 < 0 || n_rows < 0 || row0 > FXQ_MAX_ROWS || n_rows > FXQ_MAX_ROWS) return FX_E_QSHAPE;
    if (n_rows == 0) return FX_OK;
    if (!w || (!out && !out16)) return FX_E_QSHAPE;
    deq_job J;
    memset(&J, 0, sizeof J);
    J.K = qkern();
    J.t = wtype;
    J.w = (const uint8_t *)w;
    J.row0 = row0;
    J.n_rows = n_rows;
    J.k = k;
    J.row_bytes = rb;
    J.out = out;
    J.out16 = out16;
    /* about 4 items per thread, each at most ~256 KB of output */
    int64_t threads = fx_pool_threads();
    int64_t rpi = (n_rows + threads * 4 - 1) / (threads * 4);
    int64_t cap = (INT64_C(1) << 18) / (k * elem_bytes);
    if (rpi > cap) rpi = cap;
    if (rpi < 1) rpi = 1;
    J.rows_per_item = rpi;
    J.items = (n_rows + rpi - 1) / rpi;
    atomic_store(&J.next, 0);
    fx_pool_run(deq_worker, &J);
    return FX_OK;
}

int fx_dequantize(int32_t wtype, const void *w, int64_t row0, int64_t n_rows, int64_t k, float *out) {
    return dequantize(wtype, w, row0, n_rows, k, out, NULL, 4);
}

int fx_dequantize_bf16(int32_t wtype, const void *w, int64_t row0, int64_t n_rows, int64_t k, uint16_t *out) {
    return dequantize(wtype, w, row0, n_rows, k, NULL, out, 2);
}
